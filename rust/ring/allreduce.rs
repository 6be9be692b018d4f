//! Ring all-reduce = reduce-scatter + all-gather, pipelined piece by piece and striped
//! over the lanes of the ring links.
//!
//! The buffer is cut into `world` chunks; chunk `c` is accumulated along the ring
//! starting at rank `c` (((x_c op x_c+1) op x_c+2) ...), so its reduction order is fixed
//! whatever the timing, and rank `c - 1` owns its final bytes, which it then forwards to
//! everyone. Every peer therefore ends with the same bytes.
//!
//! Each chunk is cut into pieces of at most `piece_bytes`; piece `p` of every chunk
//! travels on lane `p % lanes`. For every sending lane a task walks the steps in order;
//! on the receiving side the links' reader tasks land each piece straight in the
//! scratch buffer and reduce it there (`Landing`). The sender of step `s` for piece
//! `p` waits until piece `p` of step `s - 1` has landed and been reduced. Results
//! accumulate in scratch memory that the caller commits only once every peer succeeded,
//! or, for an out-of-place all-reduce ([`OpMemory::with_output`]), straight in the
//! caller's output buffer: no copy after the outcome, and the input is never written, so
//! a failed collective still loses nothing (the output then holds unspecified bytes).
//!
//! In place ([`OpMemory::in_place`]) the results also land straight in the caller's
//! buffer, and the original bytes move to a backup as the ring goes, just before the
//! ring first writes them. A failed op puts back every range it wrote before it
//! returns; one that succeeded here but fails for the group is put back by
//! [`OpMemory::rollback`]. No copy into the caller's tensor after the outcome.
//!
//! Ops that write the caller's memory receive and reduce in one pass: their
//! reduce-scatter pieces arrive in blocks of about [`crate::ring::links::STREAM_BLOCK`]
//! bytes (`Landing::land_part`), and each block is folded in while it is still in cache:
//! out of place `out = partial op input`; in place `backup = tensor`, then
//! `tensor = partial op backup`. Nothing is written to memory only to be read back at
//! once. Every all-gather piece lands straight where it belongs; in place, the first
//! all-gather step brings back our own chunk (final), whose original bytes the sender
//! saved as it sent them at step 0. Ops on scratch memory land whole pieces.

use crate::error::{CoreError, CoreResult};
use crate::quant::{self, QuantAlgorithm, WireType};
use crate::reduce::{self, DType, ReduceOp};
use crate::ring::links::{Dest, Landing, PieceHeader, RingLinks, HEADER_LEN};
use crate::ring::pieces::{OpWords, PieceTracker};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

#[derive(Clone, Debug)]
pub struct ReduceSpec {
    pub op_id: u64,
    pub rank: usize,
    pub world: usize,
    pub dtype: DType,
    pub op: ReduceOp,
    /// Upper bound on one piece, in bytes (rounded down to whole elements).
    pub piece_bytes: usize,
    /// Values travel quantized (`None`: in their own dtype). SUM / AVG of floats only.
    pub quant: Option<(QuantAlgorithm, WireType)>,
}

impl ReduceSpec {
    /// Digest of what every peer of the op must agree on, for a buffer of `len` bytes:
    /// element count, dtype, reduce op, world, quantization and piece size (in whole
    /// elements, as the pieces are cut). Rank and op id are not part of it.
    pub fn digest(&self, len: usize) -> u32 {
        let elem = self.dtype.size();
        let piece_elems = (self.piece_bytes / elem).max(1);
        let (alg, wire) = self.quant.map_or((0, 0), |(a, w)| (a as u8, 1 + w as u8));
        let mut d = Vec::with_capacity(40);
        d.extend_from_slice(b"pccl-ar1");
        d.extend_from_slice(&[self.dtype as u8, self.op as u8, alg, wire]);
        for v in [len / elem, self.world, piece_elems] {
            d.extend_from_slice(&(v as u64).to_le_bytes());
        }
        xxhash_rust::xxh3::xxh3_64(&d) as u32
    }
}

/// Whether an op may declare its previous peer stalled. An op that starts before the
/// others confirmed they started too waits unarmed: silence from the previous peer is
/// then expected, and the stall clock starts when it is armed.
pub struct Armed {
    set: AtomicBool,
    notify: Notify,
}

impl Armed {
    pub fn new(armed: bool) -> Arc<Armed> {
        Arc::new(Armed {
            set: AtomicBool::new(armed),
            notify: Notify::new(),
        })
    }

    /// Idempotent; harmless once the op ended.
    pub fn arm(&self) {
        if !self.set.swap(true, Ordering::AcqRel) {
            self.notify.notify_waiters();
        }
    }

    pub fn is_armed(&self) -> bool {
        self.set.load(Ordering::Acquire)
    }

    /// Resolves at the next `arm()` (enable it before checking `is_armed`).
    pub(crate) fn notified(&self) -> tokio::sync::futures::Notified<'_> {
        self.notify.notified()
    }
}

/// The stall clock of an op waiting for a peer's pieces: the silence counts from the
/// last progress, or from the moment the op was armed (an unarmed op never stalls).
pub(crate) struct StallClock {
    seen: u64,
    armed: bool,
    since: tokio::time::Instant,
}

