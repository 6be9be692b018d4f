//! Ring all-gather: every rank contributes `len` bytes, and every peer ends with the
//! `world * len` bytes of all contributions, rank `r`'s at `r * len`. What sparse,
//! error-feedback compression needs: the peers' payloads cannot be summed on the way
//! (each keeps other indices), so each travels whole to everyone, and every peer then
//! decodes them in rank order into the same sum.
//!
//! The schedule is the all-gather half of the ring all-reduce without the reduce-scatter
//! before it: at step `s` (of `world - 1`) rank `r` forwards chunk `r - s`, its own at
//! step 0 and then the one it received at step `s - 1`, and receives chunk `r - s - 1`.
//! Each peer sends and receives `(world - 1) * len` bytes: half of what an all-reduce
//! of the `world * len`-byte buffer moves, and the least any schedule can (every peer
//! must receive the others' bytes). Pieces of at most `piece_bytes` travel striped over
//! the lanes of the ring links, and land straight in the output: no staging, no copy.
//!
//! It shares the ring links (and their framing, digests, stash of early pieces, stall
//! and poison rules) with the all-reduce, so it keeps what those promise: typed errors,
//! an op that fails alike on every peer when one dies, encryption, the relay routes,
//! and concurrency with other collectives on the same links.

use crate::error::{CoreError, CoreResult};
use crate::ring::allreduce::{drive, wait_progress, Armed, DrivenOp, ReduceStats};
use crate::ring::links::{Dest, Landing, PieceHeader, RingLinks, HEADER_LEN};
use crate::ring::pieces::{OpWords, PieceTracker};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

#[derive(Clone, Debug)]
pub struct GatherSpec {
    pub op_id: u64,
    pub rank: usize,
    pub world: usize,
    /// Upper bound on one piece, in bytes.
    pub piece_bytes: usize,
}

impl GatherSpec {
    /// Digest of what every peer of the op must agree on for contributions of `len`
    /// bytes: the kind of op, `len`, the world and the piece size. Never equal to an
    /// all-reduce's digest of the same op id by design (another prefix).
    pub fn digest(&self, len: usize) -> u32 {
        let mut d = Vec::with_capacity(32);
        d.extend_from_slice(b"pccl-ag1");
        for v in [len, self.world, self.piece_bytes.max(1)] {
            d.extend_from_slice(&(v as u64).to_le_bytes());
        }
        xxhash_rust::xxh3::xxh3_64(&d) as u32
    }
}

/// The output of an all-gather: `world * len` bytes of the caller's memory, rank `r`'s
/// contribution at `r * len`. The keep-alive owns whatever backs it.
pub struct GatherMemory {
    out: *mut u8,
    len: usize,
    world: usize,
    _keepalive: Box<dyn Send + Sync>,
}

// SAFETY: each chunk's pieces are written by one reader at a time, and read by a sender
// only after they landed (ordered by the Release/Acquire progress counters).
unsafe impl Send for GatherMemory {}
unsafe impl Sync for GatherMemory {}

impl GatherMemory {
    /// # Safety
    /// `out..out + world * len` must stay valid while `keepalive` lives, and nothing
    /// else may read or write it while the op runs; rank `rank`'s slot must already
    /// hold this peer's contribution (see [`GatherMemory::with_contribution`]).
    pub unsafe fn new(
        out: *mut u8,
        len: usize,
        world: usize,
        keepalive: Box<dyn Send + Sync>,
    ) -> Self {
        GatherMemory {
            out,
            len,
            world,
            _keepalive: keepalive,
        }
    }

    /// Copies `contribution` into slot `rank` of the output, then as [`GatherMemory::new`].
    ///
    /// # Safety
    /// As for [`GatherMemory::new`].
    pub unsafe fn with_contribution(
        contribution: &[u8],
        rank: usize,
        out: *mut u8,
        world: usize,
        keepalive: Box<dyn Send + Sync>,
    ) -> CoreResult<Self> {
        let len = contribution.len();
        if rank >= world {
            return Err(CoreError::InvalidArgument("rank outside the world".into()));
        }
        // SAFETY: forwarded to the caller.
        let mem = unsafe { GatherMemory::new(out, len, world, keepalive) };
        mem.slice_mut(rank * len..(rank + 1) * len)
            .copy_from_slice(contribution);
        Ok(mem)
    }

