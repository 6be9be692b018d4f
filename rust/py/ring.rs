//! Python handles for the ring: installing the links of an epoch, starting an
//! all-reduce (`RingOp`), and committing its result into the caller's buffer.

use crate::error::CoreError;
use crate::net::handshake::Purpose;
use crate::net::node::PoolKey;
use crate::py::node::{seconds, PyP2PNode};
use crate::quant::{QuantAlgorithm, WireType};
use crate::reduce::{DType, ReduceOp};
use crate::ring::allreduce::OpMemory;
use crate::ring::{ring_all_reduce, ReduceSpec, RingLinks};
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3_async_runtimes::tokio::future_into_py;
use std::sync::{Arc, Mutex};
use tokio_util::sync::CancellationToken;

/// Raw view of a contiguous byte buffer exported by a Python object.
pub(crate) struct RawBuffer {
    pub ptr: usize,
    pub len: usize,
}

pub(crate) fn raw_buffer(
    obj: &Bound<'_, PyAny>,
    writable: bool,
    what: &str,
) -> PyResult<RawBuffer> {
    let buf = PyBuffer::<u8>::get(obj).map_err(|e| {
        CoreError::InvalidArgument(format!("{what} must expose a byte buffer: {e}"))
    })?;
    if !buf.is_c_contiguous() {
        return Err(CoreError::InvalidArgument(format!("{what} must be C-contiguous")).into());
    }
    if writable && buf.readonly() {
        return Err(CoreError::InvalidArgument(format!("{what} is read-only")).into());
    }
    Ok(RawBuffer {
        ptr: buf.buf_ptr() as usize,
        len: buf.len_bytes(),
    })
}

/// Keeps a Python object alive from tokio threads; the decref is deferred by pyo3
/// until a thread holds the GIL.
pub(crate) struct KeepAlive(#[allow(dead_code)] pub(crate) Py<PyAny>);

#[pymethods]
impl PyP2PNode {
    /// Turns the pools of `epoch` into the ring links (to `next_id`, from `prev_id`).
    /// A ring of one (`next_id < 0`) just drops the old links.
    #[pyo3(signature = (epoch, next_id, prev_id, pool_timeout=10.0, io_timeout=30.0, max_piece=16 << 20))]
    #[allow(clippy::too_many_arguments)]
    fn install_ring<'py>(
        &self,
        py: Python<'py>,
        epoch: u64,
        next_id: i64,
        prev_id: i64,
        pool_timeout: f64,
        io_timeout: f64,
        max_piece: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let node = self.node.clone();
        let slot = self.ring.clone();
        let pool_timeout = seconds("pool_timeout", pool_timeout)?;
        let io_timeout = seconds("io_timeout", io_timeout)?;
        future_into_py(py, async move {
            let old = slot.lock().unwrap().take();
            if let Some(old) = old {
                old.close().await;
            }
            if next_id < 0 || prev_id < 0 {
                return Ok(());
            }
            let (next, prev) = (next_id as u64, prev_id as u64);
            let to_next = node
                .take_outbound(PoolKey {
                    peer: next,
                    epoch,
                    purpose: Purpose::Ring,
                })
                .ok_or_else(|| {
                    CoreError::PeerConnection(format!("no pool to peer {next} for epoch {epoch}"))
                })?;
            let from_prev = node
                .take_inbound(
                    PoolKey {
                        peer: prev,
                        epoch,
                        purpose: Purpose::Ring,
                    },
                    pool_timeout,
                )
                .await?;
            let links =
                RingLinks::new(epoch, next, prev, to_next, from_prev, max_piece, io_timeout);
            *slot.lock().unwrap() = Some(links);
            log::debug!(
                "peer {}: ring of epoch {epoch} installed (next peer {next}, previous {prev})",
                node.peer_id()
            );
            Ok(())
        })
    }

    /// Starts a ring all-reduce of `buffer` (bytes of `count` elements of `dtype`).
    #[pyo3(signature = (op_id, rank, world, buffer, dtype, op, piece_bytes=1 << 20, quant_algorithm=0, quant_dtype=0))]
    #[allow(clippy::too_many_arguments)]
    fn start_all_reduce(
        &self,
        op_id: u64,
        rank: usize,
        world: usize,
        buffer: &Bound<'_, PyAny>,
        dtype: u8,
        op: u8,
        piece_bytes: usize,
        quant_algorithm: u8,
        quant_dtype: u8,
    ) -> PyResult<RingOp> {
        let quant = match QuantAlgorithm::from_u8(quant_algorithm) {
            None => {
                return Err(CoreError::InvalidArgument(format!(
                    "unknown quantization algorithm code {quant_algorithm}"
                ))
                .into())
            }
            Some(QuantAlgorithm::None) => None,
            Some(alg) => {
                let wire = WireType::from_u8(quant_dtype).ok_or_else(|| {
                    CoreError::InvalidArgument(format!(
                        "data type code {quant_dtype} cannot carry quantized values \
                         (use UINT8, INT8, FLOAT8_E4M3 or FLOAT8_E5M2)"
                    ))
                })?;
                Some((alg, wire))
            }
        };
        let dtype = DType::from_u8(dtype)
            .ok_or_else(|| CoreError::InvalidArgument(format!("unknown dtype code {dtype}")))?;
        let op = ReduceOp::from_u8(op)
            .ok_or_else(|| CoreError::InvalidArgument(format!("unknown reduce op code {op}")))?;
        let links = self.ring.lock().unwrap().clone().ok_or_else(|| {
            CoreError::PeerConnection("no ring links: call update_topology()".into())
        })?;
        if links.is_poisoned() {
            return Err(links.poison_error().into());
        }
        let raw = raw_buffer(buffer, false, "the input tensor")?;
        let keep = KeepAlive(buffer.clone().unbind());
        // SAFETY: `keep` holds the exporting object for as long as the op's memory lives;
        // callers must not resize or write the tensor while the op runs (documented).
        let pool = Some(self.scratch.clone());
        let mem =
            Arc::new(unsafe { OpMemory::new(raw.ptr as *const u8, raw.len, Box::new(keep), pool) });
        let spec = ReduceSpec {
            op_id,
            rank,
            world,
            dtype,
            op,
            piece_bytes,
            quant,
        };
        Ok(RingOp {
            links,
            spec,
            mem,
            cancel: CancellationToken::new(),
            started: Mutex::new(false),
        })
    }

    /// `(receiving lanes from prev, sending lanes to next)` of the installed ring links,
    /// `(0, 0)` when there are none.
    fn ring_lanes(&self) -> (usize, usize) {
        self.ring
            .lock()
            .unwrap()
            .as_ref()
            .map_or((0, 0), |l| (l.recv_lanes(), l.send_lanes()))
    }

    /// Whether the current ring links are usable (false after any link failure).
    fn ring_ok(&self) -> bool {
        self.ring
            .lock()
            .unwrap()
            .as_ref()
            .is_some_and(|l| !l.is_poisoned())
    }
}

