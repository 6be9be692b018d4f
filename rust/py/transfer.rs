//! Shared-state transfer handles: serve tensors in place, fetch one into a buffer.

use crate::net::transfer::{self, Served};
use crate::py::node::{resolve, PyP2PNode};
use crate::py::ring::raw_buffer;
use pyo3::prelude::*;
use pyo3_async_runtimes::tokio::future_into_py;
use std::time::Duration;

/// Keeps a Python object alive from tokio threads (decref deferred to a GIL holder).
struct KeepAlive(#[allow(dead_code)] Py<PyAny>);

#[pymethods]
impl PyP2PNode {
    /// Serves `buffer` (read in place, never copied) under `key` until `unserve_all()`.
    fn serve(&self, key: String, buffer: &Bound<'_, PyAny>) -> PyResult<()> {
        let raw = raw_buffer(buffer, false, "a shared-state tensor")?;
        let keep = Box::new(KeepAlive(buffer.clone().unbind()));
        // SAFETY: `keep` holds the exporting object; callers must not modify or resize
        // the tensor while a sync serves it (documented on sync_shared_state).
        let item = unsafe { Served::new(raw.ptr as *const u8, raw.len, keep) };
        self.node.transfers.serve(key, item);
        Ok(())
    }

    /// Stops serving every tensor.
    fn unserve_all(&self) {
        self.node.transfers.unserve_all();
    }

    /// Payload bytes served to other peers so far.
    fn bytes_served(&self) -> u64 {
        self.node.transfers.bytes_sent()
    }

    /// Fetches `key` from peer `peer_id` at `addr` straight into `out` (writable,
    /// exactly the served length). Resolves to the number of bytes received.
    #[pyo3(signature = (addr, peer_id, key, out, io_timeout=30.0))]
    fn fetch_into<'py>(
        &self,
        py: Python<'py>,
        addr: String,
        peer_id: u64,
        key: String,
        out: &Bound<'py, PyAny>,
        io_timeout: f64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let raw = raw_buffer(out, true, "the fetch buffer")?;
        let keep = KeepAlive(out.clone().unbind());
        let node = self.node.clone();
        let timeout = Duration::from_secs_f64(io_timeout);
        future_into_py(py, async move {
            let _keep = keep;
            // Back the destination with pages in bulk first (much cheaper than a fault
            // per page while bytes arrive).
            let (ptr, len) = (raw.ptr, raw.len);
            let _ = tokio::task::spawn_blocking(move || transfer::prefault(ptr, len)).await;
            let sock = resolve(&addr).await?;
            let mut stream = node.dial_transfer(sock, peer_id).await?;
            // SAFETY: `_keep` holds the exporting object for the whole transfer and the
            // caller hands us a private scratch buffer.
            let dst = unsafe { std::slice::from_raw_parts_mut(raw.ptr as *mut u8, raw.len) };
            let fetched = tokio::select! {
                r = transfer::fetch(&mut stream, &key, dst, timeout) => r,
                _ = node.cancel_token().cancelled() => {
                    Err(crate::error::CoreError::Aborted("the p2p node is closing".into()))
                }
            };
            fetched?;
            Ok(raw.len as u64)
        })
    }
}
