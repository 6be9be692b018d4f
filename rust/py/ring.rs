//! Python handles for the ring: installing the links of an epoch, starting an
//! all-reduce (`RingOp`), and committing its result into the caller's buffer. The work
//! is done by `crate::ring::assembly`; this file only converts arguments and results.
//! `star_all_reduce` computes the ring's result in one process (`crate::ring::star`).
//!
//! A `RingOp` holds the buffer exports of its tensors (`py::buffer::Held`) from
//! `start_all_reduce` until it is committed or rolled back (and no task of it touches
//! them any more), so Python cannot resize or free them while the ring uses them.

use crate::error::{CoreError, CoreResult};
use crate::py::buffer::{Export, Held};
use crate::py::future_into_py;
use crate::py::node::{seconds, PyP2PNode};
use crate::ring::allreduce;
use crate::ring::assembly::{self, dtype_from_code, op_from_code, quant_from_codes, MeshConfig};
use crate::ring::gather::{GatherOp, GatherSpec};
use crate::ring::links::LinkConfig;
use crate::ring::{ReduceSpec, ReduceStats};
use futures::future::BoxFuture;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

#[pymethods]
impl PyP2PNode {
    /// Turns the pools of `epoch` into the ring links (to `next_id`, from `prev_id`).
    /// A ring of one (`next_id < 0`) just drops the old links. With `ring` (the peer
    /// ids in the mesh's rank order: the ring's, or the order the master chose for the
    /// mesh) and `mesh_max_bytes > 0`, also the mesh links of the epoch
    /// (pools dialed with `connect_pool(mesh=True)` to and from every partner):
    /// unquantized all-reduces of up to that many bytes then run on the mesh.
    #[pyo3(signature = (epoch, next_id, prev_id, pool_timeout=10.0, io_timeout=30.0, max_piece=16 << 20, ring=None, mesh_max_bytes=0))]
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
        ring: Option<Vec<u64>>,
        mesh_max_bytes: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let node = self.node.clone();
        let mesh = ring.map(|ring| MeshConfig {
            ring,
            max_bytes: mesh_max_bytes,
        });
        let ring = self.ring.clone();
        let cfg = LinkConfig {
            pool_timeout: seconds("pool_timeout", pool_timeout)?,
            io_timeout: seconds("io_timeout", io_timeout)?,
            max_piece,
        };
        // A ring of one has no neighbours.
        let neighbours = (next_id >= 0 && prev_id >= 0).then_some((next_id as u64, prev_id as u64));
        future_into_py(py, async move {
            let installed = ring
                .install_with_mesh(&node, epoch, neighbours, mesh, cfg)
                .await?;
            if let Some(links) = installed {
                // Logged here so that the record's logger stays `pccl._core.py.ring`.
                log::debug!(
                    "peer {}: ring of epoch {epoch} installed (next peer {}, previous {}; \
                     mesh up to {} bytes)",
                    node.peer_id(),
                    links.next,
                    links.prev,
                    ring.mesh().map_or(0, |m| m.max_bytes)
                );
            }
            Ok(())
        })
    }

    /// Starts a ring all-reduce of `buffer` (bytes of `count` elements of `dtype`). With
    /// `out` (a writable buffer of the same size that does not overlap `buffer`), the
    /// results land in `out` as they are computed (`commit(out)` then copies nothing);
    /// without it they stay in scratch memory until `commit`, or, with `in_place=True`,
    /// land in `buffer` itself while its original bytes move to a backup: `commit(buffer)`
    /// keeps them, `rollback()` puts the original back (a failed `run()` already did).
    /// With `armed=False` the op takes no silence from the previous peer for a stall
    /// until `RingOp.arm()`.
    #[pyo3(signature = (op_id, rank, world, buffer, dtype, op, piece_bytes=1 << 20, quant_algorithm=0, quant_dtype=0, out=None, armed=true, in_place=false))]
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
        out: Option<&Bound<'_, PyAny>>,
        armed: bool,
        in_place: bool,
    ) -> PyResult<RingOp> {
        let quant = quant_from_codes(quant_algorithm, quant_dtype)?;
        let spec = ReduceSpec {
            op_id,
            rank,
            world,
            dtype: dtype_from_code(dtype)?,
            op: op_from_code(op)?,
            piece_bytes,
            quant,
        };
        let links = self.ring.usable_links()?;
        let py = buffer.py();
        let input = Export::get(buffer, false, "the input tensor")?;
        let raw = input.raw();
        let mesh = self.ring.mesh_for(&spec, raw.len);
        if let Some(out) = out {
            let output = Export::get(out, true, "the output tensor")?;
            let dst = output.raw();
            if dst.len != raw.len {
                return Err(CoreError::InvalidArgument(format!(
                    "the output tensor has {} bytes, the input {}",
                    dst.len, raw.len
                ))
                .into());
            }
            if allreduce::disjoint(raw.ptr as *const u8, dst.ptr as *const u8, raw.len) {
                let held = Box::new(Held::new(py, vec![input, output])?);
                // SAFETY: `held` holds both exports for as long as the op's memory
                // lives; they do not overlap; callers must not touch either tensor
                // while the op runs (documented).
                let op = unsafe {
                    assembly::RingOp::with_output(
                        links,
                        spec,
                        raw.ptr as *const u8,
                        dst.ptr as *mut u8,
                        raw.len,
                        held,
                    )
                };
                return Ok(RingOp::new(op.with_armed(armed).with_mesh(mesh)));
            }
        }
        if in_place {
            let tensor = Export::get(buffer, true, "the tensor")?;
            let raw = tensor.raw();
            let held = Box::new(Held::new(py, vec![tensor])?);
            // SAFETY: `held` holds the export for as long as the op's memory lives;
            // callers must not touch the tensor until the op is committed or rolled
            // back (documented).
            let op = unsafe {
                assembly::RingOp::in_place(
                    links,
                    spec,
                    raw.ptr as *mut u8,
                    raw.len,
                    held,
                    Some(self.ring.scratch()),
                )
            };
            return Ok(RingOp::new(op.with_armed(armed).with_mesh(mesh)));
        }
        let held = Box::new(Held::new(py, vec![input])?);
        // SAFETY: `held` holds the export for as long as the op's memory lives; callers
        // must not write the tensor while the op runs (documented).
        let op = unsafe {
            assembly::RingOp::with_input(
                links,
                spec,
                raw.ptr as *const u8,
                raw.len,
                held,
                Some(self.ring.scratch()),
            )
        };
        Ok(RingOp::new(op.with_armed(armed).with_mesh(mesh)))
    }

    /// Starts a ring all-gather: `buffer`'s bytes (this peer's contribution) are copied
    /// into slot `rank` of `out` (a writable buffer of `world` times as many bytes, not
    /// overlapping `buffer`), where every other rank's contribution lands as the ring
    /// goes; `commit(out)` then copies nothing. On failure `out`'s other slots hold
    /// unspecified bytes. The op holds `out`'s export until it is committed or rolled
    /// back. With `armed=False` the op takes no silence from the previous peer for a
    /// stall until `RingOp.arm()`.
    #[pyo3(signature = (op_id, rank, world, buffer, out, piece_bytes=1 << 20, armed=true))]
    #[allow(clippy::too_many_arguments)]
    fn start_all_gather(
        &self,
        op_id: u64,
        rank: usize,
        world: usize,
        buffer: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        piece_bytes: usize,
        armed: bool,
    ) -> PyResult<RingOp> {
        let spec = GatherSpec {
            op_id,
            rank,
            world,
            piece_bytes,
        };
        let py = buffer.py();
        let input = Export::get(buffer, false, "the contribution")?;
        let output = Export::get(out, true, "the output")?;
        let (src, dst) = (input.raw(), output.raw());
        if Some(dst.len) != src.len.checked_mul(world) {
            return Err(CoreError::InvalidArgument(format!(
                "the output has {} bytes, not {world} x {} (world x contribution)",
                dst.len, src.len
            ))
            .into());
        }
        let apart = src.ptr + src.len <= dst.ptr || dst.ptr + dst.len <= src.ptr;
        if !apart && src.len > 0 {
            return Err(CoreError::InvalidArgument(
                "the contribution and the output overlap".into(),
            )
            .into());
        }
        let held = Box::new(Held::new(py, vec![output])?);
        // SAFETY: `input` is held for this call (the contribution is copied now);
        // `held` holds `out`'s export for as long as the op's memory lives, and callers
        // must not touch `out` while the op runs (documented).
        let op = unsafe {
            self.ring.start_all_gather(
                spec,
                input.raw().bytes(),
                dst.ptr as *mut u8,
                held,
                armed,
            )?
        };
        drop(input);
        Ok(RingOp::gather(op))
    }

    /// `(receiving lanes from prev, sending lanes to next)` of the installed ring links,
    /// `(0, 0)` when there are none.
    fn ring_lanes(&self) -> (usize, usize) {
        self.ring.lanes()
    }

    /// Whether the current ring links are usable (false after any link failure).
    fn ring_ok(&self) -> bool {
        self.ring.is_ok()
    }
}

