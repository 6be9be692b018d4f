//! `RingLinks`: the streams of one ring epoch, to the next peer (sending lanes) and
//! from the previous peer (receiving lanes).
//!
//! Many collectives share the lanes. Every piece travels as one frame with a fixed
//! header; a reader task per receiving lane looks up the op the piece belongs to and
//! reads the payload straight into that op's memory, so collectives never see each
//! other's bytes and no piece is copied twice. Any I/O error, timeout in
//! the middle of a frame, or malformed header *poisons* the links: the byte stream can
//! no longer be trusted, so every current and later collective on them fails until
//! `update_topology()` builds new ones.
//!
//! A peer may start a collective before this one did (optimistic start): pieces of an
//! op that is neither registered nor finished are read into owned buffers and stashed
//! (up to a byte bound), so the lane keeps serving other ops; `register` lands them, in
//! arrival order, before any later piece of the op. Past the bound a lane waits (up to
//! the I/O timeout) for the op to be registered, as without a stash. Every header
//! carries the digest of the op's descriptor, which the op checks before a byte lands.

use crate::error::{CoreError, CoreResult};
use crate::net::stream::{P2PReadHalf, P2PStream, P2PWriteHalf};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How the links of a ring are built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkConfig {
    /// How long to wait for the previous peer's pool to be complete.
    pub pool_timeout: Duration,
    /// Bound on any send, and on silence from the previous peer during an op.
    pub io_timeout: Duration,
    /// Largest piece a receiving lane accepts, in bytes.
    pub max_piece: usize,
}

pub const HEADER_LEN: usize = 28;
const FRAME_MAGIC: u32 = 0x5043_434C; // "PCCL"
/// Remember this many finished ops so that their stragglers are dropped, not queued.
const MAX_FINISHED: usize = 65536;
/// Default bound on the payload bytes held for ops not registered here yet.
pub const STASH_BYTES: usize = 64 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PieceHeader {
    pub op: u64,
    pub step: u32,
    pub piece: u32,
    pub len: u32,
    /// Digest of the sender's descriptor of the op (`ReduceSpec::digest`).
    pub digest: u32,
}

impl PieceHeader {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..4].copy_from_slice(&FRAME_MAGIC.to_be_bytes());
        h[4..12].copy_from_slice(&self.op.to_be_bytes());
        h[12..16].copy_from_slice(&self.step.to_be_bytes());
        h[16..20].copy_from_slice(&self.piece.to_be_bytes());
        h[20..24].copy_from_slice(&self.len.to_be_bytes());
        h[24..28].copy_from_slice(&self.digest.to_be_bytes());
        h
    }

    pub fn decode(h: &[u8; HEADER_LEN]) -> Option<Self> {
        let u32_at = |i: usize| u32::from_be_bytes(h[i..i + 4].try_into().unwrap());
        if u32_at(0) != FRAME_MAGIC {
            return None;
        }
        Some(PieceHeader {
            op: u64::from_be_bytes(h[4..12].try_into().unwrap()),
            step: u32_at(12),
            piece: u32_at(16),
            len: u32_at(20),
            digest: u32_at(24),
        })
    }

    /// What a receiving lane does with the header bytes the previous peer sent: decode
    /// them and refuse a piece larger than `max_piece` before anything is read.
    pub fn parse(h: &[u8; HEADER_LEN], max_piece: usize) -> CoreResult<Self> {
        let header = PieceHeader::decode(h).ok_or_else(|| {
            CoreError::Protocol("garbage on a ring link (bad frame magic)".into())
        })?;
        if header.len as usize > max_piece {
            return Err(CoreError::Protocol(format!(
                "piece of {} bytes exceeds the limit of {max_piece}",
                header.len
            )));
        }
        Ok(header)
    }
}

/// Where a piece's payload goes (see [`Landing::landing`]).
#[derive(Debug)]
pub enum Dest {
    /// Straight into these bytes (no intermediate copy); valid while the op lives.
    Direct(*mut u8, usize),
    /// In parts of the order of [`STREAM_BLOCK`] bytes, in order, through
    /// [`Landing::land_part`]: the op folds each part into its memory while it is still
    /// in cache (receive and reduce in one pass).
    Streamed,
}

/// The scale of the parts of a [`Dest::Streamed`] piece (about one encrypted record):
/// small enough to stay in cache between the read and the reduce.
pub const STREAM_BLOCK: usize = 64 << 10;

