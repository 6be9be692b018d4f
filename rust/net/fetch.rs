//! The shared-state fetch engine: brings the tensors of a sync plan from their holders
//! (other peers serving them, see `transfer.rs`) into the caller's buffers, verified
//! against their content hashes as the bytes land. No pyo3 in here; `py/fetch.rs` is
//! the Python edge.
//!
//! Policy (one [`fetch_plan`] call does all of it):
//! * Large tensors (at least twice the range size) travel in ranges spread over their
//!   holders, fetched at once ([`fetch_ranges`]); a range whose holder fails goes on
//!   from the next holder after the whole hash leaves that already landed (their
//!   digests are computed from what landed; the content hash still covers every byte).
//! * Small tensors travel in batches ([`batches`]), one stream per batch with every
//!   request sent up front; a tensor of a batch that fails or does not verify is
//!   fetched again on its own, that holder last.
//! * A tensor whose bytes do not match its content hash is fetched whole from each of
//!   its holders in turn until one matches.
//! * At most [`MAX_FETCHES_IN_FLIGHT`] streams fetch at once; streams that finish a
//!   fetch cleanly are kept for the next fetch from the same holder.
//!
//! Every task the call starts has ended by the time it returns, cancelled or not, so
//! nothing writes into the buffers after that.

use crate::error::{CoreError, CoreResult};
use crate::hash::{root_of_digests, LeafHasher, LEAF_SIZE};
use crate::net::node::Node;
use crate::net::stream::P2PStream;
use crate::net::transfer::{self, Tally, Wanted};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// Tensors of at least twice this many bytes are fetched in ranges over several streams.
pub const RANGE_BYTES: u64 = 32 << 20;
/// Small tensors fetched over one stream with their requests pipelined, at most.
pub const BATCH_TENSORS: usize = 64;
/// Fetches (streams) one sync keeps in flight at once.
pub const MAX_FETCHES_IN_FLIGHT: usize = 16;

const LEAF: u64 = LEAF_SIZE as u64;

/// `(offset, length)` ranges of a tensor of `nbytes`, fetched at once (range `i` from
/// holder `i mod holders`): at least `streams` of them, rounded up to a multiple of the
/// holders so each serves as many, and no more than leaves each about `range_bytes` or
/// more; each starts on a hash leaf. One range for small tensors.
pub fn fetch_ranges(
    nbytes: u64,
    holders: usize,
    streams: usize,
    range_bytes: u64,
) -> Vec<(u64, u64)> {
    let holders = holders.max(1) as u64;
    let want = holders * (streams.max(1) as u64).div_ceil(holders);
    let parts = want.min(nbytes / range_bytes.max(1)).max(1);
    if parts == 1 {
        return vec![(0, nbytes)];
    }
    let per = nbytes.div_ceil(LEAF).div_ceil(parts) * LEAF;
    (0..nbytes.div_ceil(per))
        .map(|i| (i * per, per.min(nbytes - i * per)))
        .collect()
}

/// Groups small tensors, given by their first holder in plan order, into batches of
/// their indices: by first holder (the master spreads those), at most
/// [`BATCH_TENSORS`] each, and at least `streams` per holder while there are tensors
/// for them (several streams keep a per-connection cap from limiting the sync).
/// Tensor `i` of a holder's `count` batches goes to batch `i mod count`.
pub fn batches(first_holders: &[u64], streams: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<u64> = Vec::new();
    let mut by_holder: HashMap<u64, Vec<usize>> = HashMap::new();
    for (i, &h) in first_holders.iter().enumerate() {
        by_holder
            .entry(h)
            .or_insert_with(|| {
                order.push(h);
                Vec::new()
            })
            .push(i);
    }
    let mut out = Vec::new();
    for h in order {
        let ws = &by_holder[&h];
        let count = ws.len().div_ceil(BATCH_TENSORS).max(ws.len().min(streams));
        out.extend((0..count).map(|c| ws.iter().skip(c).step_by(count).copied().collect()));
    }
    out
}

/// Where one tensor's bytes land: memory of the caller's.
pub struct Landing {
    ptr: usize,
    len: usize,
}

impl Landing {
    /// # Safety
    /// `ptr..ptr + len` must stay valid, and be written by nobody else, until the
    /// [`fetch_plan`] call given it has returned; landings of one plan must not overlap.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Self {
        Landing {
            ptr: ptr as usize,
            len,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes `start..end`.
    ///
    /// # Safety
    /// Slices in use at the same time must not overlap (each range of a tensor is
    /// written by one task at a time).
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, start: u64, end: u64) -> &mut [u8] {
        debug_assert!(start <= end && end <= self.len as u64);
        std::slice::from_raw_parts_mut(
            (self.ptr + start as usize) as *mut u8,
            (end - start) as usize,
        )
    }
}

/// One tensor of the plan.
pub struct Entry {
    pub key: String,
    pub dst: Landing,
    /// The content hash the bytes must have (16 big-endian bytes).
    pub want: Vec<u8>,
    /// Its holders, in the order to try them.
    pub sources: Vec<u64>,
}