impl StallClock {
    pub(crate) fn new(progress: u64, armed: bool) -> StallClock {
        StallClock {
            seen: progress,
            armed,
            since: tokio::time::Instant::now(),
        }
    }

    /// Restarts the clock if `progress` moved or the op was armed since the last call;
    /// returns when the silence since then reaches `timeout`.
    pub(crate) fn stall_at(
        &mut self,
        progress: u64,
        armed: bool,
        timeout: std::time::Duration,
    ) -> tokio::time::Instant {
        if progress != self.seen || armed != self.armed {
            (self.seen, self.armed) = (progress, armed);
            self.since = tokio::time::Instant::now();
        }
        self.since + timeout
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReduceStats {
    pub tx_bytes: u64,
    pub rx_bytes: u64,
}

/// Memory the op reads (`input`) and writes (`scratch`). The keep-alive owns whatever
/// backs `input` (the caller's array) so it outlives every task touching it.
pub struct OpMemory {
    input: *const u8,
    len: usize,
    scratch: *mut u8,
    /// The scratch buffer, or, in place, the backup of the caller's original bytes.
    scratch_owner: Vec<u8>,
    pool: Option<Arc<ScratchPool>>,
    /// `scratch` is the caller's output buffer (see [`OpMemory::with_output`]).
    external: bool,
    /// In place: `scratch` and `input` are the caller's tensor, `backup` holds its
    /// original bytes wherever `saved` says the op wrote (see [`OpMemory::in_place`]).
    backup: *mut u8,
    saved: Mutex<Saved>,
    _keepalive: Box<dyn Send + Sync>,
}

/// Which of an in-place op's ranges hold results, their original bytes in the backup.
#[derive(Debug)]
enum Saved {
    Nothing,
    All,
    Ranges(Vec<std::ops::Range<usize>>),
}

/// Recycles scratch buffers between collectives: a fresh multi-MiB allocation costs a
/// page fault per 4 KiB on first touch, which is a large share of a loopback reduce.
pub struct ScratchPool {
    free: Mutex<Vec<Vec<u8>>>,
    max_bytes: usize,
}

impl ScratchPool {
    pub fn new(max_bytes: usize) -> Arc<ScratchPool> {
        Arc::new(ScratchPool {
            free: Mutex::new(Vec::new()),
            max_bytes,
        })
    }

    /// A buffer of `len` bytes from `pool`, or a fresh zeroed one without a pool.
    fn take_from(pool: Option<&ScratchPool>, len: usize) -> Vec<u8> {
        match pool {
            Some(p) => p.take(len),
            None => vec![0u8; len],
        }
    }

    /// A buffer of exactly `len` bytes (contents unspecified but initialised).
    fn take(&self, len: usize) -> Vec<u8> {
        let mut free = self.free.lock().unwrap();
        let best = free
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= len)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        let mut buf = match best {
            Some(i) => free.swap_remove(i),
            None => Vec::new(),
        };
        drop(free);
        buf.resize(len, 0);
        buf
    }

    fn give(&self, buf: Vec<u8>) {
        let mut free = self.free.lock().unwrap();
        let held: usize = free.iter().map(Vec::capacity).sum();
        if held + buf.capacity() <= self.max_bytes {
            free.push(buf);
        } else if let Some(smallest) = free.iter().map(Vec::capacity).min() {
            // Prefer keeping large buffers: they are the expensive ones to fault in.
            if smallest < buf.capacity() {
                let i = free.iter().position(|b| b.capacity() == smallest).unwrap();
                free.swap_remove(i);
                if held - smallest + buf.capacity() <= self.max_bytes {
                    free.push(buf);
                }
            }
        }
    }
}

/// Whether the `len` bytes at `a` and at `b` do not overlap.
pub fn disjoint(a: *const u8, b: *const u8, len: usize) -> bool {
    let (a, b) = (a as usize, b as usize);
    a.checked_add(len).is_some_and(|end| end <= b) || b.checked_add(len).is_some_and(|end| end <= a)
}

impl Drop for OpMemory {
    fn drop(&mut self) {
        if let Some(pool) = &self.pool {
            pool.give(std::mem::take(&mut self.scratch_owner));
        }
    }
}

// SAFETY: `input` is only read (in place it is `scratch`, read only where no task writes
// it); `scratch` and `backup` are written at disjoint piece ranges whose hand-over
// between tasks is ordered by the Release/Acquire progress counters.
unsafe impl Send for OpMemory {}
unsafe impl Sync for OpMemory {}

impl OpMemory {
    /// # Safety
    /// `input..input+len` must stay valid and unmodified while `keepalive` lives.
    pub unsafe fn new(
        input: *const u8,
        len: usize,
        keepalive: Box<dyn Send + Sync>,
        pool: Option<Arc<ScratchPool>>,
    ) -> Self {
        let mut owner = ScratchPool::take_from(pool.as_deref(), len);
        let scratch = owner.as_mut_ptr();
        OpMemory {
            input,
            len,
            scratch,
            scratch_owner: owner,
            pool,
            external: false,
            backup: std::ptr::null_mut(),
            saved: Mutex::new(Saved::Nothing),
            _keepalive: keepalive,
        }
    }