/// One all-reduce in flight. `run()` drives it; `abort()` stops it from anywhere;
/// `commit(out)` copies the result into the caller's buffer after success.
#[pyclass(module = "pccl._core", frozen)]
pub struct RingOp {
    links: Arc<RingLinks>,
    spec: ReduceSpec,
    mem: Arc<OpMemory>,
    cancel: CancellationToken,
    started: Mutex<bool>,
}

#[pymethods]
impl RingOp {
    /// Runs the ring; resolves to `(tx_bytes, rx_bytes)`.
    fn run<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        {
            let mut started = self.started.lock().unwrap();
            if *started {
                return Err(CoreError::InvalidUsage("RingOp.run() called twice".into()).into());
            }
            *started = true;
        }
        let (links, spec, mem, cancel) = (
            self.links.clone(),
            self.spec.clone(),
            self.mem.clone(),
            self.cancel.clone(),
        );
        future_into_py(py, async move {
            let stats = ring_all_reduce(links, spec, mem, cancel).await?;
            Ok((stats.tx_bytes, stats.rx_bytes))
        })
    }

    /// Stops the op (its `run()` fails). The links are poisoned if a frame was cut.
    fn abort(&self) {
        self.cancel.cancel();
    }

    /// Copies the reduced bytes into `out` (GIL released while copying).
    fn commit(&self, py: Python<'_>, out: &Bound<'_, PyAny>) -> PyResult<()> {
        let raw = raw_buffer(out, true, "the output tensor")?;
        if raw.len != self.mem.len() {
            return Err(CoreError::InvalidArgument(format!(
                "output has {} bytes, the result {}",
                raw.len,
                self.mem.len()
            ))
            .into());
        }
        let src = self.mem.result().as_ptr() as usize;
        py.detach(|| {
            // SAFETY: both ranges are valid for `raw.len` bytes and do not overlap
            // (the scratch buffer is ours alone).
            unsafe { std::ptr::copy_nonoverlapping(src as *const u8, raw.ptr as *mut u8, raw.len) }
        });
        Ok(())
    }
}