/// What the master planned for this peer to fetch, and how.
pub struct Plan {
    pub entries: Vec<Entry>,
    /// `"host:port"` of every holder.
    pub addrs: HashMap<u64, String>,
    /// Streams the large tensors get in all (at least one each), and per holder for the
    /// small ones: the p2p connection pool size.
    pub streams: usize,
    /// Bound on any silence of a holder.
    pub io_timeout: Duration,
    /// See [`RANGE_BYTES`] (the default).
    pub range_bytes: u64,
}

/// A running fetch's progress, readable at any time.
#[derive(Default)]
pub struct Progress {
    landed: AtomicU64,
    done: AtomicU64,
}

impl Progress {
    /// Bytes landed that are still part of the result: what a failed attempt landed is
    /// taken back when it is given up (beyond the whole hash leaves a failover keeps),
    /// so the count may go down; once the fetch succeeded it is the plan's total.
    pub fn rx_bytes(&self) -> u64 {
        self.landed.load(Ordering::Relaxed)
    }

    /// Tensors fetched and verified so far.
    pub fn tensors_done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    fn discard(&self, bytes: u64) {
        self.landed.fetch_sub(bytes, Ordering::Relaxed);
    }
}

/// The bytes one attempt landed, also counted in the fetch's progress.
struct Attempt<'a> {
    own: AtomicU64,
    progress: &'a Progress,
}

impl<'a> Attempt<'a> {
    fn new(progress: &'a Progress) -> Self {
        Attempt {
            own: AtomicU64::new(0),
            progress,
        }
    }

    fn get(&self) -> u64 {
        self.own.load(Ordering::Relaxed)
    }
}

