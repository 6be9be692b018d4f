//! The mesh all-reduce: recursive doubling over direct links between the peers of a
//! ring, for collectives too small for the ring's bandwidth to matter. Its latency
//! grows with log2(k) hops instead of the ring's 2(k-1).
//!
//! Ranks are the mesh's own order of the ring's peers ([`MeshConfig::ring`]: the ring's
//! order unless the master chose one for the mesh, as it does where it measured latencies:
//! recursive doubling wants regions split along a rank bit, which the ring, visiting each
//! region once, does not give), not the op's ring rank. Let `p` be the largest power of
//! two not above the world `k`;
//! ranks `p..k` are *extras*, each paired with rank `r - p`:
//!
//! - step 0: every extra sends its input to its pair, which folds it in after its own
//!   (`x_r op x_{r+p}`);
//! - steps `1..=log2(p)`: rank `r < p` exchanges its accumulator with `r ^ 2^(s-1)` and
//!   both compute `lower op higher` (lower: the accumulator of the lower rank), so the two
//!   hold the very same bytes afterwards; AVG is finalized after the last of these;
//! - step `log2(p) + 1`: every pair sends the result to its extra, which keeps it as is.
//!
//! The reduction order is fixed by the ranks alone (a tree, not the ring's order), and
//! every peer ends with the bytes the ranks below `p` computed identically, whatever
//! the timing. Each directed link carries at most one step of an op, so a piece's
//! header (op, step, piece, digest) says everything about where it lands.
//!
//! The links are [`RingLinks`] whose "next" and "previous" peer are the same partner:
//! the same framing, stash for early pieces, digests, poisoning and timeouts as the
//! ring. The op works in its own memory and writes the caller's only once, at the
//! end ([`OpMemory::write_result`]), so a failure leaves the caller's bytes untouched.
//! Unquantized ops only.

use crate::error::{CoreError, CoreResult};
use crate::net::handshake::Purpose;
use crate::net::node::{Node, PoolKey};
use crate::reduce;
use crate::ring::allreduce::{Armed, OpMemory, ReduceSpec, ReduceStats, Stage, StallClock};
use crate::ring::links::{Dest, Landing, LinkConfig, PieceHeader, RingLinks, HEADER_LEN};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// The largest power of two not above `world` (`world >= 1`).
fn core_size(world: usize) -> usize {
    1 << (usize::BITS - 1 - world.leading_zeros())
}

/// Hops of the mesh all-reduce of `world` peers: `log2(p)`, plus 2 when `world` is not
/// a power of two (the extras' step in and out).
pub fn mesh_rounds(world: usize) -> usize {
    if world < 2 {
        return 0;
    }
    let p = core_size(world);
    p.trailing_zeros() as usize + if p == world { 0 } else { 2 }
}