    /// Bytes of one contribution.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of the whole output (`world * len`).
    pub fn total(&self) -> usize {
        self.len * self.world
    }

    pub fn out_ptr(&self) -> *const u8 {
        self.out
    }

    fn slice(&self, r: std::ops::Range<usize>) -> &[u8] {
        assert!(r.end <= self.total());
        // SAFETY: in bounds; see the Sync impl for the aliasing discipline.
        unsafe { std::slice::from_raw_parts(self.out.add(r.start), r.len()) }
    }

    #[allow(clippy::mut_from_ref)]
    fn slice_mut(&self, r: std::ops::Range<usize>) -> &mut [u8] {
        assert!(r.end <= self.total());
        // SAFETY: in bounds; each piece range is written by one task at a time.
        unsafe { std::slice::from_raw_parts_mut(self.out.add(r.start), r.len()) }
    }

    /// The gathered bytes (all of them meaningful once the op succeeded).
    pub fn result(&self) -> &[u8] {
        self.slice(0..self.total())
    }
}

/// Geometry: chunk `c` is rank `c`'s slot; pieces of at most `piece` bytes.
struct Plan {
    world: usize,
    rank: usize,
    len: usize,
    piece: usize,
    pieces: usize,
}

impl Plan {
    fn piece_range(&self, chunk: usize, p: usize) -> std::ops::Range<usize> {
        let a = (p * self.piece).min(self.len);
        let b = ((p + 1) * self.piece).min(self.len);
        chunk * self.len + a..chunk * self.len + b
    }

    fn steps(&self) -> usize {
        self.world - 1
    }

    fn send_chunk(&self, step: usize) -> usize {
        (self.rank + self.world - step % self.world) % self.world
    }

    fn recv_chunk(&self, step: usize) -> usize {
        (self.rank + 2 * self.world - step % self.world - 1) % self.world
    }
}

struct Shared {
    mem: Arc<GatherMemory>,
    plan: Plan,
    spec: GatherSpec,
    /// The pieces' checks and progress, the bytes moved, the op's own failure.
    pieces: PieceTracker,
}

impl Shared {
    fn prepare(
        spec: GatherSpec,
        mem: Arc<GatherMemory>,
        max_piece: usize,
        prev: u64,
    ) -> CoreResult<Shared> {
        if spec.world < 2 {
            return Err(CoreError::InvalidArgument(
                "a ring needs at least two peers".into(),
            ));
        }
        if spec.rank >= spec.world || mem.world != spec.world {
            return Err(CoreError::InvalidArgument(
                "rank or world do not match the output".into(),
            ));
        }
        let piece = spec.piece_bytes.max(1);
        if piece > max_piece {
            return Err(CoreError::InvalidArgument(
                "piece larger than the link's limit".into(),
            ));
        }
        let len = mem.len();
        let pieces = len.div_ceil(piece).max(1);
        let plan = Plan {
            world: spec.world,
            rank: spec.rank,
            len,
            piece,
            pieces,
        };
        let words = OpWords {
            noun: "all-gather",
            differs: "an all-gather of another size, world or piece size, or not an all-gather",
            outside_hint: "",
        };
        let pieces = PieceTracker::new(
            words,
            spec.op_id,
            spec.digest(len),
            prev,
            plan.steps(),
            pieces,
        );
        Ok(Shared {
            pieces,
            mem,
            plan,
            spec,
        })
    }
}

impl DrivenOp for Shared {
    fn pieces(&self) -> &PieceTracker {
        &self.pieces
    }
}

impl Landing for Shared {
    fn landing(&self, step: u32, piece: u32, len: u32, digest: u32) -> CoreResult<Dest> {
        let (step, p) = (step as usize, piece as usize);
        self.pieces.check(step, p, digest)?;
        let range = self.plan.piece_range(self.plan.recv_chunk(step), p);
        if range.len() != len as usize {
            return Err(CoreError::Protocol(format!(
                "piece {step}/{p} of all-gather {} has {len} bytes, expected {}",
                self.spec.op_id,
                range.len()
            )));
        }
        self.pieces.claim(step, p)?;
        let dst = self.mem.slice_mut(range);
        Ok(Dest::Direct(dst.as_mut_ptr(), dst.len()))
    }

    fn land_part(&self, step: u32, piece: u32, _offset: usize, _data: &[u8]) -> CoreResult<()> {
        Err(CoreError::Protocol(format!(
            "piece {step}/{piece} of all-gather {} came in parts (it lands whole)",
            self.spec.op_id
        )))
    }