    /// Memory of an in-place all-reduce whose results land in `tensor` itself as the
    /// ring computes them; a backup of `len` bytes (from `pool`) receives the original
    /// bytes of every range before it is written, so a failure can put them back.
    ///
    /// # Safety
    /// `tensor..tensor+len` must stay valid while `keepalive` lives, and nothing else
    /// may read or write it until the op has run and been committed or rolled back.
    pub unsafe fn in_place(
        tensor: *mut u8,
        len: usize,
        keepalive: Box<dyn Send + Sync>,
        pool: Option<Arc<ScratchPool>>,
    ) -> Self {
        let mut owner = ScratchPool::take_from(pool.as_deref(), len);
        let backup = owner.as_mut_ptr();
        OpMemory {
            input: tensor,
            len,
            scratch: tensor,
            scratch_owner: owner,
            pool,
            external: false,
            backup,
            saved: Mutex::new(Saved::Nothing),
            _keepalive: keepalive,
        }
    }

    /// Memory whose results land in `output` (the caller's other buffer) instead of
    /// scratch: the out-of-place all-reduce needs no copy after the outcome.
    ///
    /// # Safety
    /// As for [`OpMemory::new`], and `output..output+len` must stay valid while
    /// `keepalive` lives, be written by nothing else meanwhile, and not overlap the
    /// input (see [`disjoint`]).
    pub unsafe fn with_output(
        input: *const u8,
        output: *mut u8,
        len: usize,
        keepalive: Box<dyn Send + Sync>,
    ) -> Self {
        debug_assert!(disjoint(input, output, len));
        OpMemory {
            input,
            len,
            scratch: output,
            scratch_owner: Vec::new(),
            pool: None,
            external: true,
            backup: std::ptr::null_mut(),
            saved: Mutex::new(Saved::Nothing),
            _keepalive: keepalive,
        }
    }

    /// Whether the results land in the caller's output buffer.
    pub fn is_external(&self) -> bool {
        self.external
    }

    /// Whether the results land in the caller's input buffer (see [`OpMemory::in_place`]).
    pub fn is_in_place(&self) -> bool {
        !self.backup.is_null()
    }

    /// Whether the op's tasks write memory the caller owns.
    fn writes_caller_memory(&self) -> bool {
        self.external || self.is_in_place()
    }

    #[allow(clippy::mut_from_ref)]
    fn backup_mut(&self, r: std::ops::Range<usize>) -> &mut [u8] {
        debug_assert!(self.is_in_place() && r.end <= self.len);
        // SAFETY: in bounds of the backup; each piece range is written by one task at a
        // time (as for scratch).
        unsafe { std::slice::from_raw_parts_mut(self.backup.add(r.start), r.len()) }
    }

    /// In place: copies the original `tensor[r]` to `backup[r]` before the op writes it.
    fn save(&self, r: std::ops::Range<usize>) {
        self.backup_mut(r.clone()).copy_from_slice(self.scratch(r));
    }

    /// In place: puts the original `tensor[r]` back from `backup[r]` (see `save`).
    fn restore(&self, r: std::ops::Range<usize>) {
        self.scratch_mut(r.clone())
            .copy_from_slice(self.backup_mut(r));
    }

    /// Records which ranges hold results (their originals in the backup).
    fn set_saved(&self, saved: Saved) {
        if self.is_in_place() {
            *self.saved.lock().unwrap() = saved;
        }
    }

    /// In place, after the op ran: puts the original bytes back wherever it wrote
    /// them, so the caller's tensor is as before the op (a no-op otherwise, and the
    /// second time). Not while the op's tasks may still write (it has returned).
    pub fn rollback(&self) {
        if !self.is_in_place() {
            return;
        }
        let saved = std::mem::replace(&mut *self.saved.lock().unwrap(), Saved::Nothing);
        match saved {
            Saved::Nothing => {}
            Saved::All => self.restore(0..self.len),
            Saved::Ranges(ranges) => ranges.into_iter().for_each(|r| self.restore(r)),
        }
    }

    /// In place: the results stay in the caller's tensor for good (rollback is a no-op
    /// from now on).
    pub fn keep(&self) {
        self.set_saved(Saved::Nothing);
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn input(&self, r: std::ops::Range<usize>) -> &[u8] {
        debug_assert!(r.end <= self.len);
        // SAFETY: within bounds; the input is valid for the lifetime of self.
        unsafe { std::slice::from_raw_parts(self.input.add(r.start), r.len()) }
    }

    fn scratch(&self, r: std::ops::Range<usize>) -> &[u8] {
        debug_assert!(r.end <= self.len);
        // SAFETY: within bounds; see the Sync impl for the aliasing discipline.
        unsafe { std::slice::from_raw_parts(self.scratch.add(r.start), r.len()) }
    }

    #[allow(clippy::mut_from_ref)]
    fn scratch_mut(&self, r: std::ops::Range<usize>) -> &mut [u8] {
        debug_assert!(r.end <= self.len);
        // SAFETY: each piece range is written by exactly one task at a time.
        unsafe { std::slice::from_raw_parts_mut(self.scratch.add(r.start), r.len()) }
    }

    /// The whole input (an algorithm that reads it before writing anything).
    pub(crate) fn input_all(&self) -> &[u8] {
        self.input(0..self.len)
    }

    /// Writes the whole result at once, for an algorithm that computed it in its own
    /// memory (`crate::ring::mesh`): in place, the original bytes move to the backup
    /// first, so `rollback` can put them back. Not while anything else reads the input.
    pub(crate) fn write_result(&self, bytes: &[u8]) {
        debug_assert_eq!(bytes.len(), self.len);
        if self.is_in_place() {
            self.save(0..self.len);
        }
        self.scratch_mut(0..self.len).copy_from_slice(bytes);
        self.set_saved(Saved::All);
    }

    /// Where the results are written (the output buffer of `with_output`, or scratch).
    pub fn result_ptr(&self) -> *const u8 {
        self.scratch
    }

    /// The reduced result (valid once `ring_all_reduce` returned Ok).
    pub fn result(&self) -> &[u8] {
        self.scratch(0..self.len)
    }
}

/// Staging memory for received pieces (quantized ones here, the mesh's steps in
/// `mesh.rs`), written at disjoint slots by one task at a time.
pub(crate) struct Stage {
    ptr: *mut u8,
    len: usize,
    _owner: Vec<u8>,
}

// SAFETY: slots are disjoint; hand-over is ordered by the progress counters.
unsafe impl Send for Stage {}
unsafe impl Sync for Stage {}

impl Stage {
    pub(crate) fn new(len: usize) -> Stage {
        let mut owner = vec![0u8; len];
        Stage {
            ptr: owner.as_mut_ptr(),
            len,
            _owner: owner,
        }
    }