/// The ranks `rank` exchanges pieces with in a mesh all-reduce of `world` (a link each
/// way with every one of them), in step order.
pub fn mesh_partners(rank: usize, world: usize) -> Vec<usize> {
    schedule(rank, world)
        .iter()
        .flat_map(|s| [s.send_to, s.recv_from])
        .flatten()
        .fold(Vec::new(), |mut v, r| {
            if !v.contains(&r) {
                v.push(r);
            }
            v
        })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Combine {
    /// `acc = acc op received` (ours is the lower rank's).
    OursFirst,
    /// `acc = received op acc`.
    TheirsFirst,
    /// `acc = received` (the final result from the pair of an extra).
    Replace,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Step {
    step: u32,
    /// Send the accumulator (as it is before this step's combine) to this rank.
    send_to: Option<usize>,
    /// Then receive this rank's bytes and combine them.
    recv_from: Option<usize>,
    combine: Combine,
}

/// What `rank` does, step by step, in a mesh all-reduce of `world`.
fn schedule(rank: usize, world: usize) -> Vec<Step> {
    if world < 2 || rank >= world {
        return Vec::new();
    }
    let p = core_size(world);
    let log = p.trailing_zeros();
    let last = log + 1;
    if rank >= p {
        return vec![
            Step {
                step: 0,
                send_to: Some(rank - p),
                recv_from: None,
                combine: Combine::Replace,
            },
            Step {
                step: last,
                send_to: None,
                recv_from: Some(rank - p),
                combine: Combine::Replace,
            },
        ];
    }
    let extra = (rank + p < world).then_some(rank + p);
    let mut steps = Vec::new();
    if let Some(e) = extra {
        steps.push(Step {
            step: 0,
            send_to: None,
            recv_from: Some(e),
            combine: Combine::OursFirst,
        });
    }
    for j in 0..log {
        let partner = rank ^ (1 << j);
        steps.push(Step {
            step: j + 1,
            send_to: Some(partner),
            recv_from: Some(partner),
            combine: if rank < partner {
                Combine::OursFirst
            } else {
                Combine::TheirsFirst
            },
        });
    }
    if let Some(e) = extra {
        steps.push(Step {
            step: last,
            send_to: Some(e),
            recv_from: None,
            combine: Combine::Replace,
        });
    }
    steps
}

/// The mesh of one peer for one ring epoch: a [`RingLinks`] per partner (sending to
/// it, receiving from it), and the largest collective it takes.
pub struct Mesh {
    pub epoch: u64,
    /// Peer ids in mesh rank order (rank -> id): the ring's order unless the master
    /// sent an order of the mesh's own.
    pub ring: Vec<u64>,
    /// This peer's rank in `ring` (not necessarily its ring position).
    pub rank: usize,
    /// Collectives of at most this many bytes (unquantized) run on the mesh.
    pub max_bytes: usize,
    links: BTreeMap<usize, Arc<RingLinks>>,
}

impl Mesh {
    /// The mesh links of `epoch` from `node`'s pools of purpose `Mesh`: one dialed to
    /// every partner of `me` in `ring` (it must exist) and one from each (awaited for
    /// up to `cfg.pool_timeout`). The pools leave the node.
    pub async fn build(
        node: &Node,
        epoch: u64,
        ring: Vec<u64>,
        me: u64,
        max_bytes: usize,
        cfg: LinkConfig,
    ) -> CoreResult<Mesh> {
        let rank = ring.iter().position(|&id| id == me).ok_or_else(|| {
            CoreError::InvalidArgument(format!("peer {me} is not in the ring {ring:?}"))
        })?;
        let mut links = BTreeMap::new();
        for r in mesh_partners(rank, ring.len()) {
            let peer = ring[r];
            let key = PoolKey {
                peer,
                epoch,
                purpose: Purpose::Mesh,
            };
            let out = node.take_outbound(key).ok_or_else(|| {
                CoreError::PeerConnection(format!("no mesh pool to peer {peer} for epoch {epoch}"))
            })?;
            let inn = node.take_inbound(key, cfg.pool_timeout).await?;
            links.insert(
                r,
                RingLinks::new(epoch, peer, peer, out, inn, cfg.max_piece, cfg.io_timeout),
            );
        }
        Ok(Mesh {
            epoch,
            ring,
            rank,
            max_bytes,
            links,
        })
    }

    /// Whether an all-reduce of `len` bytes under `spec` runs here instead of the ring.
    pub fn takes(&self, spec: &ReduceSpec, len: usize) -> bool {
        spec.quant.is_none() && spec.world == self.ring.len() && len <= self.max_bytes
    }

    /// Whether any link failed.
    pub fn is_poisoned(&self) -> bool {
        self.links.values().any(|l| l.is_poisoned())
    }

    /// Stops every link's reader and closes the streams.
    pub async fn close(&self) {
        for l in self.links.values() {
            l.close().await;
        }
    }

    fn link(&self, rank: usize) -> CoreResult<&Arc<RingLinks>> {
        self.links.get(&rank).ok_or_else(|| {
            CoreError::PeerConnection(format!(
                "no mesh link to rank {rank} of epoch {}",
                self.epoch
            ))
        })
    }
}

/// The receiving state of one step.
struct Incoming {
    from: u64,
    /// Written piece by piece by the readers (each by the one that claimed it), read
    /// by the op only after `arrived` (Release/Acquire) says every piece landed.
    buf: Stage,
    claimed: Vec<AtomicBool>,
    arrived: AtomicUsize,
}

struct Shared {
    spec: ReduceSpec,
    digest: u32,
    len: usize,
    piece_len: usize,
    pieces: usize,
    /// By step number: what this peer receives at that step, if anything.
    incoming: BTreeMap<u32, Incoming>,
    failure: Mutex<Option<CoreError>>,
    advanced: Notify,
    rx: AtomicU64,
}

impl Shared {
    fn piece(&self, p: usize) -> std::ops::Range<usize> {
        let a = (p * self.piece_len).min(self.len);
        let b = ((p + 1) * self.piece_len).min(self.len);
        a..b
    }

    fn fail(&self, e: CoreError) -> CoreError {
        self.failure.lock().unwrap().get_or_insert(e.clone());
        self.advanced.notify_waiters();
        e
    }
}

/// The landing of the one step an op receives from one partner.
struct StepLanding {
    sh: Arc<Shared>,
    step: u32,
}

impl Landing for StepLanding {
    fn landing(&self, step: u32, piece: u32, len: u32, digest: u32) -> CoreResult<Dest> {
        let sh = &self.sh;
        let inc = &sh.incoming[&self.step];
        if digest != sh.digest {
            return Err(sh.fail(CoreError::InvalidUsage(format!(
                "peer {} runs a different collective as op {} (descriptor digest \
                 {digest:08x}, ours {:08x}): element count, dtype, reduce op, world, \
                 algorithm or piece size differ",
                inc.from, sh.spec.op_id, sh.digest
            ))));
        }
        let p = piece as usize;
        if step != self.step || p >= sh.pieces {
            return Err(CoreError::Protocol(format!(
                "piece {step}/{p} of mesh collective {} from peer {}: expected step {} of \
                 {} pieces",
                sh.spec.op_id, inc.from, self.step, sh.pieces
            )));
        }
        let range = sh.piece(p);
        if range.len() != len as usize {
            return Err(CoreError::Protocol(format!(
                "piece {step}/{p} of mesh collective {} has {len} bytes, expected {} (do \
                 all peers reduce the same tensor?)",
                sh.spec.op_id,
                range.len()
            )));
        }
        if inc.claimed[p].swap(true, Ordering::AcqRel) {
            return Err(CoreError::Protocol(format!(
                "piece {step}/{p} of mesh collective {} arrived twice",
                sh.spec.op_id
            )));
        }
        let dst = inc.buf.slot(range.start, range.len());
        Ok(Dest::Direct(dst.as_mut_ptr(), dst.len()))
    }

    fn land_part(&self, step: u32, piece: u32, _offset: usize, _data: &[u8]) -> CoreResult<()> {
        Err(CoreError::Protocol(format!(
            "piece {step}/{piece} of a mesh collective cannot arrive in parts"
        )))
    }

    fn landed(&self, _step: u32, piece: u32) -> CoreResult<()> {
        let sh = &self.sh;
        let bytes = sh.piece(piece as usize).len();
        sh.rx
            .fetch_add((HEADER_LEN + bytes) as u64, Ordering::Relaxed);
        sh.incoming[&self.step]
            .arrived
            .fetch_add(1, Ordering::AcqRel);
        sh.advanced.notify_waiters();
        Ok(())
    }
}

impl ReduceSpec {
    /// Digest of a mesh op's descriptor: as [`ReduceSpec::digest`], under another
    /// name, so that a ring op and a mesh op never accept each other's pieces.
    pub fn mesh_digest(&self, len: usize) -> u32 {
        let elem = self.dtype.size();
        let piece_elems = (self.piece_bytes / elem).max(1);
        let mut d = Vec::with_capacity(40);
        d.extend_from_slice(b"pccl-md1");
        d.extend_from_slice(&[self.dtype as u8, self.op as u8]);
        for v in [len / elem, self.world, piece_elems] {
            d.extend_from_slice(&(v as u64).to_le_bytes());
        }
        xxhash_rust::xxh3::xxh3_64(&d) as u32
    }
}

/// Poisons and finishes the op on every link if its future is dropped half-way (a
/// frame may be cut).
struct Guard<'a> {
    links: Vec<&'a Arc<RingLinks>>,
    op: u64,
    armed: bool,
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        for l in &self.links {
            if self.armed {
                l.poison(format!(
                    "mesh collective {} was abandoned mid-flight",
                    self.op
                ));
            }
            l.finish(self.op);
        }
    }
}