    fn landed(&self, step: u32, piece: u32) -> CoreResult<()> {
        let (step, p) = (step as usize, piece as usize);
        let range = self.plan.piece_range(self.plan.recv_chunk(step), p);
        self.pieces
            .rx
            .fetch_add((HEADER_LEN + range.len()) as u64, Ordering::Relaxed);
        self.pieces.finish(step, p);
        Ok(())
    }
}

/// The receiving side of one all-gather, driven by hand: what tests feed hostile piece
/// streams to.
#[cfg(test)]
pub(crate) fn receiver(
    spec: GatherSpec,
    mem: Arc<GatherMemory>,
    max_piece: usize,
) -> CoreResult<Arc<dyn Landing>> {
    Ok(Arc::new(Shared::prepare(spec, mem, max_piece, 0)?))
}

/// Runs the all-gather of `mem` over `links`. On success every slot of `mem` holds its
/// rank's contribution; on failure the slots of the others hold unspecified bytes (and
/// no task writes them any more once this returns). Until `armed` is set, silence from
/// the previous peer is no stall.
pub async fn ring_all_gather(
    links: Arc<RingLinks>,
    spec: GatherSpec,
    mem: Arc<GatherMemory>,
    cancel: CancellationToken,
    armed: Arc<Armed>,
) -> CoreResult<ReduceStats> {
    let shared = Arc::new(Shared::prepare(spec, mem, links.max_piece(), links.prev)?);
    // The pieces land in the caller's memory: nothing may write it after we return.
    let outcome = drive(
        &links,
        shared.clone(),
        &cancel,
        &armed,
        true,
        |lane, links, sh, cancel| async move { send_lane(&links, &sh, lane, &cancel).await },
    )
    .await;
    outcome?;
    Ok(shared.pieces.stats())
}

async fn send_lane(
    links: &RingLinks,
    sh: &Shared,
    lane: usize,
    cancel: &CancellationToken,
) -> CoreResult<()> {
    let plan = &sh.plan;
    let lanes = links.send_lanes();
    for step in 0..plan.steps() {
        let chunk = plan.send_chunk(step);
        for p in (lane..plan.pieces).step_by(lanes) {
            if step > 0 {
                // Forward piece p once it arrived at the previous step.
                let pieces = &sh.pieces;
                wait_progress(links, &pieces.advanced, &pieces.progress[p], step, cancel).await?;
            }
            let data = sh.mem.slice(plan.piece_range(chunk, p));
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

/// One all-gather bound to a ring's links: `run()` drives it (once), `abort()` stops it
/// from anywhere, `arm()` starts its stall clock.
pub struct GatherOp {
    links: Arc<RingLinks>,
    spec: GatherSpec,
    mem: Arc<GatherMemory>,
    cancel: CancellationToken,
    armed: Arc<Armed>,
    started: AtomicBool,
}

impl GatherOp {
    pub fn new(
        links: Arc<RingLinks>,
        spec: GatherSpec,
        mem: Arc<GatherMemory>,
        armed: bool,
    ) -> GatherOp {
        GatherOp {
            links,
            spec,
            mem,
            cancel: CancellationToken::new(),
            armed: Armed::new(armed),
            started: AtomicBool::new(false),
        }
    }

    /// The op's future, which resolves to its byte counts; an `InvalidUsage` error if it
    /// was already asked for (an op runs once).
    pub fn run(
        &self,
    ) -> CoreResult<impl Future<Output = CoreResult<ReduceStats>> + Send + 'static> {
        if self.started.swap(true, Ordering::AcqRel) {
            return Err(CoreError::InvalidUsage(
                "GatherOp.run() called twice".into(),
            ));
        }
        let (links, spec, mem) = (self.links.clone(), self.spec.clone(), self.mem.clone());
        let (cancel, armed) = (self.cancel.clone(), self.armed.clone());
        Ok(async move { ring_all_gather(links, spec, mem, cancel, armed).await })
    }

    /// Stops the op (its run fails). The links are poisoned if a frame was cut.
    pub fn abort(&self) {
        self.cancel.cancel();
    }

    /// Lets the op declare a stall from now on (idempotent; harmless once it ended).
    pub fn arm(&self) {
        self.armed.arm();
    }

    pub fn memory(&self) -> &GatherMemory {
        &self.mem
    }
}