    #[allow(clippy::mut_from_ref)]
    pub(crate) fn slot(&self, offset: usize, len: usize) -> &mut [u8] {
        assert!(offset + len <= self.len);
        // SAFETY: in bounds; see the Sync impl for the aliasing discipline.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(offset), len) }
    }
}

/// Geometry of the split: chunk boundaries in elements, pieces per chunk.
struct Plan {
    world: usize,
    rank: usize,
    elem: usize,
    count: usize,
    piece_elems: usize,
    pieces: usize,
    steps: usize,
}

impl Plan {
    fn new(spec: &ReduceSpec, len: usize) -> CoreResult<Plan> {
        let elem = spec.dtype.size();
        if !len.is_multiple_of(elem) {
            return Err(CoreError::InvalidArgument(format!(
                "buffer of {len} bytes is not a whole number of {} elements",
                spec.dtype.name()
            )));
        }
        let count = len / elem;
        let piece_elems = (spec.piece_bytes / elem).max(1);
        let max_chunk = count.div_ceil(spec.world);
        let pieces = max_chunk.div_ceil(piece_elems).max(1);
        Ok(Plan {
            world: spec.world,
            rank: spec.rank,
            elem,
            count,
            piece_elems,
            pieces,
            steps: 2 * (spec.world - 1),
        })
    }

    fn chunk(&self, c: usize) -> (usize, usize) {
        (
            self.count * c / self.world,
            self.count * (c + 1) / self.world,
        )
    }

    /// Byte range of piece `p` of chunk `c` (possibly empty).
    fn piece(&self, c: usize, p: usize) -> std::ops::Range<usize> {
        let (lo, hi) = self.chunk(c);
        let a = (lo + p * self.piece_elems).min(hi);
        let b = (lo + (p + 1) * self.piece_elems).min(hi);
        a * self.elem..b * self.elem
    }

    fn wrap(&self, x: isize) -> usize {
        x.rem_euclid(self.world as isize) as usize
    }

    fn send_chunk(&self, step: usize) -> usize {
        let r = self.rank as isize;
        if step < self.world - 1 {
            self.wrap(r - step as isize)
        } else {
            self.wrap(r + 1 - (step - (self.world - 1)) as isize)
        }
    }

    fn recv_chunk(&self, step: usize) -> usize {
        let r = self.rank as isize;
        if step < self.world - 1 {
            self.wrap(r - step as isize - 1)
        } else {
            self.wrap(r - (step - (self.world - 1)) as isize)
        }
    }
}

struct Shared {
    mem: Arc<OpMemory>,
    /// Quantized runs: one slot per piece for reduce-scatter (a lane lands and reduces
    /// a piece before it reads the next), and one per (all-gather step, piece), kept
    /// until forwarded verbatim so every peer decodes the very same bytes.
    rs_stage: Option<Stage>,
    ag_stage: Option<Stage>,
    qslot: usize,
    plan: Plan,
    spec: ReduceSpec,
    /// The pieces' checks and progress, the bytes moved, the op's own failure.
    pieces: PieceTracker,
    /// In place: bytes of piece p's current step already written into the tensor
    /// (their originals saved), until it has landed: the blocks folded in so far of a
    /// streamed reduce-scatter piece, or the whole range of a first all-gather piece
    /// being received; see `written_ranges`.
    applied: Vec<AtomicUsize>,
}

impl Shared {
    /// Whether the pieces of `step` arrive in parts through `land_part`: unquantized
    /// reduce-scatter steps of ops that write the caller's memory (received and reduced
    /// in one pass). All-gather pieces, and every piece of scratch-memory ops, land
    /// directly.
    fn streamed(&self, step: usize) -> bool {
        let last_rs = self.plan.world - 2;
        self.spec.quant.is_none() && self.mem.writes_caller_memory() && step <= last_rs
    }