/// Where an op wants the pieces addressed to it. The reader task of each receiving
/// lane writes a piece's payload where `landing` says (the op's memory, or block by
/// block through `land_part`) and then calls `landed`, which does the op's per-piece
/// work.
pub trait Landing: Send + Sync {
    /// Destination of piece `(step, piece)` of `len` bytes sent under descriptor
    /// `digest`; an error if the op did not expect exactly that piece now (or runs
    /// another descriptor).
    fn landing(&self, step: u32, piece: u32, len: u32, digest: u32) -> CoreResult<Dest>;
    /// Bytes `offset..offset + data.len()` of a [`Dest::Streamed`] piece (parts come in
    /// order and cover the piece; each but the last is a whole number of 8-byte words,
    /// at most twice [`STREAM_BLOCK`]).
    fn land_part(&self, step: u32, piece: u32, offset: usize, data: &[u8]) -> CoreResult<()>;
    /// The payload of `(step, piece)` has been written.
    fn landed(&self, step: u32, piece: u32) -> CoreResult<()>;
}

/// A piece that arrived before its op was registered here.
struct Stashed {
    header: PieceHeader,
    payload: Vec<u8>,
}

struct Registry {
    open: HashMap<u64, Arc<dyn Landing>>,
    finished: HashSet<u64>,
    finished_order: VecDeque<u64>,
    /// Early pieces per op, in arrival order.
    stash: HashMap<u64, VecDeque<Stashed>>,
    /// Payload bytes stashed, plus those being read into a stash buffer now.
    stashed_bytes: usize,
    stash_limit: usize,
}

/// What a lane does with the piece whose header it just read.
enum Route {
    Land(Arc<dyn Landing>),
    /// The op ended here (or the links are unusable): read and drop.
    Drop,
    /// Read into an owned buffer (its bytes are reserved in the stash already).
    Stash,
    /// The stash is full: wait (bounded) for the op to be registered.
    Wait,
}

/// Lands a stashed piece in `target`: the same checks as a piece off the wire.
fn land_stashed(target: &dyn Landing, s: &Stashed) -> CoreResult<()> {
    let h = &s.header;
    match target.landing(h.step, h.piece, h.len, h.digest)? {
        Dest::Direct(ptr, len) => {
            if len != s.payload.len() {
                return Err(CoreError::Protocol(format!(
                    "piece {}/{} of collective {} has {} bytes, its slot {len}",
                    h.step,
                    h.piece,
                    h.op,
                    s.payload.len()
                )));
            }
            // SAFETY: the target hands this range to us alone until `landed` is called.
            unsafe { std::ptr::copy_nonoverlapping(s.payload.as_ptr(), ptr, len) };
        }
        Dest::Streamed => {
            for (i, block) in s.payload.chunks(STREAM_BLOCK).enumerate() {
                target.land_part(h.step, h.piece, i * STREAM_BLOCK, block)?;
            }
        }
    }
    target.landed(h.step, h.piece)
}

pub struct RingLinks {
    pub epoch: u64,
    pub next: u64,
    pub prev: u64,
    /// `None` once closed: the sockets go with `close()`, even while an op that used
    /// these links is still referenced from Python.
    writers: Vec<tokio::sync::Mutex<Option<P2PWriteHalf>>>,
    recv_lanes: usize,
    max_piece: usize,
    io_timeout: Duration,
    registry: Mutex<Registry>,
    registered: tokio::sync::Notify,
    poisoned: CancellationToken,
    poison_reason: Mutex<Option<String>>,
    cancel: CancellationToken,
    tracker: TaskTracker,
    /// Unused read halves of the sending streams, kept so the sockets stay whole.
    send_read_halves: Mutex<Vec<P2PReadHalf>>,
}

impl RingLinks {
    /// Takes ownership of the streams and starts one reader task per receiving lane.
    pub fn new(
        epoch: u64,
        next: u64,
        prev: u64,
        to_next: Vec<P2PStream>,
        from_prev: Vec<P2PStream>,
        max_piece: usize,
        io_timeout: Duration,
    ) -> Arc<RingLinks> {
        let mut writers = Vec::with_capacity(to_next.len());
        let mut send_reads = Vec::with_capacity(to_next.len());
        for s in to_next {
            let (r, w) = s.into_split();
            send_reads.push(r);
            writers.push(tokio::sync::Mutex::new(Some(w)));
        }
        let links = Arc::new(RingLinks {
            epoch,
            next,
            prev,
            writers,
            recv_lanes: from_prev.len(),
            max_piece,
            io_timeout,
            registry: Mutex::new(Registry {
                open: HashMap::new(),
                finished: HashSet::new(),
                finished_order: VecDeque::new(),
                stash: HashMap::new(),
                stashed_bytes: 0,
                stash_limit: STASH_BYTES,
            }),
            registered: tokio::sync::Notify::new(),
            poisoned: CancellationToken::new(),
            poison_reason: Mutex::new(None),
            cancel: CancellationToken::new(),
            tracker: TaskTracker::new(),
            send_read_halves: Mutex::new(send_reads),
        });
        for (lane, stream) in from_prev.into_iter().enumerate() {
            let weak = Arc::downgrade(&links);
            let cancel = links.cancel.clone();
            links.tracker.spawn(async move {
                let (mut read, _write) = stream.into_split();
                let result = tokio::select! {
                    _ = cancel.cancelled() => Ok(()),
                    r = read_lane(&weak, &mut read, lane as u16) => r,
                };
                if let (Err(e), Some(links)) = (result, weak.upgrade()) {
                    links.poison(format!("link from peer {} failed: {e}", links.prev));
                }
            });
        }
        links
    }

