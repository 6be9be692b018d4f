//! Python edge of the shared-state fetch engine (`net/fetch.rs`): `P2PNode.start_fetch`
//! takes the master's plan and returns a `FetchOp`; `run()` fetches it all, `abort()`
//! stops it from anywhere, `rx_bytes` / `tensors_done` report progress meanwhile.

use crate::error::CoreError;
use crate::hash::LEAF_SIZE;
use crate::net::fetch::{self, Entry, Landing, Plan, Progress};
use crate::net::node::Node;
use crate::py::buffer::{Export, Held};
use crate::py::future_into_py;
use crate::py::node::{seconds, PyP2PNode};
use pyo3::prelude::*;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio_util::sync::CancellationToken;

/// One planned tensor from Python: key, destination buffer, content hash, holders.
type PyEntry<'py> = (String, Bound<'py, PyAny>, Vec<u8>, Vec<u64>);

#[pymethods]
impl PyP2PNode {
    /// Prepares the fetch of a sync plan: `entries` are `(key, out, content_hash,
    /// holders)` (`out` a writable buffer of the tensor's size, `holders` peer ids in
    /// the order to try them), `addrs` maps every holder's id to its `"host:port"`.
    /// `streams`: the p2p connection pool size; `io_timeout` bounds any silence of a
    /// holder; `range_bytes` (default `FETCH_RANGE_BYTES`): tensors of twice that or
    /// more are fetched in ranges. Nothing moves before `FetchOp.run()`.
    #[pyo3(signature = (entries, addrs, *, streams=1, io_timeout=30.0, range_bytes=None))]
    fn start_fetch(
        &self,
        py: Python<'_>,
        entries: Vec<PyEntry<'_>>,
        addrs: HashMap<u64, String>,
        streams: usize,
        io_timeout: f64,
        range_bytes: Option<u64>,
    ) -> PyResult<FetchOp> {
        let range_bytes = range_bytes.unwrap_or(fetch::RANGE_BYTES);
        if range_bytes == 0 {
            return Err(CoreError::InvalidArgument("range_bytes must be positive".into()).into());
        }
        let mut spans = Vec::with_capacity(entries.len());
        let mut exports = Vec::with_capacity(entries.len());
        let mut planned = Vec::with_capacity(entries.len());
        for (key, out, want, sources) in entries {
            let export = Export::get(&out, true, &format!("the fetch buffer of {key:?}"))?;
            let raw = export.raw();
            spans.push((raw.ptr, raw.len, key.clone()));
            exports.push(export);
            // SAFETY: the plan keeps every export (`Held`) until the fetch has ended, the
            // buffers do not overlap (checked below), and the caller writes none of them
            // while the fetch runs.
            let dst = unsafe { Landing::new(raw.ptr as *mut u8, raw.len) };
            planned.push(Entry {
                key,
                dst,
                want,
                sources,
            });
        }
        spans.retain(|s| s.1 > 0);
        spans.sort_unstable();
        if let Some(w) = spans.windows(2).find(|w| w[0].0 + w[0].1 > w[1].0) {
            return Err(CoreError::InvalidArgument(format!(
                "the fetch buffers of {:?} and {:?} overlap",
                w[0].2, w[1].2
            ))
            .into());
        }
        let plan = Plan {
            entries: planned,
            addrs,
            streams,
            io_timeout: seconds("io_timeout", io_timeout)?,
            range_bytes,
        };
        Ok(FetchOp {
            node: self.node.clone(),
            plan: Mutex::new(Some((plan, Held::new(py, exports)?))),
            progress: Default::default(),
            cancel: CancellationToken::new(),
        })
    }
}

/// One sync plan's fetch. `run()` drives it; `abort()` stops it from anywhere.
#[pyclass(module = "pccl._core", frozen)]
pub struct FetchOp {
    node: Arc<Node>,
    /// The plan and the exports of its buffers, until `run()` takes them.
    plan: Mutex<Option<(Plan, Held)>>,
    progress: Arc<Progress>,
    cancel: CancellationToken,
}

#[pymethods]
impl FetchOp {
    /// Fetches the plan; resolves to one item per entry, in order: `None` (fetched and
    /// verified) or the exception its fetch failed with. When it resolves, every
    /// transfer has ended. Cancelling the awaitable aborts the fetch too, but the
    /// transfers stop a moment later: call `abort()` and await it instead.
    fn run<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let (plan, held) = self
            .plan
            .lock()
            .unwrap()
            .take()
            .ok_or_else(|| CoreError::InvalidUsage("FetchOp.run() called twice".into()))?;
        let (node, progress, cancel) = (
            self.node.clone(),
            self.progress.clone(),
            self.cancel.clone(),
        );
        future_into_py(py, async move {
            // Dropped (the awaitable cancelled) before the fetch ended: stop it.
            let _stop = cancel.clone().drop_guard();
            let task = tokio::spawn(async move {
                let results = fetch::fetch_plan(node, plan, progress, cancel).await;
                // The buffers' exports: released by Python once a thread attaches (the
                // hand-off of `results` does).
                drop(held);
                results
            });
            let results = task.await.map_err(|e| {
                CoreError::PeerConnection(format!(
                    "the shared-state fetch failed unexpectedly: {e}"
                ))
            })?;
            crate::py::attach_from_runtime(|py| {
                let out: Vec<Py<PyAny>> = results
                    .into_iter()
                    .map(|r| match r {
                        Ok(()) => py.None(),
                        Err(e) => PyErr::from(e).into_value(py).into_any(),
                    })
                    .collect();
                Ok(out)
            })
        })
    }

    /// Stops every transfer (their tensors fail); `run()` resolves once they ended.
    fn abort(&self) {
        self.cancel.cancel();
    }

    /// Bytes landed that are still part of the result: an attempt that failed is taken
    /// back (beyond the whole hash leaves a failover keeps), so it may go down; after a
    /// successful run, the bytes of every tensor.
    #[getter]
    fn rx_bytes(&self) -> u64 {
        self.progress.rx_bytes()
    }

    /// Tensors fetched and verified so far.
    #[getter]
    fn tensors_done(&self) -> u64 {
        self.progress.tensors_done()
    }
}

/// The `(offset, length)` ranges a tensor of `nbytes` with `holders` holders is fetched
/// in over at least `streams` streams (the engine's policy, exposed for tests).
#[pyfunction]
#[pyo3(signature = (nbytes, holders, streams=1, range_bytes=fetch::RANGE_BYTES))]
fn fetch_ranges(nbytes: u64, holders: usize, streams: usize, range_bytes: u64) -> Vec<(u64, u64)> {
    fetch::fetch_ranges(nbytes, holders, streams, range_bytes)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("HASH_LEAF_BYTES", LEAF_SIZE)?;
    m.add("FETCH_RANGE_BYTES", fetch::RANGE_BYTES)?;
    m.add("MAX_FETCHES_IN_FLIGHT", fetch::MAX_FETCHES_IN_FLIGHT)?;
    m.add_function(wrap_pyfunction!(fetch_ranges, m)?)?;
    m.add_class::<FetchOp>()?;
    Ok(())
}
