//! Shared-state transfer handles: serve tensors in place, fetch one into a buffer.

use crate::error::CoreError;
use crate::net::fetch::TransferStream;
use crate::net::transfer::{self, Served};
use crate::py::buffer::{Export, Held};
use crate::py::future_into_py;
use crate::py::node::{resolve, seconds as checked_seconds, PyP2PNode};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Bytes landed by one fetch so far: hand one to `fetch_into(counter=...)` and read
/// `value` from Python while the fetch runs (progress reports).
#[pyclass(module = "pccl._core", frozen)]
#[derive(Default)]
pub struct ByteCounter(Arc<AtomicU64>);

#[pymethods]
impl ByteCounter {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    /// Bytes counted so far.
    #[getter]
    fn value(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

#[pymethods]
impl PyP2PNode {
    /// Measures the bandwidth to peer `peer_id` at `addr` with `streams` parallel
    /// streams (like the ring's pool) for `seconds` (at most `max_bytes` per stream).
    /// Resolves to `(bytes/s summed over the streams, seconds of the quickest stream's
    /// dial)`: a dial is a TCP connect, the transport handshake and the p2p hello, a few
    /// round trips, so the second number measures the pair's latency.
    #[pyo3(signature = (addr, peer_id, seconds=0.25, streams=1, max_bytes=256 << 20, io_timeout=10.0))]
    #[allow(clippy::too_many_arguments)]
    fn probe<'py>(
        &self,
        py: Python<'py>,
        addr: String,
        peer_id: u64,
        seconds: f64,
        streams: u16,
        max_bytes: u64,
        io_timeout: f64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let node = self.node.clone();
        let duration = checked_seconds("seconds", seconds)?;
        let timeout = checked_seconds("io_timeout", io_timeout)?;
        let max_bytes = max_bytes.min(crate::net::node::MAX_PROBE_BYTES);
        future_into_py(py, async move {
            let sock = resolve(&addr).await?;
            let streams = streams.max(1);
            let probes = (0..streams).map(|i| {
                let node = node.clone();
                async move {
                    let started = std::time::Instant::now();
                    let s = node
                        .dial_purpose(
                            sock,
                            peer_id,
                            i,
                            streams,
                            crate::net::handshake::Purpose::Probe,
                        )
                        .await?;
                    let dial = started.elapsed().as_secs_f64();
                    let rate = transfer::run_probe(s, duration, max_bytes, timeout).await?;
                    Ok::<_, crate::error::CoreError>((rate, dial))
                }
            });
            let measured = tokio::select! {
                r = futures::future::try_join_all(probes) => r?,
                _ = node.cancel_token().cancelled() => {
                    return Err(crate::error::CoreError::Aborted("the p2p node is closing".into()).into())
                }
            };
            let rate = measured.iter().map(|(r, _)| r).sum::<f64>();
            let dial = measured
                .iter()
                .map(|(_, d)| *d)
                .fold(f64::INFINITY, f64::min);
            Ok((rate, dial))
        })
    }

    /// Serves `buffer` (read in place, never copied) under `key` until `unserve_all()`.
    fn serve(&self, key: String, buffer: &Bound<'_, PyAny>) -> PyResult<()> {
        let export = Export::get(buffer, false, "a shared-state tensor")?;
        let raw = export.raw();
        let held = Box::new(Held::new(buffer.py(), vec![export])?);
        // SAFETY: `held` holds the export while the item lives; callers must not modify
        // the tensor while a sync serves it (documented on sync_shared_state).
        let item = unsafe { Served::new(raw.ptr as *const u8, raw.len, held) };
        self.node.transfers.serve(key, item);
        Ok(())
    }

    /// Stops serving every tensor.
    fn unserve_all(&self) {
        self.node.transfers.unserve_all();
    }

    /// Closes the transfer streams kept from earlier fetches (the end of a sync).
    fn drop_idle_transfers(&self) {
        self.node.drop_idle_transfers();
    }

    /// Payload bytes served to other peers so far.
    fn bytes_served(&self) -> u64 {
        self.node.transfers.bytes_sent()
    }

    /// Fetches bytes `offset..offset + len(out)` of `key` (a tensor of `total` bytes;
    /// default: the range ends the tensor) from peer `peer_id` at `addr` straight into
    /// `out` (writable). `offset` must start a hash leaf (1 MiB) and the range must end
    /// on one or at the tensor's end. Resolves to the range's leaf digests (bytes; see
    /// `hash_root`), hashed while the bytes land; `counter` (a `ByteCounter`) counts the
    /// bytes as they land. `reuse`: take a stream kept from an earlier fetch from the
    /// same source if there is one, and keep this one afterwards (see
    /// `drop_idle_transfers`); otherwise dial one for this fetch alone.
    #[pyo3(signature = (addr, peer_id, key, out, offset=0, total=None, io_timeout=30.0, counter=None, reuse=true))]
    #[allow(clippy::too_many_arguments)]
    fn fetch_into<'py>(
        &self,
        py: Python<'py>,
        addr: String,
        peer_id: u64,
        key: String,
        out: &Bound<'py, PyAny>,
        offset: u64,
        total: Option<u64>,
        io_timeout: f64,
        counter: Option<&Bound<'py, ByteCounter>>,
        reuse: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let landed = counter.map_or_else(Default::default, |c| c.get().0.clone());
        let export = Export::get(out, true, "the fetch buffer")?;
        let raw = export.raw();
        let total = total.unwrap_or(offset.saturating_add(raw.len as u64));
        let held = Held::new(py, vec![export])?;
        let node = self.node.clone();
        let timeout = checked_seconds("io_timeout", io_timeout)?;
        future_into_py(py, async move {
            let _held = held;
            let sock = resolve(&addr).await?;
            // SAFETY: `_held` holds the export for the whole transfer and the caller
            // hands us memory nobody else writes meanwhile.
            let dst = unsafe { raw.bytes_mut() };
            let mut f = TransferStream::open(&node, sock, peer_id, reuse).await?;
            // The leaf digests, computed while the bytes land. Only a clean end leaves
            // the stream between requests.
            let digests = loop {
                let r = tokio::select! {
                    r = transfer::fetch(&mut f.stream, &key, offset, total, dst, timeout, &*landed) => r,
                    _ = node.cancel_token().cancelled() => return Err(closing()),
                };
                if !f
                    .again(r.is_ok(), landed.load(Ordering::Relaxed) != 0)
                    .await?
                {
                    f.finish(r.is_ok());
                    break r?;
                }
            };
            crate::py::attach_from_runtime(|py| Ok(PyBytes::new(py, &digests).unbind()))
        })
    }