    pub fn send_lanes(&self) -> usize {
        self.writers.len()
    }

    pub fn recv_lanes(&self) -> usize {
        self.recv_lanes
    }

    pub fn io_timeout(&self) -> Duration {
        self.io_timeout
    }

    pub fn max_piece(&self) -> usize {
        self.max_piece
    }

    /// Bounds the bytes stashed for ops not registered here yet (default `STASH_BYTES`).
    pub fn set_stash_limit(&self, bytes: usize) {
        self.registry.lock().unwrap().stash_limit = bytes;
    }

    /// Payload bytes held (or being read) for ops not registered here yet.
    pub fn stashed_bytes(&self) -> usize {
        self.registry.lock().unwrap().stashed_bytes
    }

    /// Marks the links unusable (first reason wins), frees the stash and wakes
    /// everything waiting on them.
    pub fn poison(&self, reason: String) {
        {
            let mut r = self.poison_reason.lock().unwrap();
            if r.is_none() {
                *r = Some(reason);
            }
        }
        self.poisoned.cancel();
        let mut reg = self.registry.lock().unwrap();
        let freed: usize = reg.stash.values().flatten().map(|s| s.payload.len()).sum();
        reg.stash.clear();
        reg.stashed_bytes -= freed;
    }

    pub fn poison_error(&self) -> CoreError {
        let reason = self.poison_reason.lock().unwrap().clone();
        CoreError::PeerConnection(reason.unwrap_or_else(|| "ring links are closed".into()))
    }

    pub fn is_poisoned(&self) -> bool {
        self.poisoned.is_cancelled()
    }

    pub fn poisoned(&self) -> &CancellationToken {
        &self.poisoned
    }

    /// Makes `op` receivable: its stashed pieces land in `target` now (in arrival
    /// order, under the registry lock, so before any later piece of it), and the
    /// pieces that follow land there as they come. A stashed piece that `target`
    /// refuses poisons the links and fails the registration with its error.
    pub fn register(&self, op: u64, target: Arc<dyn Landing>) -> CoreResult<()> {
        let mut reg = self.registry.lock().unwrap();
        if reg.finished.contains(&op) || reg.open.contains_key(&op) {
            return Err(CoreError::InvalidUsage(format!(
                "collective {op} already ran here"
            )));
        }
        if let Some(early) = reg.stash.remove(&op) {
            reg.stashed_bytes -= early.iter().map(|s| s.payload.len()).sum::<usize>();
            if let Err(e) = early.iter().try_for_each(|s| land_stashed(&*target, s)) {
                drop(reg);
                self.poison(format!("link from peer {} failed: {e}", self.prev));
                return Err(e);
            }
        }
        reg.open.insert(op, target);
        drop(reg);
        self.registered.notify_waiters();
        Ok(())
    }

    /// Forgets the op and drops its stash; later pieces of it are read and discarded.
    pub fn finish(&self, op: u64) {
        let mut reg = self.registry.lock().unwrap();
        reg.open.remove(&op);
        if let Some(early) = reg.stash.remove(&op) {
            reg.stashed_bytes -= early.iter().map(|s| s.payload.len()).sum::<usize>();
        }
        if reg.finished.insert(op) {
            reg.finished_order.push_back(op);
            if reg.finished_order.len() > MAX_FINISHED {
                let old = reg.finished_order.pop_front().unwrap();
                reg.finished.remove(&old);
            }
        }
    }

    /// Where the piece `header` announces goes. `Stash` reserves its bytes: the lane
    /// then hands the payload to `stash_piece` (or releases it with `unreserve`).
    fn route(&self, header: &PieceHeader) -> Route {
        let mut reg = self.registry.lock().unwrap();
        if let Some(t) = reg.open.get(&header.op) {
            return Route::Land(t.clone());
        }
        if reg.finished.contains(&header.op) || self.is_poisoned() {
            return Route::Drop;
        }
        let len = header.len as usize;
        if reg.stashed_bytes + len <= reg.stash_limit {
            reg.stashed_bytes += len;
            Route::Stash
        } else {
            Route::Wait
        }
    }