/// One all-reduce in flight. `run()` drives it; `abort()` stops it from anywhere;
/// `arm()` starts its stall clock; `commit(out)` copies the result into the caller's
/// buffer after success.
///
/// The op's memory holds the exports of its tensors. `commit` and `rollback`, unless
/// its `run()` is still going, spend the op: it lets go of that memory, and the exports
/// are released there and then, or, when a task of the op still holds the memory (a
/// link's reader, a moment longer), by the last one to let go (see `py::buffer`). A
/// spent op cannot run or commit; `rollback`, `abort` and `arm` do nothing.
#[pyclass(module = "pccl._core", frozen)]
pub struct RingOp {
    /// `None` once spent. Handed out as a clone: no lock is held while the GIL is
    /// released.
    op: Mutex<Option<Op>>,
    mesh: bool,
    /// From `run()` until its future ended (or was dropped).
    running: Arc<AtomicBool>,
}

/// What a `RingOp` drives: an all-reduce, or an all-gather (`start_all_gather`).
#[derive(Clone)]
enum Op {
    Reduce(Arc<assembly::RingOp>),
    Gather(Arc<GatherOp>),
}

impl Op {
    fn run(&self) -> CoreResult<BoxFuture<'static, CoreResult<ReduceStats>>> {
        Ok(match self {
            Op::Reduce(op) => Box::pin(op.run()?),
            Op::Gather(op) => Box::pin(op.run()?),
        })
    }

    fn abort(&self) {
        match self {
            Op::Reduce(op) => op.abort(),
            Op::Gather(op) => op.abort(),
        }
    }

    fn arm(&self) {
        match self {
            Op::Reduce(op) => op.arm(),
            Op::Gather(op) => op.arm(),
        }
    }

    fn rollback(&self) {
        match self {
            Op::Reduce(op) => op.rollback(),
            // Only its own output was written.
            Op::Gather(_) => {}
        }
    }

    fn commit_into(&self, out: &mut [u8]) -> CoreResult<()> {
        match self {
            Op::Reduce(op) => op.commit_into(out),
            Op::Gather(op) => {
                let mem = op.memory();
                if out.len() != mem.total() {
                    return Err(CoreError::InvalidArgument(format!(
                        "output has {} bytes, the result {}",
                        out.len(),
                        mem.total()
                    )));
                }
                if !std::ptr::eq(out.as_ptr(), mem.out_ptr()) {
                    out.copy_from_slice(mem.result());
                }
                Ok(())
            }
        }
    }
}