    /// Bytes a piece of `raw` payload bytes takes on the wire.
    fn wire_len(&self, raw: usize) -> usize {
        match self.spec.quant {
            Some(_) => quant::quantized_len(raw / self.plan.elem),
            None => raw,
        }
    }

    /// The staging slot that receives piece `(step, p)` of a quantized run.
    #[allow(clippy::mut_from_ref)]
    fn staging(&self, step: usize, p: usize, len: usize) -> Option<&mut [u8]> {
        let last_rs = self.plan.world - 2;
        if step <= last_rs {
            self.rs_stage.as_ref().map(|s| s.slot(p * self.qslot, len))
        } else {
            let t = step - (last_rs + 1);
            self.ag_stage
                .as_ref()
                .map(|s| s.slot((t * self.plan.pieces + p) * self.qslot, len))
        }
    }
}

impl Landing for Shared {
    fn landing(&self, step: u32, piece: u32, len: u32, digest: u32) -> CoreResult<Dest> {
        let (step, p) = (step as usize, piece as usize);
        self.pieces.check(step, p, digest)?;
        let plan = &self.plan;
        let range = plan.piece(plan.recv_chunk(step), p);
        let expected = self.wire_len(range.len());
        if expected != len as usize {
            return Err(CoreError::Protocol(format!(
                "piece {step}/{p} of collective {} has {len} bytes, expected {expected} \
                 (do all peers reduce the same tensor?)",
                self.spec.op_id
            )));
        }
        self.pieces.claim(step, p)?;
        if self.streamed(step) {
            return Ok(Dest::Streamed);
        }
        let dst = match self.staging(step, p, expected) {
            Some(slot) => slot,
            None => {
                if self.mem.is_in_place() && step == plan.world - 1 {
                    // The first all-gather step lands our own chunk, final, straight
                    // over the tensor's original bytes, which the sender saved when
                    // it sent them at step 0: written from now on (`written_ranges`).
                    self.applied[p].store(range.len(), Ordering::Release);
                }
                self.mem.scratch_mut(range)
            }
        };
        Ok(Dest::Direct(dst.as_mut_ptr(), dst.len()))
    }

    fn land_part(&self, step: u32, piece: u32, offset: usize, data: &[u8]) -> CoreResult<()> {
        let (step, p) = (step as usize, piece as usize);
        let plan = &self.plan;
        let range = plan.piece(plan.recv_chunk(step), p);
        if !self.streamed(step)
            || offset + data.len() > range.len()
            || !data.len().is_multiple_of(plan.elem)
        {
            return Err(CoreError::Protocol(format!(
                "block {offset}+{} of piece {step}/{p} of collective {} does not fit it",
                data.len(),
                self.spec.op_id
            )));
        }
        let sub = range.start + offset..range.start + offset + data.len();
        let (dtype, op) = (self.spec.dtype, self.spec.op);
        if self.mem.is_in_place() {
            // Ours moves to the backup first; the tensor then gets what arrived, reduced
            // with ours after it.
            self.mem.save(sub.clone());
            let out = self.mem.scratch_mut(sub.clone());
            reduce::reduce(dtype, op, out, data, self.mem.backup_mut(sub))?;
            self.applied[p].store(offset + data.len(), Ordering::Release);
        } else {
            // What the previous peer accumulated, then ours after it, into the output.
            let out = self.mem.scratch_mut(sub.clone());
            reduce::reduce(dtype, op, out, data, self.mem.input(sub))?;
        }
        Ok(())
    }