    /// Fetches several whole tensors served by `peer_id` at `addr` into `outs`
    /// (writable buffers, one per key) over one transfer stream, with all the requests
    /// sent up front: one round trip for the lot instead of one per tensor. Resolves to
    /// a list with, per key, its leaf digests (bytes, see `hash_root`) or the exception
    /// that fetch failed with (a refused key fails alone; a broken stream fails the
    /// keys it had not delivered). `counter` counts the bytes landed, `reuse` as for
    /// `fetch_into`.
    #[pyo3(signature = (addr, peer_id, keys, outs, io_timeout=30.0, counter=None, reuse=true))]
    #[allow(clippy::too_many_arguments)]
    fn fetch_many_into<'py>(
        &self,
        py: Python<'py>,
        addr: String,
        peer_id: u64,
        keys: Vec<String>,
        outs: Vec<Bound<'py, PyAny>>,
        io_timeout: f64,
        counter: Option<&Bound<'py, ByteCounter>>,
        reuse: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        if keys.len() != outs.len() {
            return Err(CoreError::InvalidArgument(format!(
                "fetch_many_into: {} keys but {} buffers",
                keys.len(),
                outs.len()
            ))
            .into());
        }
        let landed = counter.map_or_else(Default::default, |c| c.get().0.clone());
        let exports = outs
            .iter()
            .map(|o| Export::get(o, true, "a fetch buffer"))
            .collect::<PyResult<Vec<_>>>()?;
        let raws: Vec<_> = exports.iter().map(Export::raw).collect();
        let held = Held::new(py, exports)?;
        let node = self.node.clone();
        let timeout = checked_seconds("io_timeout", io_timeout)?;
        future_into_py(py, async move {
            let _held = held;
            let sock = resolve(&addr).await?;
            // SAFETY: `_held` holds every export for the whole transfer, the caller
            // hands us memory nobody else writes meanwhile, and distinct buffers.
            let mut items: Vec<transfer::Wanted<'_>> = keys
                .iter()
                .zip(&raws)
                .map(|(key, raw)| transfer::Wanted {
                    key,
                    dst: unsafe { raw.bytes_mut() },
                })
                .collect();
            let mut f = TransferStream::open(&node, sock, peer_id, reuse).await?;
            let results = loop {
                let (results, in_step) = tokio::select! {
                    r = transfer::fetch_many(&mut f.stream, &mut items, timeout, &*landed) => r,
                    _ = node.cancel_token().cancelled() => return Err(closing()),
                };
                if !f
                    .again(in_step, landed.load(Ordering::Relaxed) != 0)
                    .await?
                {
                    f.finish(in_step);
                    break results;
                }
            };
            crate::py::attach_from_runtime(|py| {
                let out: Vec<Py<PyAny>> = results
                    .into_iter()
                    .map(|r| match r {
                        Ok(d) => PyBytes::new(py, &d).into_any().unbind(),
                        Err(e) => PyErr::from(e).into_value(py).into_any(),
                    })
                    .collect();
                Ok(out)
            })
        })
    }
}