/// Runs the mesh all-reduce of `mem` (see the module docs). On success the result is
/// in `mem.result()`; on failure the caller's memory was not written. Until `armed` is
/// set, silence from a partner is no stall.
pub async fn mesh_all_reduce(
    mesh: Arc<Mesh>,
    spec: ReduceSpec,
    mem: Arc<OpMemory>,
    cancel: CancellationToken,
    armed: Arc<Armed>,
) -> CoreResult<ReduceStats> {
    // The op's rank is this peer's ring position; the mesh ranks its peers in an order
    // of its own (the master's mesh order), so only the worlds must agree.
    let (world, rank) = (spec.world, mesh.rank);
    if world < 2 || spec.rank >= world {
        return Err(CoreError::InvalidArgument(format!(
            "a mesh all-reduce needs rank < world and world >= 2 (rank {}, world {world})",
            spec.rank
        )));
    }
    if world != mesh.ring.len() {
        return Err(CoreError::InvalidUsage(format!(
            "the mesh of epoch {} has {} peers, the op {world}",
            mesh.epoch,
            mesh.ring.len()
        )));
    }
    let spec = ReduceSpec { rank, ..spec };
    if spec.quant.is_some() {
        return Err(CoreError::InvalidArgument(
            "the mesh all-reduce does not quantize".into(),
        ));
    }
    let len = mem.len();
    let elem = spec.dtype.size();
    if !len.is_multiple_of(elem) {
        return Err(CoreError::InvalidArgument(format!(
            "buffer of {len} bytes is not a whole number of {} elements",
            spec.dtype.name()
        )));
    }
    let piece_len = (spec.piece_bytes / elem).max(1) * elem;
    let steps = schedule(rank, world);
    let links: BTreeMap<usize, &Arc<RingLinks>> = mesh_partners(rank, world)
        .into_iter()
        .map(|r| mesh.link(r).map(|l| (r, l)))
        .collect::<CoreResult<_>>()?;
    if piece_len
        > links
            .values()
            .map(|l| l.max_piece())
            .min()
            .unwrap_or(usize::MAX)
    {
        return Err(CoreError::InvalidArgument(
            "piece larger than the link's limit".into(),
        ));
    }
    // From here on the op is finished on every link however it ends (its partners'
    // pieces are then dropped instead of stashed), and poisons them if abandoned.
    let op_id = spec.op_id;
    let mut guard = Guard {
        links: links.values().copied().collect(),
        op: op_id,
        armed: true,
    };
    if let Some(l) = links.values().find(|l| l.is_poisoned()) {
        guard.armed = false;
        return Err(l.poison_error());
    }
    let pieces = len.div_ceil(piece_len).max(1);
    let incoming = steps
        .iter()
        .filter_map(|s| {
            s.recv_from.map(|r| {
                let inc = Incoming {
                    from: mesh.ring[r],
                    buf: Stage::new(len),
                    claimed: (0..pieces).map(|_| AtomicBool::new(false)).collect(),
                    arrived: AtomicUsize::new(0),
                };
                (s.step, inc)
            })
        })
        .collect();
    let sh = Arc::new(Shared {
        digest: spec.mesh_digest(len),
        spec,
        len,
        piece_len,
        pieces,
        incoming,
        failure: Mutex::new(None),
        advanced: Notify::new(),
        rx: AtomicU64::new(0),
    });
    for s in &steps {
        if let Some(r) = s.recv_from {
            let landing = Arc::new(StepLanding {
                sh: sh.clone(),
                step: s.step,
            });
            if let Err(e) = links[&r].register(op_id, landing) {
                // (A stashed piece that does not fit poisoned that link already.)
                guard.armed = false;
                return Err(e);
            }
        }
    }
    let outcome = run_steps(&sh, &steps, &links, &mem, &cancel, &armed).await;
    guard.armed = false;
    drop(guard); // finishes the op on every link
    let tx = outcome.map_err(|e| sh.failure.lock().unwrap().clone().unwrap_or(e))?;
    Ok(ReduceStats {
        tx_bytes: tx,
        rx_bytes: sh.rx.load(Ordering::Relaxed),
    })
}