/// Clears `RingOp::running` when the run's future ends or is dropped.
struct Running(Arc<AtomicBool>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl RingOp {
    fn new(op: assembly::RingOp) -> RingOp {
        RingOp {
            mesh: op.is_mesh(),
            op: Mutex::new(Some(Op::Reduce(Arc::new(op)))),
            running: Arc::default(),
        }
    }

    fn gather(op: GatherOp) -> RingOp {
        RingOp {
            mesh: false,
            op: Mutex::new(Some(Op::Gather(Arc::new(op)))),
            running: Arc::default(),
        }
    }

    fn live(&self) -> Option<Op> {
        self.op.lock().unwrap().clone()
    }

    fn spent() -> PyErr {
        CoreError::InvalidUsage("the RingOp was committed or rolled back already".into()).into()
    }

    /// After a commit or rollback: lets go of the op unless its run is still going.
    fn spend(&self, op: Op) {
        if self.running.load(Ordering::Acquire) {
            return;
        }
        let taken = self.op.lock().unwrap().take();
        // Here, on this Python thread, the tensors' exports are released unless a task
        // still holds the op's memory.
        drop((taken, op));
    }
}

#[pymethods]
impl RingOp {
    /// Runs the ring; resolves to `(tx_bytes, rx_bytes)`.
    fn run<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let op = self.live().ok_or_else(Self::spent)?;
        let run = op.run()?;
        self.running.store(true, Ordering::Release);
        let running = Running(self.running.clone());
        future_into_py(py, async move {
            let _running = running;
            let stats = run.await?;
            Ok((stats.tx_bytes, stats.rx_bytes))
        })
    }

    /// "mesh" (recursive doubling over the mesh links) or "ring".
    #[getter]
    fn algorithm(&self) -> &'static str {
        if self.mesh {
            "mesh"
        } else {
            "ring"
        }
    }

    /// Stops the op (its run fails). The links are poisoned if a frame was cut.
    fn abort(&self) {
        if let Some(op) = self.live() {
            op.abort();
        }
    }

    /// From now on, silence from the previous peer for the I/O timeout fails the op
    /// (idempotent; harmless once the op ended).
    fn arm(&self) {
        if let Some(op) = self.live() {
            op.arm();
        }
    }

    /// An in-place op (`start_all_reduce(in_place=True)`) that ran: puts the tensor's
    /// original bytes back (GIL released while copying). A no-op for other ops, after
    /// a commit, and the second time. Spends the op (see `RingOp`).
    fn rollback(&self, py: Python<'_>) {
        let Some(op) = self.live() else { return };
        crate::py::detach(py, || op.rollback());
        self.spend(op);
    }

    /// Copies the reduced bytes into `out` (GIL released while copying, `out`'s export
    /// held meanwhile). Spends the op (see `RingOp`).
    fn commit(&self, py: Python<'_>, out: &Bound<'_, PyAny>) -> PyResult<()> {
        let op = self.live().ok_or_else(Self::spent)?;
        let dst = Export::get(out, true, "the output tensor")?;
        let raw = dst.raw();
        crate::py::detach(py, || {
            // SAFETY: `dst` holds the writable, C-contiguous export of `out` until this
            // call returns; the op's own memory is its own.
            op.commit_into(unsafe { raw.bytes_mut() })
        })?;
        drop(dst);
        self.spend(op);
        Ok(())
    }
}