fn closing() -> PyErr {
    CoreError::Aborted("the p2p node is closing".into()).into()
}

/// Copies `src` into `dst` (equal byte lengths) with the GIL released: destination
/// pages are populated in bulk first (transparent huge pages where the kernel allows),
/// then the bytes are copied on up to `threads` threads (default: all cores, for copies
/// of at least 64 MiB). Used to commit fetched shared state.
#[pyfunction]
#[pyo3(signature = (dst, src, threads=None))]
pub fn copy_into(
    py: Python<'_>,
    dst: &Bound<'_, PyAny>,
    src: &Bound<'_, PyAny>,
    threads: Option<usize>,
) -> PyResult<()> {
    // Held until this call returns, the copy included.
    let exports = [
        Export::get(dst, true, "the destination")?,
        Export::get(src, false, "the source")?,
    ];
    let (d, s) = (exports[0].raw(), exports[1].raw());
    if d.len != s.len {
        return Err(CoreError::InvalidArgument(format!(
            "copy_into: destination has {} bytes, source {}",
            d.len, s.len
        ))
        .into());
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = threads
        .unwrap_or(if d.len >= 64 << 20 { cores } else { 1 })
        .clamp(1, 64);
    crate::py::detach(py, move || {
        transfer::prefault(d.ptr, d.len);
        // SAFETY: both exports are held until this call returns (the destination's
        // writable); pccl never hands overlapping buffers here.
        let (dst, src) = unsafe { (d.bytes_mut(), s.bytes()) };
        if threads == 1 {
            dst.copy_from_slice(src);
            return;
        }
        let per = d.len.div_ceil(threads).max(1);
        std::thread::scope(|scope| {
            for (dc, sc) in dst.chunks_mut(per).zip(src.chunks(per)) {
                scope.spawn(move || dc.copy_from_slice(sc));
            }
        });
    });
    drop(exports);
    Ok(())
}

/// Backs `buffer` (writable) with pages now, with the GIL released, without changing its
/// contents (Linux `MADV_POPULATE_WRITE`, transparent huge pages where allowed; a no-op
/// elsewhere). Lets a sync take the page faults of a commit off its critical path.
#[pyfunction]
pub fn prefault(py: Python<'_>, buffer: &Bound<'_, PyAny>) -> PyResult<()> {
    let export = Export::get(buffer, true, "the buffer")?;
    let b = export.raw();
    crate::py::detach(py, move || transfer::prefault(b.ptr, b.len));
    drop(export);
    Ok(())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(copy_into, m)?)?;
    m.add_function(wrap_pyfunction!(prefault, m)?)?;
    m.add_function(wrap_pyfunction!(crate::py::ring::star_all_reduce, m)?)?;
    m.add_function(wrap_pyfunction!(crate::py::ring::mesh_partners, m)?)?;
    m.add_function(wrap_pyfunction!(crate::py::ring::mesh_rounds, m)?)?;
    m.add_class::<ByteCounter>()?;
    // The fetch engine's Python edge (`py/fetch.rs`) registers with the transfers.
    crate::py::fetch::register(m)
}