/// The steps of one op; returns the bytes sent. The result is written to `mem` only
/// when every step succeeded.
async fn run_steps(
    sh: &Shared,
    steps: &[Step],
    links: &BTreeMap<usize, &Arc<RingLinks>>,
    mem: &OpMemory,
    cancel: &CancellationToken,
    armed: &Armed,
) -> CoreResult<u64> {
    let (dtype, op) = (sh.spec.dtype, sh.spec.op);
    let mut acc = mem.input_all().to_vec();
    let mut tmp = Vec::new();
    let core = core_size(sh.spec.world);
    let last_round = core.trailing_zeros();
    let mut tx = 0u64;
    for s in steps {
        if let Some(r) = s.send_to {
            tx += send_all(sh, links[&r], s.step, &acc, cancel).await?;
        }
        if let Some(r) = s.recv_from {
            wait_step(sh, links[&r], s.step, cancel, armed).await?;
            let got = sh.incoming[&s.step].buf.slot(0, sh.len);
            match s.combine {
                Combine::OursFirst => reduce::reduce_inplace(dtype, op, &mut acc, got)?,
                Combine::TheirsFirst => {
                    tmp.resize(sh.len, 0);
                    reduce::reduce(dtype, op, &mut tmp, got, &acc)?;
                    std::mem::swap(&mut acc, &mut tmp);
                }
                Combine::Replace => acc.copy_from_slice(got),
            }
        }
        if s.step == last_round && sh.spec.rank < core {
            reduce::finalize(dtype, op, &mut acc, sh.spec.world)?;
        }
    }
    mem.write_result(&acc);
    Ok(tx)
}