    fn unreserve(&self, len: usize) {
        self.registry.lock().unwrap().stashed_bytes -= len;
    }

    /// The payload of an early piece has been read (its bytes reserved by `route`):
    /// lands it if the op was registered meanwhile, drops it if the op ended (or the
    /// links failed), else keeps it for `register`.
    fn stash_piece(&self, header: PieceHeader, payload: Vec<u8>) -> CoreResult<()> {
        let mut reg = self.registry.lock().unwrap();
        let piece = Stashed { header, payload };
        if let Some(t) = reg.open.get(&header.op).cloned() {
            reg.stashed_bytes -= piece.payload.len();
            return land_stashed(&*t, &piece);
        }
        if reg.finished.contains(&header.op) || self.is_poisoned() {
            reg.stashed_bytes -= piece.payload.len();
            return Ok(());
        }
        reg.stash.entry(header.op).or_default().push_back(piece);
        Ok(())
    }

    /// The op's target; waits (bounded) for an op the peer announced before we did.
    /// `None`: the op already ended here.
    async fn target_for(&self, op: u64) -> CoreResult<Option<Arc<dyn Landing>>> {
        let deadline = tokio::time::Instant::now() + self.io_timeout;
        loop {
            let notified = self.registered.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let reg = self.registry.lock().unwrap();
                if let Some(t) = reg.open.get(&op) {
                    return Ok(Some(t.clone()));
                }
                if reg.finished.contains(&op) {
                    return Ok(None);
                }
            }
            tokio::select! {
                _ = notified => {}
                _ = tokio::time::sleep_until(deadline) => {
                    return Err(CoreError::Protocol(format!(
                        "peer {} sent pieces of collective {op}, which never started here",
                        self.prev
                    )))
                }
            }
        }
    }

    /// Sends one piece on `lane`. A timeout or error poisons the links (the stream may
    /// hold half a frame now).
    pub async fn send_piece(
        &self,
        lane: usize,
        header: PieceHeader,
        payload: &[u8],
    ) -> CoreResult<()> {
        if self.is_poisoned() {
            return Err(self.poison_error());
        }
        let writer = &self.writers[lane];
        let write = async {
            let mut guard = writer.lock().await;
            let Some(w) = guard.as_mut() else {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::NotConnected,
                    "ring links closed",
                ));
            };
            w.write_all(&header.encode()).await?;
            w.write_all(payload).await?;
            // The secure transport buffers into records: the piece goes out now.
            w.flush().await?;
            Ok::<_, std::io::Error>(())
        };
        let outcome = tokio::select! {
            _ = self.poisoned.cancelled() => return Err(self.poison_error()),
            r = tokio::time::timeout(self.io_timeout, write) => r,
        };
        match outcome {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => {
                self.poison(format!("sending to peer {} failed: {e}", self.next));
                Err(self.poison_error())
            }
            Err(_) => {
                self.poison(format!(
                    "peer {} accepted no data for {:.1}s (stalled or dead)",
                    self.next,
                    self.io_timeout.as_secs_f64()
                ));
                Err(self.poison_error())
            }
        }
    }

    /// The error of an op on these links that was aborted: the links' own error if
    /// they failed meanwhile (that is the cause worth reporting), else `Aborted`.
    pub fn aborted_error(&self) -> CoreError {
        if self.is_poisoned() {
            self.poison_error()
        } else {
            CoreError::Aborted("the collective was aborted".into())
        }
    }

    /// Declares `peer` (the sender on these links) stalled: poisons the links and
    /// returns their error.
    pub fn stall(&self, peer: u64) -> CoreError {
        self.poison(format!(
            "no data from peer {peer} for {:.1}s (stalled or dead)",
            self.io_timeout.as_secs_f64()
        ));
        self.poison_error()
    }

    /// [`RingLinks::send_piece`], unless `cancel` fires first: half a frame may be on
    /// the wire then, so the links are poisoned and the send fails with their error.
    pub async fn send_piece_or_abort(
        &self,
        lane: usize,
        header: PieceHeader,
        payload: &[u8],
        cancel: &CancellationToken,
    ) -> CoreResult<()> {
        tokio::select! {
            r = self.send_piece(lane, header, payload) => r,
            _ = cancel.cancelled() => {
                self.poison("a collective was aborted while sending".into());
                Err(self.poison_error())
            }
        }
    }

    /// Stops the reader tasks and closes every stream.
    pub async fn close(&self) {
        self.cancel.cancel();
        self.poison("ring links closed (topology changed or peer closing)".into());
        self.tracker.close();
        self.tracker.wait().await;
        // A reader stopped mid-payload left its reservation behind; nobody reads now.
        self.registry.lock().unwrap().stashed_bytes = 0;
        // Senders give their lane up promptly once poisoned (or after io_timeout).
        for w in &self.writers {
            w.lock().await.take();
        }
        self.send_read_halves.lock().unwrap().clear();
    }
}