    fn landed(&self, step: u32, piece: u32) -> CoreResult<()> {
        let (step, p) = (step as usize, piece as usize);
        let plan = &self.plan;
        let range = plan.piece(plan.recv_chunk(step), p);
        let wire_len = self.wire_len(range.len());
        self.pieces
            .rx
            .fetch_add((HEADER_LEN + wire_len) as u64, Ordering::Relaxed);
        let last_rs = plan.world - 2;
        let (dtype, op) = (self.spec.dtype, self.spec.op);
        // In place, steps up to the first all-gather write ranges not saved yet.
        let first_write = self.mem.is_in_place() && step <= last_rs + 1;
        match (self.spec.quant, self.staging(step, p, wire_len)) {
            (Some((_, wire)), Some(slot)) => {
                if first_write {
                    self.mem.save(range.clone());
                }
                let acc = self.mem.scratch_mut(range.clone());
                let decoded = if step <= last_rs {
                    // What the previous peer accumulated, decoded, then ours after it.
                    let ours = match first_write {
                        true => &*self.mem.backup_mut(range.clone()),
                        false => self.mem.input(range.clone()),
                    };
                    quant::dequantize_reduce(wire, dtype, op, slot, ours, acc)
                } else {
                    quant::dequantize(wire, dtype, slot, acc)
                };
                if decoded.is_err() && first_write {
                    // Not counted as landed, so not in `written_ranges`: undo it here.
                    self.mem.restore(range.clone());
                }
                decoded?;
            }
            _ if self.streamed(step) => {
                // Reduced (or, in place, saved and written) block by block as it came.
                self.applied[p].store(0, Ordering::Release);
            }
            _ => {
                if step <= last_rs {
                    // scratch holds what the previous peer accumulated; add ours after it.
                    let acc = self.mem.scratch_mut(range.clone());
                    reduce::reduce_inplace(dtype, op, acc, self.mem.input(range.clone()))?;
                }
            }
        }
        if step == last_rs {
            reduce::finalize(dtype, op, self.mem.scratch_mut(range), plan.world)?;
        }
        self.pieces.finish(step, p);
        Ok(())
    }
}

/// Runs the all-reduce of `mem` over `links`. On success the result is in
/// `mem.result()`; on failure nothing outside `mem`'s scratch was touched. Until
/// `armed` is set, silence from the previous peer is no stall.
pub async fn ring_all_reduce(
    links: Arc<RingLinks>,
    spec: ReduceSpec,
    mem: Arc<OpMemory>,
    cancel: CancellationToken,
    armed: Arc<Armed>,
) -> CoreResult<ReduceStats> {
    let shared = Arc::new(Shared::prepare(spec, mem, links.max_piece(), links.prev)?);
    let outcome = drive(
        &links,
        shared.clone(),
        &cancel,
        &armed,
        shared.mem.writes_caller_memory(),
        |lane, links, sh, cancel| async move { send_lane(&links, &sh, lane, &cancel).await },
    )
    .await;
    if shared.mem.is_in_place() {
        match outcome {
            Ok(()) => shared.mem.set_saved(Saved::All),
            Err(_) => {
                // Every range written so far has its original in the backup: put it back.
                shared.mem.set_saved(Saved::Ranges(shared.written_ranges()));
                shared.mem.rollback();
            }
        }
    }
    outcome?;
    Ok(shared.pieces.stats())
}

/// What [`drive`] needs of an op's receiving side: its pieces' progress, and why it
/// failed when that is its own fault (a peer runs another descriptor) rather than the
/// links' ([`PieceTracker`]).
pub(crate) trait DrivenOp: Landing + 'static {
    fn pieces(&self) -> &PieceTracker;
}

impl DrivenOp for Shared {
    fn pieces(&self) -> &PieceTracker {
        &self.pieces
    }
}

/// Runs one op on `links`: registers its receiving side, starts a sender task per lane
/// (`lane_task(lane, links, op, cancel)`), and waits until every sender finished and
/// every piece the op expects landed (see [`wait_until_done`]). A failure cancels the
/// senders and, when the pieces land in the caller's memory, waits until no reader
/// writes it any more ([`settle_landings`]). The op is finished on the links either way;
/// dropped half-way, it poisons them (a lane may have left half a frame).
pub(crate) async fn drive<S, F, Fut>(
    links: &Arc<RingLinks>,
    shared: Arc<S>,
    cancel: &CancellationToken,
    armed: &Armed,
    writes_caller_memory: bool,
    lane_task: F,
) -> CoreResult<()>
where
    S: DrivenOp,
    F: Fn(usize, Arc<RingLinks>, Arc<S>, CancellationToken) -> Fut,
    Fut: std::future::Future<Output = CoreResult<()>> + Send + 'static,
{
    let (op_id, total) = (shared.pieces().op_id(), shared.pieces().total());
    let mut guard = AbortGuard {
        links: links.clone(),
        cancel: cancel.clone(),
        op_id,
        armed: true,
    };
    links.register(op_id, shared.clone())?;
    let mut senders = tokio::task::JoinSet::new();
    for lane in 0..links.send_lanes() {
        senders.spawn(lane_task(
            lane,
            links.clone(),
            shared.clone(),
            cancel.clone(),
        ));
    }
    let pieces = shared.pieces();
    let outcome = wait_until_done(links, pieces, &mut senders, total, cancel, armed).await;
    let outcome = outcome.map_err(|e| pieces.own_failure().unwrap_or(e));
    if outcome.is_err() {
        cancel.cancel();
        while senders.join_next().await.is_some() {}
    }
    guard.armed = false;
    links.finish(op_id);
    if outcome.is_err() && writes_caller_memory {
        settle_landings(links, pieces).await;
    }
    outcome
}

/// Waits until `progress` (a piece's landed steps) reaches `step`: a sender forwards a
/// piece only once its previous step has landed here.
pub(crate) async fn wait_progress(
    links: &RingLinks,
    advanced: &Notify,
    progress: &AtomicU32,
    step: usize,
    cancel: &CancellationToken,
) -> CoreResult<()> {
    loop {
        let notified = advanced.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if progress.load(Ordering::Acquire) >= step as u32 {
            return Ok(());
        }
        tokio::select! {
            _ = notified => {}
            _ = cancel.cancelled() => return Err(links.aborted_error()),
            _ = links.poisoned().cancelled() => return Err(links.poison_error()),
        }
    }
}

impl Shared {
    /// In place, once no task writes any more: the ranges whose original bytes moved to
    /// the backup. Piece `p` saved one range at each step below `progress[p]`, up to
    /// the first all-gather step; later steps (and pieces cut off mid-landing) write
    /// only ranges saved before, or the backup.
    fn written_ranges(&self) -> Vec<std::ops::Range<usize>> {
        let plan = &self.plan;
        let mut ranges = Vec::new();
        for (p, progress) in self.pieces.progress.iter().enumerate() {
            let done = progress.load(Ordering::Acquire) as usize;
            for step in 0..done.min(plan.world) {
                let r = plan.piece(plan.recv_chunk(step), p);
                if !r.is_empty() {
                    ranges.push(r);
                }
            }
            // A piece cut off mid-way: what `applied` says it may have written.
            let applied = self.applied[p].load(Ordering::Acquire);
            if applied > 0 && done < plan.world {
                let r = plan.piece(plan.recv_chunk(done), p);
                ranges.push(r.start..r.start + applied);
            }
        }
        ranges
    }