/// Sends the pieces of `data` as step `step`, spread over the link's lanes.
async fn send_all(
    sh: &Shared,
    link: &RingLinks,
    step: u32,
    data: &[u8],
    cancel: &CancellationToken,
) -> CoreResult<u64> {
    let lanes = link.send_lanes().max(1);
    let lane_sends = (0..lanes).map(|lane| async move {
        let mut sent = 0u64;
        for p in (lane..sh.pieces).step_by(lanes) {
            let payload = &data[sh.piece(p)];
            let header = PieceHeader {
                op: sh.spec.op_id,
                step,
                piece: p as u32,
                len: payload.len() as u32,
                digest: sh.digest,
            };
            link.send_piece_or_abort(lane, header, payload, cancel)
                .await?;
            sent += (HEADER_LEN + payload.len()) as u64;
        }
        Ok::<_, CoreError>(sent)
    });
    let sent = futures::future::try_join_all(lane_sends).await?;
    Ok(sent.into_iter().sum())
}

/// Waits until every piece of `step` has landed. Once armed, fails when the partner
/// sends nothing for the link's I/O timeout.
async fn wait_step(
    sh: &Shared,
    link: &RingLinks,
    step: u32,
    cancel: &CancellationToken,
    armed: &Armed,
) -> CoreResult<()> {
    let inc = &sh.incoming[&step];
    let mut clock = StallClock::new(inc.arrived.load(Ordering::Acquire) as u64, armed.is_armed());
    loop {
        let notified = sh.advanced.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let arming = armed.notified();
        tokio::pin!(arming);
        arming.as_mut().enable();
        if let Some(e) = sh.failure.lock().unwrap().clone() {
            return Err(e);
        }
        let arrived = inc.arrived.load(Ordering::Acquire);
        let is_armed = armed.is_armed();
        let stall_at = clock.stall_at(arrived as u64, is_armed, link.io_timeout());
        if arrived == sh.pieces {
            return Ok(());
        }
        tokio::select! {
            _ = &mut notified => {}
            _ = &mut arming, if !is_armed => {}
            _ = cancel.cancelled() => return Err(link.aborted_error()),
            _ = link.poisoned().cancelled() => return Err(link.poison_error()),
            _ = tokio::time::sleep_until(stall_at), if is_armed => {
                return Err(link.stall(inc.from));
            }
        }
    }
}