impl Drop for RingLinks {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Reads the payload of a [`Dest::Streamed`] piece into `block` and hands it to
/// `target` part by part: whatever each read brought, cut to whole 8-byte words (a
/// whole number of elements of every dtype), once there is at least a quarter block or
/// the piece is complete. Reading what came rather than exact blocks lets an encrypted
/// stream decrypt each record straight into `block` (it needs room for a whole record).
async fn read_streamed(
    read: &mut P2PReadHalf,
    target: &dyn Landing,
    header: &PieceHeader,
    block: &mut Vec<u8>,
) -> CoreResult<()> {
    const WORD: usize = 8;
    let total = header.len as usize;
    // Room for two records and the carried partial word.
    if block.len() < 2 * STREAM_BLOCK + WORD {
        block.resize(2 * STREAM_BLOCK + WORD, 0);
    }
    let (mut offset, mut filled) = (0, 0);
    while offset + filled < total {
        let want = (block.len() - filled).min(total - offset - filled);
        let n = read
            .read(&mut block[filled..filled + want])
            .await
            .map_err(|e| CoreError::io("reading a piece", e))?;
        if n == 0 {
            return Err(CoreError::PeerConnection("connection closed".into()));
        }
        filled += n;
        let done = offset + filled == total;
        let usable = if done { filled } else { filled / WORD * WORD };
        if usable >= STREAM_BLOCK / 4 || done {
            target.land_part(header.step, header.piece, offset, &block[..usable])?;
            block.copy_within(usable..filled, 0);
            offset += usable;
            filled -= usable;
        }
    }
    Ok(())
}

async fn read_lane(
    links: &std::sync::Weak<RingLinks>,
    read: &mut P2PReadHalf,
    _lane: u16,
) -> CoreResult<()> {
    let max_piece = match links.upgrade() {
        Some(l) => l.max_piece,
        None => return Ok(()),
    };
    let mut sink = Vec::new();
    let mut block = Vec::new();
    loop {
        let mut h = [0u8; HEADER_LEN];
        match read.read_exact(&mut h).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Err(CoreError::PeerConnection("connection closed".into()))
            }
            Err(e) => return Err(CoreError::io("reading a piece header", e)),
        }
        let header = PieceHeader::parse(&h, max_piece)?;
        let Some(l) = links.upgrade() else {
            return Ok(());
        };
        let target = match l.route(&header) {
            Route::Land(target) => Some(target),
            Route::Drop => None,
            Route::Wait => l.target_for(header.op).await?,
            Route::Stash => {
                drop(l);
                let mut payload = vec![0u8; header.len as usize];
                let read = read.read_exact(&mut payload).await;
                let Some(l) = links.upgrade() else {
                    return Ok(());
                };
                if let Err(e) = read {
                    l.unreserve(payload.len());
                    return Err(CoreError::io("reading a piece", e));
                }
                l.stash_piece(header, payload)?;
                continue;
            }
        };
        drop(l);
        match target {
            Some(target) => {
                // (A slice, not the raw pointer, is held across the reads: it is Send.)
                let direct =
                    match target.landing(header.step, header.piece, header.len, header.digest)? {
                        // SAFETY: the target keeps this range alive and hands it to this lane
                        // alone until `landed` is called.
                        Dest::Direct(ptr, len) => {
                            Some(unsafe { std::slice::from_raw_parts_mut(ptr, len) })
                        }
                        Dest::Streamed => None,
                    };
                match direct {
                    Some(dst) => {
                        read.read_exact(dst)
                            .await
                            .map_err(|e| CoreError::io("reading a piece", e))?;
                    }
                    None => {
                        read_streamed(read, &*target, &header, &mut block).await?;
                    }
                }
                target.landed(header.step, header.piece)?;
            }
            None => {
                // A straggler of an op that ended here: read and drop it.
                sink.resize(header.len as usize, 0);
                read.read_exact(&mut sink)
                    .await
                    .map_err(|e| CoreError::io("reading a piece", e))?;
            }
        }
    }
}