    /// Checks `spec` against `mem` and the links' piece limit and sets up the op's
    /// state: the plan, the staging memory of quantized runs and the progress counters.
    fn prepare(
        spec: ReduceSpec,
        mem: Arc<OpMemory>,
        max_piece: usize,
        prev: u64,
    ) -> CoreResult<Shared> {
        if spec.world < 2 {
            return Err(CoreError::InvalidArgument(
                "a ring needs at least two peers".into(),
            ));
        }
        if spec.rank >= spec.world {
            return Err(CoreError::InvalidArgument("rank outside the world".into()));
        }
        let plan = Plan::new(&spec, mem.len())?;
        if plan.piece_elems * plan.elem > max_piece {
            return Err(CoreError::InvalidArgument(
                "piece larger than the link's limit".into(),
            ));
        }
        if spec.quant.is_some()
            && (!spec.dtype.is_float() || !matches!(spec.op, ReduceOp::Sum | ReduceOp::Avg))
        {
            return Err(CoreError::InvalidArgument(format!(
                "quantized all-reduce supports SUM and AVG of float tensors, not {} of {}",
                spec.op.name(),
                spec.dtype.name()
            )));
        }
        let qslot = quant::quantized_len(plan.piece_elems);
        let (rs_stage, ag_stage) = match spec.quant {
            Some(_) => (
                Some(Stage::new(plan.pieces * qslot)),
                Some(Stage::new((plan.world - 1) * plan.pieces * qslot)),
            ),
            None => (None, None),
        };
        let words = OpWords {
            noun: "collective",
            differs: "element count, dtype, reduce op, quantization, world or piece size differ",
            outside_hint: "; do all peers reduce the same tensor?",
        };
        let pieces = PieceTracker::new(
            words,
            spec.op_id,
            spec.digest(mem.len()),
            prev,
            plan.steps,
            plan.pieces,
        );
        Ok(Shared {
            pieces,
            rs_stage,
            ag_stage,
            qslot,
            applied: (0..plan.pieces).map(|_| AtomicUsize::new(0)).collect(),
            mem,
            plan,
            spec,
        })
    }
}

/// The receiving side of one op, driven by hand instead of by a lane's reader task:
/// what `crate::fuzzing` feeds untrusted piece streams to.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) struct Receiver(Arc<Shared>);

#[cfg(any(test, feature = "fuzzing"))]
impl Receiver {
    pub(crate) fn new(spec: ReduceSpec, mem: Arc<OpMemory>, max_piece: usize) -> CoreResult<Self> {
        Ok(Receiver(Arc::new(Shared::prepare(
            spec, mem, max_piece, 0,
        )?)))
    }

    /// The digest the op's pieces must carry.
    pub(crate) fn digest(&self) -> u32 {
        self.0.pieces.digest
    }

    /// `(steps, pieces)` of the op.
    pub(crate) fn shape(&self) -> (usize, usize) {
        (self.0.plan.steps, self.0.plan.pieces)
    }

    pub(crate) fn landing(
        &self,
        step: u32,
        piece: u32,
        len: u32,
        digest: u32,
    ) -> CoreResult<(*mut u8, usize)> {
        match self.0.landing(step, piece, len, digest)? {
            Dest::Direct(ptr, n) => Ok((ptr, n)),
            Dest::Streamed => unreachable!("ops on scratch memory land every piece directly"),
        }
    }

    pub(crate) fn landed(&self, step: u32, piece: u32) -> CoreResult<()> {
        self.0.landed(step, piece)
    }

    /// Claims a piece as a reader does, whatever its destination.
    #[cfg(test)]
    pub(crate) fn claim(&self, step: u32, piece: u32, len: u32, digest: u32) -> CoreResult<Dest> {
        self.0.landing(step, piece, len, digest)
    }

    /// In place: what the sender does as it sends piece `piece` of our own chunk at
    /// step 0 (saves its original bytes).
    #[cfg(test)]
    pub(crate) fn sent_own(&self, piece: usize) {
        let plan = &self.0.plan;
        self.0.mem.save(plan.piece(plan.send_chunk(0), piece));
    }

    /// Hands a block of a streamed piece to the op (as a reader does).
    #[cfg(test)]
    pub(crate) fn land_part(
        &self,
        step: u32,
        piece: u32,
        offset: usize,
        data: &[u8],
    ) -> CoreResult<()> {
        self.0.land_part(step, piece, offset, data)
    }

    /// What a failed op does before it returns: an in-place op puts back every range
    /// it wrote (the receiving side here being all there is of it).
    #[cfg(test)]
    pub(crate) fn fail(&self) {
        self.0.mem.set_saved(Saved::Ranges(self.0.written_ranges()));
        self.0.mem.rollback();
    }

    /// Bytes piece `(step, piece)` takes on the wire.
    pub(crate) fn wire_len(&self, step: usize, piece: usize) -> usize {
        let plan = &self.0.plan;
        self.0
            .wire_len(plan.piece(plan.recv_chunk(step), piece).len())
    }