/// The bytes a ring all-reduce of `inputs` (`inputs[r]`: rank `r`'s tensor, C-contiguous
/// byte buffers of equal size) leaves on every peer, computed here with the GIL
/// released. `dtype` and `op` are the codes `start_all_reduce` takes; no quantization.
#[pyfunction]
pub fn star_all_reduce<'py>(
    py: Python<'py>,
    inputs: Vec<Bound<'py, PyAny>>,
    dtype: u8,
    op: u8,
) -> PyResult<Bound<'py, PyBytes>> {
    let (dtype, op) = (dtype_from_code(dtype)?, op_from_code(op)?);
    // Held until the end: a held export keeps the bytes from being resized or freed.
    let views = inputs
        .iter()
        .enumerate()
        .map(|(rank, obj)| Export::get(obj, false, &format!("input {rank}")))
        .collect::<PyResult<Vec<_>>>()?;
    // SAFETY: C-contiguous exports, held while `views` is.
    let slices: Vec<&[u8]> = views.iter().map(|v| unsafe { v.raw().bytes() }).collect();
    let out = crate::py::detach(py, || crate::ring::star_all_reduce(&slices, dtype, op))?;
    drop(slices);
    drop(views);
    Ok(PyBytes::new(py, &out))
}

/// The ranks that `rank` exchanges pieces with in a mesh all-reduce of `world` peers
/// (recursive doubling; a link each way with each), in step order.
#[pyfunction]
pub fn mesh_partners(rank: usize, world: usize) -> Vec<usize> {
    crate::ring::mesh::mesh_partners(rank, world)
}

/// Hops of a mesh all-reduce of `world` peers (log2 of the largest power of two not
/// above it, plus 2 when `world` is not a power of two).
#[pyfunction]
pub fn mesh_rounds(world: usize) -> usize {
    crate::ring::mesh::mesh_rounds(world)
}