impl Tally for Attempt<'_> {
    fn add(&self, bytes: u64) {
        self.own.fetch_add(bytes, Ordering::Relaxed);
        self.progress.landed.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// Fetches every tensor of `plan` into its landing; one result per entry, in order.
/// `cancel` stops every transfer (their tensors fail with `Aborted`); so does closing
/// `node`. Every task started has ended when this returns (dropping the future instead
/// aborts them, which takes effect a moment later: cancel and await it where the
/// landings are to be released).
pub async fn fetch_plan(
    node: Arc<Node>,
    plan: Plan,
    progress: Arc<Progress>,
    cancel: CancellationToken,
) -> Vec<CoreResult<()>> {
    let mut ctx = Ctx {
        node,
        addrs: HashMap::new(),
        io_timeout: plan.io_timeout,
        range_bytes: plan.range_bytes.max(1),
        limit: Semaphore::new(MAX_FETCHES_IN_FLIGHT),
        progress,
        cancel,
    };
    ctx.addrs = ctx.resolve_all(plan.addrs).await;
    let ctx = Arc::new(ctx);
    let entries: Vec<Arc<Entry>> = plan.entries.into_iter().map(Arc::new).collect();
    let pool = plan.streams.max(1);
    let large = |e: &Entry| e.dst.len() as u64 >= ctx.range_bytes.saturating_mul(2);
    let mut results: Vec<Option<CoreResult<()>>> = entries.iter().map(|_| None).collect();
    let mut jobs = JoinSet::new();
    let (mut big, mut small) = (Vec::new(), Vec::new());
    for (i, e) in entries.iter().enumerate() {
        if e.sources.is_empty() {
            results[i] = Some(Err(CoreError::PeerConnection(format!(
                "could not fetch shared state {:?}: nobody holds it",
                e.key
            ))));
        } else if large(e) {
            big.push(i);
        } else {
            small.push(i);
        }
    }
    // Large tensors are fetched in ranges over at least `pool` streams in all (one
    // tensor alone is not stuck with one stream; many do not each open that many).
    let per_big = pool.div_ceil(big.len().max(1));
    for &i in &big {
        let (ctx, e) = (ctx.clone(), entries[i].clone());
        jobs.spawn(async move {
            let sources = e.sources.clone();
            vec![(i, fetch_verified(&ctx, &e, sources, per_big).await)]
        });
    }
    let firsts: Vec<u64> = small.iter().map(|&i| entries[i].sources[0]).collect();
    for batch in batches(&firsts, pool) {
        let ctx = ctx.clone();
        let batch: Vec<(usize, Arc<Entry>)> = batch
            .into_iter()
            .map(|j| (small[j], entries[small[j]].clone()))
            .collect();
        jobs.spawn(async move { fetch_batch(&ctx, batch).await });
    }
    while let Some(done) = jobs.join_next().await {
        // A panicked job leaves its entries without a result (failed below).
        for (i, r) in done.into_iter().flatten() {
            results[i] = Some(r);
        }
    }
    results
        .into_iter()
        .zip(&entries)
        .map(|(r, e)| {
            r.unwrap_or_else(|| {
                Err(CoreError::PeerConnection(format!(
                    "fetching shared state {:?} failed unexpectedly",
                    e.key
                )))
            })
        })
        .collect()
}

/// What every task of one [`fetch_plan`] call shares.
struct Ctx {
    node: Arc<Node>,
    addrs: HashMap<u64, CoreResult<SocketAddr>>,
    io_timeout: Duration,
    range_bytes: u64,
    limit: Semaphore,
    progress: Arc<Progress>,
    cancel: CancellationToken,
}

impl Ctx {
    /// Resolves every holder's address (bounded by the I/O timeout; a holder whose
    /// address does not resolve fails when it is asked for something).
    async fn resolve_all(
        &self,
        addrs: HashMap<u64, String>,
    ) -> HashMap<u64, CoreResult<SocketAddr>> {
        let timeout = self.io_timeout;
        let lookups = addrs.into_iter().map(|(id, addr)| async move {
            let found = match tokio::time::timeout(timeout, tokio::net::lookup_host(&addr)).await {
                Err(_) => Err(CoreError::PeerConnection(format!(
                    "resolving {addr:?} timed out"
                ))),
                Ok(Err(e)) => Err(CoreError::InvalidArgument(format!(
                    "cannot resolve {addr:?}: {e}"
                ))),
                Ok(Ok(mut found)) => found.next().ok_or_else(|| {
                    CoreError::InvalidArgument(format!("{addr:?} resolves to no address"))
                }),
            };
            (id, found)
        });
        tokio::select! {
            biased;
            _ = self.stopped() => HashMap::new(),
            r = futures::future::join_all(lookups) => r.into_iter().collect(),
        }
    }

    /// Resolves once the fetch is cancelled or the node closes.
    async fn stopped(&self) {
        tokio::select! {
            _ = self.cancel.cancelled() => {}
            _ = self.node.cancel_token().cancelled() => {}
        }
    }

    fn is_stopped(&self) -> bool {
        self.cancel.is_cancelled() || self.node.cancel_token().is_cancelled()
    }

    fn addr(&self, peer: u64) -> CoreResult<SocketAddr> {
        match self.addrs.get(&peer) {
            Some(r) => r.clone(),
            None if self.is_stopped() => Err(self.aborted()),
            None => Err(CoreError::InvalidArgument(format!(
                "no address for peer {peer}"
            ))),
        }
    }

    fn aborted(&self) -> CoreError {
        CoreError::Aborted(if self.node.cancel_token().is_cancelled() {
            "the p2p node is closing".into()
        } else {
            "the shared-state fetch was aborted".into()
        })
    }

    /// `f` under a fetch slot, unless the fetch is cancelled first (`f` is dropped then:
    /// it writes nothing more).
    async fn slot<T>(&self, f: impl std::future::Future<Output = CoreResult<T>>) -> CoreResult<T> {
        tokio::select! {
            biased;
            _ = self.stopped() => Err(self.aborted()),
            r = async {
                let _permit = self.limit.acquire().await.expect("the semaphore is never closed");
                f.await
            } => r,
        }
    }

    /// Bytes `offset..offset + dst.len()` of `key` (`total` bytes) from `src`.
    async fn fetch_one(
        &self,
        src: u64,
        key: &str,
        offset: u64,
        total: u64,
        dst: &mut [u8],
        landed: &Attempt<'_>,
    ) -> CoreResult<Vec<u8>> {
        let addr = self.addr(src)?;
        self.slot(async {
            let mut s = TransferStream::open(&self.node, addr, src, true).await?;
            loop {
                let r = transfer::fetch(
                    &mut s.stream,
                    key,
                    offset,
                    total,
                    dst,
                    self.io_timeout,
                    landed,
                )
                .await;
                if !s.again(r.is_ok(), landed.get() != 0).await? {
                    s.finish(r.is_ok());
                    return r;
                }
            }
        })
        .await
    }

    /// The whole tensors `items` from `src` over one stream, pipelined.
    async fn fetch_many(
        &self,
        src: u64,
        items: &[(usize, Arc<Entry>)],
        landed: &Attempt<'_>,
    ) -> Vec<CoreResult<Vec<u8>>> {
        let run = async {
            let addr = self.addr(src)?;
            self.slot(async {
                // SAFETY: each of these tensors is written by this batch alone.
                let mut wanted: Vec<Wanted<'_>> = items
                    .iter()
                    .map(|(_, e)| Wanted {
                        key: &e.key,
                        dst: unsafe { e.dst.slice(0, e.dst.len() as u64) },
                    })
                    .collect();
                let mut s = TransferStream::open(&self.node, addr, src, true).await?;
                loop {
                    let (results, in_step) =
                        transfer::fetch_many(&mut s.stream, &mut wanted, self.io_timeout, landed)
                            .await;
                    if !s.again(in_step, landed.get() != 0).await? {
                        s.finish(in_step);
                        return Ok(results);
                    }
                }
            })
            .await
        };
        match run.await {
            Ok(results) => results,
            Err(e) => items.iter().map(|_| Err(e.clone())).collect(),
        }
    }

    fn fetched(&self, what: &str, nbytes: u64, started: Instant, sources: &[u64]) {
        let elapsed = started.elapsed().as_secs_f64().max(1e-9);
        log::info!(
            "peer {}: fetched shared state {what} ({:.1} MiB) from peer(s) {sources:?} in {:.2}s ({:.2} GB/s)",
            self.node.peer_id(),
            nbytes as f64 / (1 << 20) as f64,
            elapsed,
            nbytes as f64 / elapsed / 1e9
        );
    }
}

fn rotated(sources: &[u64], by: usize) -> Vec<u64> {
    let by = by % sources.len().max(1);
    sources[by..]
        .iter()
        .chain(&sources[..by])
        .copied()
        .collect()
}

fn matches(digests: &[u8], nbytes: u64, want: &[u8]) -> Result<(), Vec<u8>> {
    let got = root_of_digests(digests, nbytes as usize)
        .map_or_else(Vec::new, |h| h.to_be_bytes().to_vec());
    if got == want {
        Ok(())
    } else {
        Err(got)
    }
}

fn short_hex(hash: &[u8]) -> String {
    hash.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// `e` (its holders in `sources`' order) into its landing, verified: in ranges fetched
/// at once (at least one per holder, and `streams`), then, after a content mismatch,
/// whole from each holder in turn.
async fn fetch_verified(
    ctx: &Arc<Ctx>,
    e: &Arc<Entry>,
    sources: Vec<u64>,
    streams: usize,
) -> CoreResult<()> {
    let nbytes = e.dst.len() as u64;
    let started = Instant::now();
    let ranges = fetch_ranges(nbytes, sources.len(), streams, ctx.range_bytes);
    let mut parts: Vec<Option<RangeResult>> = ranges.iter().map(|_| None).collect();
    if ranges.len() == 1 {
        parts[0] = Some(fetch_range(ctx, e, 0, nbytes, sources.clone()).await);
    } else {
        let mut set = JoinSet::new();
        for (i, &(offset, length)) in ranges.iter().enumerate() {
            let (ctx, e, order) = (ctx.clone(), e.clone(), rotated(&sources, i));
            set.spawn(async move { (i, fetch_range(&ctx, &e, offset, length, order).await) });
        }
        // Every range runs to its end before anything is decided.
        while let Some(r) = set.join_next().await {
            if let Ok((i, r)) = r {
                parts[i] = Some(r);
            }
        }
    }
    let mut digests = Vec::new();
    let mut used = Vec::new();
    let mut first_error = None;
    let mut kept = 0;
    for p in parts {
        match p {
            Some((Ok((d, srcs)), k)) => {
                digests.extend(d);
                used.extend(srcs);
                kept += k;
            }
            Some((Err(err), k)) => {
                kept += k;
                first_error.get_or_insert(err);
            }
            None => {
                first_error.get_or_insert(CoreError::PeerConnection(format!(
                    "a range of shared state {:?} failed unexpectedly",
                    e.key
                )));
            }
        }
    }
    if let Some(err) = first_error {
        ctx.progress.discard(kept);
        return Err(err);
    }
    used.sort_unstable();
    used.dedup();
    let got = match matches(&digests, nbytes, &e.want) {
        Ok(()) => {
            ctx.progress.done.fetch_add(1, Ordering::Relaxed);
            ctx.fetched(&format!("{:?}", e.key), nbytes, started, &used);
            return Ok(());
        }
        Err(got) => got,
    };
    ctx.progress.discard(kept); // the whole-tensor attempts below count afresh
    let mut errors = vec![format!(
        "peers {used:?}: content hash mismatch (got {}..., expected {}...)",
        short_hex(&got),
        short_hex(&e.want)
    )];
    for &src in &sources {
        let started = Instant::now();
        let (r, kept) = fetch_range(ctx, e, 0, nbytes, vec![src]).await;
        match r {
            Err(err @ CoreError::Aborted(_)) => {
                ctx.progress.discard(kept);
                return Err(err);
            }
            Err(err) => {
                ctx.progress.discard(kept);
                errors.push(err.to_string());
            }
            Ok((digests, _)) => match matches(&digests, nbytes, &e.want) {
                Ok(()) => {
                    ctx.progress.done.fetch_add(1, Ordering::Relaxed);
                    ctx.fetched(&format!("{:?}", e.key), nbytes, started, &[src]);
                    return Ok(());
                }
                Err(got) => {
                    ctx.progress.discard(kept);
                    errors.push(format!(
                        "peer {src}: content hash mismatch (sent {}..., expected {}...)",
                        short_hex(&got),
                        short_hex(&e.want)
                    ));
                }
            },
        }
    }
    Err(CoreError::PeerConnection(format!(
        "could not fetch shared state {:?} from any source: {}",
        e.key,
        errors.join("; ")
    )))
}

/// A range's leaf digests and the holders that delivered parts of it, and the bytes of
/// it still counted in the progress (all of it on success).
type RangeResult = (CoreResult<(Vec<u8>, Vec<u64>)>, u64);

/// Bytes `offset..offset + length` of `e` from the holders in `order`: when one fails,
/// the next continues after the whole hash leaves that already landed.
async fn fetch_range(
    ctx: &Ctx,
    e: &Entry,
    offset: u64,
    length: u64,
    order: Vec<u64>,
) -> RangeResult {
    let total = e.dst.len() as u64;
    let mut errors = Vec::new();
    // Bytes of whole leaves landed so far, their digests, and who sent them.
    let (mut done, mut head, mut used) = (0u64, Vec::new(), Vec::new());
    for src in order {
        let start = offset + done;
        let landed = Attempt::new(&ctx.progress);
        // SAFETY: this range of the tensor is written by this task alone.
        let dst = unsafe { e.dst.slice(start, offset + length) };
        match ctx.fetch_one(src, &e.key, start, total, dst, &landed).await {
            Ok(digests) => {
                head.extend(digests);
                used.push(src);
                return (Ok((head, used)), length);
            }
            Err(err @ CoreError::Aborted(_)) => {
                ctx.progress.discard(landed.get());
                return (Err(err), done);
            }
            Err(err) => {
                errors.push(format!("peer {src}: {err}"));
                let got = landed.get().min(offset + length - start);
                let whole = if got == offset + length - start {
                    got
                } else {
                    got / LEAF * LEAF
                };
                ctx.progress.discard(landed.get() - whole);
                if whole > 0 {
                    let mut h = LeafHasher::starting_at((start / LEAF) as usize);
                    // SAFETY: as above; the failed attempt has ended.
                    h.update(unsafe { e.dst.slice(start, start + whole) });
                    head.extend(h.into_digests());
                    done += whole;
                    used.push(src);
                    if done == length {
                        return (Ok((head, used)), length);
                    }
                }
            }
        }
    }
    let err = CoreError::PeerConnection(format!(
        "could not fetch bytes {offset}..{} of shared state {:?}: {}",
        offset + length,
        e.key,
        errors.join("; ")
    ));
    (Err(err), done)
}

/// The small tensors of `batch` from their first holder over one stream (every request
/// sent up front); those that fail or do not verify are fetched again one by one, that
/// holder last.
async fn fetch_batch(
    ctx: &Arc<Ctx>,
    batch: Vec<(usize, Arc<Entry>)>,
) -> Vec<(usize, CoreResult<()>)> {
    let src = batch[0].1.sources[0];
    let started = Instant::now();
    let landed = Attempt::new(&ctx.progress);
    let results = ctx.fetch_many(src, &batch, &landed).await;
    let (mut out, mut retry, mut ok_bytes, mut ok) = (Vec::new(), Vec::new(), 0, 0);
    for ((i, e), r) in batch.into_iter().zip(results) {
        let nbytes = e.dst.len() as u64;
        let why = match r {
            Ok(digests) => match matches(&digests, nbytes, &e.want) {
                Ok(()) => {
                    ok_bytes += nbytes;
                    ok += 1;
                    ctx.progress.done.fetch_add(1, Ordering::Relaxed);
                    out.push((i, Ok(())));
                    continue;
                }
                Err(_) => "content hash mismatch".to_string(),
            },
            Err(err @ CoreError::Aborted(_)) => {
                out.push((i, Err(err)));
                continue;
            }
            Err(err) => err.to_string(),
        };
        log::info!(
            "peer {}: shared state {:?} from peer {src}: {why}; fetching it alone",
            ctx.node.peer_id(),
            e.key
        );
        retry.push((i, e));
    }
    ctx.progress.discard(landed.get() - ok_bytes); // the retries count afresh
    if ok_bytes > 0 {
        ctx.fetched(&format!("({ok} tensors)"), ok_bytes, started, &[src]);
    }
    let mut set = JoinSet::new();
    for (i, e) in retry {
        let ctx = ctx.clone();
        set.spawn(async move {
            let order = rotated(&e.sources, 1);
            (i, fetch_verified(&ctx, &e, order, 1).await)
        });
    }
    while let Some(r) = set.join_next().await {
        // (A panicked retry leaves its entry without a result: failed by the caller.)
        out.extend(r.ok());
    }
    out
}

/// The transfer stream of one fetch, and what becomes of it: with `reuse`, one kept
/// from an earlier fetch from the same holder if there is one, and kept again if the
/// fetch leaves it in step (between requests).
pub struct TransferStream {
    node: Arc<Node>,
    sock: SocketAddr,
    peer_id: u64,
    reuse: bool,
    reused: bool,
    pub stream: P2PStream,
}

impl TransferStream {
    pub async fn open(
        node: &Arc<Node>,
        sock: SocketAddr,
        peer_id: u64,
        reuse: bool,
    ) -> CoreResult<Self> {
        let (stream, reused) = if reuse {
            node.take_transfer(sock, peer_id).await?
        } else {
            (node.dial_transfer(sock, peer_id).await?, false)
        };
        Ok(Self {
            node: node.clone(),
            sock,
            peer_id,
            reuse,
            reused,
            stream,
        })
    }

    /// After an attempt that left the stream `in_step` or not (and `landed` bytes or
    /// none): whether to try again on a freshly dialed stream. Once only, and only when
    /// a kept stream failed before a byte landed (the holder may have closed it while
    /// it sat idle).
    pub async fn again(&mut self, in_step: bool, landed: bool) -> CoreResult<bool> {
        if in_step || !self.reused || landed {
            return Ok(false);
        }
        self.stream = self.node.dial_transfer(self.sock, self.peer_id).await?;
        self.reused = false;
        Ok(true)
    }

    /// Keeps the stream for the next fetch if asked to and it is `in_step`.
    pub fn finish(self, in_step: bool) {
        if self.reuse && in_step {
            self.node.put_transfer(self.sock, self.peer_id, self.stream);
        } else if in_step {
            // The holder takes an end without the authenticated one for a cut.
            self.node.close_streams(vec![self.stream]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::content_hash;
    use crate::net::node::NodeConfig;
    use crate::net::transfer::Served;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    const MIB: u64 = 1 << 20;

    #[test]
    fn ranges_cover_the_tensor_on_hash_leaves() {
        let r = RANGE_BYTES;
        assert_eq!(fetch_ranges(0, 3, 1, r), vec![(0, 0)]);
        assert_eq!(fetch_ranges(2 * r - 1, 3, 1, r), vec![(0, 2 * r - 1)]);
        for nbytes in [2 * r, 3 * r + 12345, (256 << 20) + 7, 1 << 30] {
            for holders in [1usize, 2, 3, 5] {
                for streams in [1usize, 4] {
                    let rs = fetch_ranges(nbytes, holders, streams, r);
                    // As many as the holders and streams ask for, rounded up to a
                    // multiple of the holders, as long as ranges stay about `r` or more.
                    let h = holders as u64;
                    let want = (nbytes / r).min(h * (streams as u64).div_ceil(h));
                    assert_eq!(rs.len() as u64, want, "{nbytes} {holders} {streams}");
                    let mut at = 0;
                    for &(offset, len) in &rs {
                        assert_eq!(offset, at);
                        assert_eq!(offset % LEAF, 0);
                        assert!(len >= r - want * LEAF);
                        at += len;
                    }
                    assert_eq!(at, nbytes);
                }
            }
        }
        assert_eq!(fetch_ranges(1 << 30, 3, 4, r).len(), 6); // two per holder
        assert_eq!(fetch_ranges(1 << 30, 1, 4, r).len(), 4);
        assert_eq!(fetch_ranges(16 * MIB, 1, 4, 4 * MIB).len(), 4);
    }

    #[test]
    fn small_tensors_are_batched_by_first_holder() {
        let mut firsts = vec![7u64; 130];
        firsts.extend([9, 9, 9]);
        firsts.swap(1, 131); // holders interleave in plan order
        let bs = batches(&firsts, 2);
        // Holder 7: 130 tensors need 3 batches of at most 64; holder 9: 3 tensors over
        // its 2 streams. Holders in the order they first appear.
        assert_eq!(
            bs.iter().map(Vec::len).collect::<Vec<_>>(),
            [44, 43, 43, 2, 1]
        );
        assert!(bs[..3].iter().flatten().all(|&i| firsts[i] == 7));
        assert!(bs[3..].iter().flatten().all(|&i| firsts[i] == 9));
        assert_eq!(bs[3], [1, 132]);
        assert_eq!(bs[0][..3], [0, 4, 7]); // tensor i of a holder into batch i mod count
        let mut all: Vec<usize> = bs.into_iter().flatten().collect();
        all.sort_unstable();
        assert_eq!(all, (0..133).collect::<Vec<_>>());
        assert_eq!(batches(&[1, 1, 1], 8), [[0], [1], [2]]);
        assert!(batches(&[], 4).is_empty());
    }

    fn cfg(id: u64) -> NodeConfig {
        NodeConfig {
            peer_id: id,
            secret: Some(b"k".to_vec()),
            identity: crate::net::identity::Identity::ephemeral(),
            handshake_timeout: Duration::from_millis(700),
            connect_timeout: Duration::from_secs(2),
            insecure: false,
        }
    }

    async fn node(id: u64) -> Arc<Node> {
        crate::testutil::known_node(cfg(id), "127.0.0.1:0".parse().unwrap())
            .await
            .unwrap()
    }

    fn serve_vec(node: &Node, key: &str, data: Vec<u8>) {
        let (ptr, len) = (data.as_ptr(), data.len());
        // SAFETY: the Vec's buffer lives in the keep-alive box, unmodified.
        let served = unsafe { Served::new(ptr, len, Box::new(data)) };
        node.transfers.serve(key.into(), served);
    }

    fn pattern(n: u64, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31) ^ (i >> 13) as u8 ^ seed)
            .collect()
    }

    /// Landing buffers (zeroed) for tensors of these sizes, and the plan entries into
    /// them (`good[i]` is what entry `i` must hold, `sources[i]` its holders).
    fn entries(good: &[(&str, &Vec<u8>)], sources: &[Vec<u64>]) -> (Vec<Vec<u8>>, Vec<Entry>) {
        let mut bufs: Vec<Vec<u8>> = good.iter().map(|(_, d)| vec![0u8; d.len()]).collect();
        let entries = good
            .iter()
            .zip(&mut bufs)
            .zip(sources)
            .map(|(((key, data), buf), sources)| Entry {
                key: key.to_string(),
                // SAFETY: the test reads the buffers only after the fetch returned.
                dst: unsafe { Landing::new(buf.as_mut_ptr(), buf.len()) },
                want: content_hash(data).to_be_bytes().to_vec(),
                sources: sources.clone(),
            })
            .collect();
        (bufs, entries)
    }

    fn plan(
        entries: Vec<Entry>,
        addrs: &[(u64, SocketAddr)],
        streams: usize,
        range_bytes: u64,
    ) -> Plan {
        Plan {
            entries,
            addrs: addrs.iter().map(|(id, a)| (*id, a.to_string())).collect(),
            streams,
            io_timeout: Duration::from_secs(2),
            range_bytes,
        }
    }

    /// A TCP proxy to `target` that forwards what the holder sends, `cut_after` bytes
    /// of it per connection at most (then it cuts the connection), a 64 KiB chunk every
    /// `pace` (a slow link).
    async fn proxy(target: SocketAddr, cut_after: u64, pace: Duration) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(target).await else {
                        return;
                    };
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let up = tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut cr, &mut sw).await;
                    });
                    let mut buf = vec![0u8; 64 << 10];
                    let mut sent = 0u64;
                    while sent < cut_after {
                        let n = buf.len().min((cut_after - sent) as usize);
                        let n = match sr.read(&mut buf[..n]).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if cw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                        sent += n as u64;
                        tokio::time::sleep(pace).await;
                    }
                    up.abort();
                });
            }
        });
        addr
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_plan_across_two_holders() {
        let (a, b, c) = (node(1).await, node(2).await, node(3).await);
        let mut good = vec![("big".to_string(), pattern(9 * MIB + 12345, 1))];
        good.extend((0..20).map(|i| (format!("s{i}"), pattern(1000 + 37 * i, i as u8))));
        good.push(("empty".into(), Vec::new()));
        for (k, d) in &good {
            serve_vec(&b, k, d.clone());
            serve_vec(&c, k, d.clone());
        }
        let sources: Vec<Vec<u64>> = (0..good.len())
            .map(|i| if i % 2 == 0 { vec![2, 3] } else { vec![3, 2] })
            .collect();
        let named: Vec<(&str, &Vec<u8>)> = good.iter().map(|(k, d)| (k.as_str(), d)).collect();
        let (bufs, entries) = entries(&named, &sources);
        let addrs = [(2, b.local_addr()), (3, c.local_addr())];
        let progress = Arc::new(Progress::default());
        let results = fetch_plan(
            a.clone(),
            plan(entries, &addrs, 2, 2 * MIB),
            progress.clone(),
            CancellationToken::new(),
        )
        .await;
        assert!(results.iter().all(Result::is_ok), "{results:?}");
        assert!(bufs.iter().zip(&good).all(|(buf, (_, d))| buf == d));
        let total: u64 = good.iter().map(|(_, d)| d.len() as u64).sum();
        assert_eq!(progress.rx_bytes(), total);
        assert_eq!(progress.tensors_done(), good.len() as u64);
        // Both holders served (the large tensor in one range each), nothing twice.
        let (sb, sc) = (b.transfers.bytes_sent(), c.transfers.bytes_sent());
        assert!(sb > 4 * MIB && sc > 4 * MIB, "{sb} {sc}");
        assert_eq!(sb + sc, total);
        for n in [a, b, c] {
            n.close().await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_holder_lost_mid_range_is_continued_after_the_landed_leaves() {
        let (a, b, c) = (node(1).await, node(2).await, node(3).await);
        let n = 12 * MIB + 777;
        let data = pattern(n, 5);
        serve_vec(&b, "w", data.clone());
        serve_vec(&c, "w", data.clone());
        // Peer 2's link is cut after 5.5 MiB (the handshake and reply header included).
        let cut = proxy(b.local_addr(), 5 * MIB + MIB / 2, Duration::ZERO).await;
        let (bufs, entries) = entries(&[("w", &data)], &[vec![2, 3]]);
        let progress = Arc::new(Progress::default());
        let results = fetch_plan(
            a.clone(),
            // Two ranges: 7 MiB from peer 2, the rest from peer 3.
            plan(entries, &[(2, cut), (3, c.local_addr())], 1, 6 * MIB),
            progress.clone(),
            CancellationToken::new(),
        )
        .await;
        assert!(results[0].is_ok(), "{results:?}");
        assert!(bufs[0] == data);
        assert_eq!((progress.rx_bytes(), progress.tensors_done()), (n, 1));
        // The 5 whole leaves that landed from peer 2 were kept; peer 3 sent the rest.
        assert_eq!(
            c.transfers.bytes_sent(),
            n - 5 * MIB,
            "peer 2 sent {}",
            b.transfers.bytes_sent()
        );
        for n in [a, b, c] {
            n.close().await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bytes_that_do_not_match_are_fetched_again_from_the_other_holder() {
        let (a, b, c) = (node(1).await, node(2).await, node(3).await);
        let big = pattern(6 * MIB + 3, 7);
        let small = pattern(5000, 8);
        let mut lies = (big.clone(), small.clone());
        lies.0[100] ^= 1; // in the first range
        lies.0[6 * MIB as usize] ^= 1; // in the second
        lies.1[0] ^= 1;
        serve_vec(&b, "big", lies.0);
        serve_vec(&b, "small", lies.1);
        serve_vec(&c, "big", big.clone());
        serve_vec(&c, "small", small.clone());
        let (bufs, entries) = entries(
            &[("big", &big), ("small", &small)],
            &[vec![2, 3], vec![2, 3]],
        );
        let progress = Arc::new(Progress::default());
        let results = fetch_plan(
            a.clone(),
            plan(entries, &[(2, b.local_addr()), (3, c.local_addr())], 2, MIB),
            progress.clone(),
            CancellationToken::new(),
        )
        .await;
        assert!(results.iter().all(Result::is_ok), "{results:?}");
        assert!(bufs[0] == big && bufs[1] == small);
        let total = big.len() as u64 + small.len() as u64;
        assert_eq!((progress.rx_bytes(), progress.tensors_done()), (total, 2));
        // Ranges from both, then the whole tensor from the liar and from peer 3; the
        // small one from the liar, then from peer 3.
        assert_eq!(b.transfers.bytes_sent(), 4 * MIB + big.len() as u64 + 5000);
        assert_eq!(
            c.transfers.bytes_sent(),
            2 * MIB + 3 + big.len() as u64 + 5000
        );
        for n in [a, b, c] {
            n.close().await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn when_every_holder_fails_the_error_names_the_key_and_every_holder() {
        let a = node(1).await;
        let gone = node(2).await; // closed: its port refuses connections
        let gone_addr = gone.local_addr();
        gone.close().await;
        drop(gone);
        // Accepts connections and never answers (the handshake times out).
        let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let silent_addr = silent.local_addr().unwrap();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = silent.accept().await {
                held.push(s);
            }
        });
        let other = node(4).await; // serves something else
        serve_vec(&other, "x", vec![1; 10]);
        let liar = node(5).await;
        let (big, small) = (pattern(4 * MIB, 1), pattern(3000, 2));
        serve_vec(&liar, "big", pattern(4 * MIB, 9));
        serve_vec(&liar, "small", pattern(3000, 9));
        let all = vec![2, 3, 4, 5];
        let (_bufs, entries) = entries(&[("big", &big), ("small", &small)], &[all.clone(), all]);
        let addrs = [
            (2, gone_addr),
            (3, silent_addr),
            (4, other.local_addr()),
            (5, liar.local_addr()),
        ];
        let progress = Arc::new(Progress::default());
        let started = Instant::now();
        let results = tokio::time::timeout(
            Duration::from_secs(20),
            fetch_plan(
                a.clone(),
                plan(entries, &addrs, 1, MIB),
                progress.clone(),
                CancellationToken::new(),
            ),
        )
        .await
        .expect("a failing fetch ends in bounded time");
        for (r, key) in results.iter().zip(["\"big\"", "\"small\""]) {
            let Err(CoreError::PeerConnection(msg)) = r else {
                panic!("{r:?}");
            };
            assert!(
                msg.contains(&format!(
                    "could not fetch shared state {key} from any source"
                )),
                "{msg}"
            );
            for peer in [
                "peer 2: ",
                "peer 3: ",
                "peer 4: ",
                "peer 5: content hash mismatch",
            ] {
                assert!(msg.contains(peer), "{peer} not in {msg}");
            }
        }
        assert!(started.elapsed() < Duration::from_secs(10));
        assert_eq!((progress.rx_bytes(), progress.tensors_done()), (0, 0));
        for n in [a, other, liar] {
            n.close().await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_aborted_fetch_stops_every_transfer_before_it_returns() {
        let (a, b) = (node(1).await, node(2).await);
        let data = pattern(8 * MIB, 3);
        serve_vec(&b, "w", data.clone());
        serve_vec(&b, "v", data.clone());
        // About 13 MB/s: the fetch is far from done when it is aborted.
        let slow = proxy(b.local_addr(), u64::MAX, Duration::from_millis(5)).await;
        let (bufs, entries) = entries(&[("w", &data), ("v", &data)], &[vec![2], vec![2]]);
        let progress = Arc::new(Progress::default());
        let cancel = CancellationToken::new();
        let run = tokio::spawn(fetch_plan(
            a.clone(),
            plan(entries, &[(2, slow)], 4, MIB),
            progress.clone(),
            cancel.clone(),
        ));
        while progress.rx_bytes() < MIB {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        cancel.cancel();
        let results = tokio::time::timeout(Duration::from_secs(2), run)
            .await
            .expect("an aborted fetch returns at once")
            .unwrap();
        assert!(results
            .iter()
            .all(|r| matches!(r, Err(CoreError::Aborted(m)) if m.contains("aborted"))));
        assert_eq!(progress.rx_bytes(), 0);
        // Nothing lands any more.
        let before = bufs.clone();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(bufs == before);
        a.close().await;
        b.close().await;
    }
}