    /// Pieces landed so far.
    pub(crate) fn landed_count(&self) -> u64 {
        self.0.pieces.landed_count()
    }
}

/// After a failed op whose pieces land in the caller's memory: no reader may write it
/// once the op returns. Waits (bounded by the I/O timeout) for pieces being received
/// now; a reader stuck in one is stopped by closing the links (after a failure they
/// are rebuilt anyway).
async fn settle_landings(links: &RingLinks, sh: &PieceTracker) {
    let deadline = tokio::time::Instant::now() + links.io_timeout();
    loop {
        let notified = sh.advanced.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if sh.close() {
            break;
        }
        if tokio::time::timeout_at(deadline, notified).await.is_err() {
            links.close().await;
            break;
        }
    }
}

/// Waits until every sender finished and every expected piece landed. Once armed,
/// fails when the previous peer sends nothing for the link's I/O timeout (the clock
/// starts again when the op is armed).
async fn wait_until_done(
    links: &RingLinks,
    sh: &PieceTracker,
    senders: &mut tokio::task::JoinSet<CoreResult<()>>,
    total: u64,
    cancel: &CancellationToken,
    armed: &Armed,
) -> CoreResult<()> {
    let mut senders_left = senders.len();
    let mut clock = StallClock::new(sh.landed_count(), armed.is_armed());
    loop {
        let notified = sh.advanced.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let arming = armed.notified();
        tokio::pin!(arming);
        arming.as_mut().enable();
        let is_armed = armed.is_armed();
        let landed = sh.landed_count();
        let stall_at = clock.stall_at(landed, is_armed, links.io_timeout());
        if senders_left == 0 && landed == total {
            return Ok(());
        }
        tokio::select! {
            joined = senders.join_next(), if senders_left > 0 => {
                senders_left -= 1;
                joined
                    .expect("counted")
                    .unwrap_or_else(|e| Err(CoreError::Aborted(format!("ring task failed: {e}"))))?;
            }
            _ = &mut notified => {}
            _ = &mut arming, if !is_armed => {}
            _ = cancel.cancelled() => return Err(links.aborted_error()),
            _ = links.poisoned().cancelled() => return Err(links.poison_error()),
            _ = tokio::time::sleep_until(stall_at), if is_armed && landed < total => {
                return Err(links.stall(links.prev));
            }
        }
    }
}

struct AbortGuard {
    links: Arc<RingLinks>,
    cancel: CancellationToken,
    op_id: u64,
    armed: bool,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if self.armed {
            self.cancel.cancel();
            self.links.poison(format!(
                "collective {} was abandoned mid-flight",
                self.op_id
            ));
            self.links.finish(self.op_id);
        }
    }
}

async fn send_lane(
    links: &RingLinks,
    sh: &Shared,
    lane: usize,
    cancel: &CancellationToken,
) -> CoreResult<()> {
    let plan = &sh.plan;
    let lanes = links.send_lanes();
    let mut encoded = vec![0u8; if sh.spec.quant.is_some() { sh.qslot } else { 0 }];
    for step in 0..plan.steps {
        let chunk = plan.send_chunk(step);
        for p in (lane..plan.pieces).step_by(lanes) {
            if step > 0 {
                // Wait until piece p of the previous step has landed and been reduced.
                let pieces = &sh.pieces;
                wait_progress(links, &pieces.advanced, &pieces.progress[p], step, cancel).await?;
            }
            let range = plan.piece(chunk, p);
            if step == 0 && sh.mem.is_in_place() && sh.spec.quant.is_none() {
                // Our own chunk, sent as it is, comes back final at the first all-gather
                // step and lands straight over it: its original bytes are saved now,
                // while the send is about to read them anyway. (Before the send: that
                // piece cannot come back before it left.)
                sh.mem.save(range.clone());
            }
            let raw = if step == 0 {
                sh.mem.input(range.clone())
            } else {
                sh.mem.scratch(range.clone())
            };
            let data: &[u8] = match sh.spec.quant {
                None => raw,
                Some((alg, wire)) => {
                    let first_ag = plan.world - 1;
                    if step <= first_ag {
                        // Reduce-scatter partials, and the owner's final chunk (first
                        // all-gather step), are encoded here.
                        let out = &mut encoded[..quant::quantized_len(range.len() / plan.elem)];
                        quant::quantize(alg, wire, sh.spec.dtype, raw, out)?;
                        if step == first_ag {
                            // The owner keeps exactly what the others will decode.
                            quant::dequantize(wire, sh.spec.dtype, out, sh.mem.scratch_mut(range))?;
                        }
                        out
                    } else {
                        // Forward the bytes received one step earlier, verbatim.
                        let len = sh.wire_len(range.len());
                        sh.staging(step - 1, p, len)
                            .expect("quantized runs have staging")
                    }
                }
            };
            let header = PieceHeader {
                op: sh.spec.op_id,
                step: step as u32,
                piece: p as u32,
                len: data.len() as u32,
                digest: sh.pieces.digest,
            };
            links
                .send_piece_or_abort(lane, header, data, cancel)
                .await?;
            sh.pieces
                .tx
                .fetch_add((HEADER_LEN + data.len()) as u64, Ordering::Relaxed);
        }
    }
    Ok(())
}
