//! `RingLinks`: the streams of one ring epoch, to the next peer (sending lanes) and
//! from the previous peer (receiving lanes).
//!
//! Many collectives share the lanes. Every piece travels as one frame with a fixed
//! header; a reader task per receiving lane files incoming pieces into per-(op, lane)
//! mailboxes, so collectives never see each other's bytes. Any I/O error, timeout in
//! the middle of a frame, or malformed header *poisons* the links: the byte stream can
//! no longer be trusted, so every current and later collective on them fails until
//! `update_topology()` builds new ones.

use crate::error::{CoreError, CoreResult};
use bytes::BytesMut;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub const HEADER_LEN: usize = 24;
const FRAME_MAGIC: u32 = 0x5043_434C; // "PCCL"
/// Pieces queued per (op, lane) before the reader waits for the op to consume them.
const MAILBOX_DEPTH: usize = 8;
/// Mailboxes that exist before their op claimed them; more means a confused peer.
const MAX_UNCLAIMED: usize = 4096;
/// Remember this many finished ops so that their stragglers are dropped, not queued.
const MAX_FINISHED: usize = 65536;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PieceHeader {
    pub op: u64,
    pub step: u32,
    pub piece: u32,
    pub len: u32,
}

impl PieceHeader {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..4].copy_from_slice(&FRAME_MAGIC.to_be_bytes());
        h[4..12].copy_from_slice(&self.op.to_be_bytes());
        h[12..16].copy_from_slice(&self.step.to_be_bytes());
        h[16..20].copy_from_slice(&self.piece.to_be_bytes());
        h[20..24].copy_from_slice(&self.len.to_be_bytes());
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
        })
    }
}

pub struct Piece {
    pub header: PieceHeader,
    pub payload: BytesMut,
}

struct Mailbox {
    tx: mpsc::Sender<Piece>,
    rx: Option<mpsc::Receiver<Piece>>,
}

#[derive(Default)]
struct Mailboxes {
    open: HashMap<(u64, u16), Mailbox>,
    finished: HashSet<u64>,
    finished_order: std::collections::VecDeque<u64>,
}

pub struct RingLinks {
    pub epoch: u64,
    pub next: u64,
    pub prev: u64,
    writers: Vec<tokio::sync::Mutex<OwnedWriteHalf>>,
    recv_lanes: usize,
    max_piece: usize,
    io_timeout: Duration,
    mailboxes: Mutex<Mailboxes>,
    poisoned: CancellationToken,
    poison_reason: Mutex<Option<String>>,
    cancel: CancellationToken,
    tracker: TaskTracker,
    /// Unused read halves of the sending streams, kept so the sockets stay whole.
    _send_read_halves: Vec<OwnedReadHalf>,
}

impl RingLinks {
    /// Takes ownership of the streams and starts one reader task per receiving lane.
    pub fn new(
        epoch: u64,
        next: u64,
        prev: u64,
        to_next: Vec<TcpStream>,
        from_prev: Vec<TcpStream>,
        max_piece: usize,
        io_timeout: Duration,
    ) -> Arc<RingLinks> {
        let mut writers = Vec::with_capacity(to_next.len());
        let mut send_reads = Vec::with_capacity(to_next.len());
        for s in to_next {
            let (r, w) = s.into_split();
            send_reads.push(r);
            writers.push(tokio::sync::Mutex::new(w));
        }
        let links = Arc::new(RingLinks {
            epoch,
            next,
            prev,
            writers,
            recv_lanes: from_prev.len(),
            max_piece,
            io_timeout,
            mailboxes: Mutex::new(Mailboxes::default()),
            poisoned: CancellationToken::new(),
            poison_reason: Mutex::new(None),
            cancel: CancellationToken::new(),
            tracker: TaskTracker::new(),
            _send_read_halves: send_reads,
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

    /// Marks the links unusable (first reason wins) and wakes everything waiting on them.
    pub fn poison(&self, reason: String) {
        {
            let mut r = self.poison_reason.lock().unwrap();
            if r.is_none() {
                *r = Some(reason);
            }
        }
        self.poisoned.cancel();
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

    /// The receiving end of `(op, lane)`, created if pieces have not arrived yet.
    pub fn claim(&self, op: u64, lane: u16) -> CoreResult<mpsc::Receiver<Piece>> {
        let mut mb = self.mailboxes.lock().unwrap();
        if mb.finished.contains(&op) {
            return Err(CoreError::InvalidUsage(format!("collective {op} already ran")));
        }
        let entry = mb.open.entry((op, lane)).or_insert_with(|| {
            let (tx, rx) = mpsc::channel(MAILBOX_DEPTH);
            Mailbox { tx, rx: Some(rx) }
        });
        entry
            .rx
            .take()
            .ok_or_else(|| CoreError::InvalidUsage(format!("collective {op} claimed twice")))
    }

    /// Forgets the op's mailboxes; later pieces of it are discarded.
    pub fn finish(&self, op: u64) {
        let mut mb = self.mailboxes.lock().unwrap();
        mb.open.retain(|(o, _), _| *o != op);
        if mb.finished.insert(op) {
            mb.finished_order.push_back(op);
            if mb.finished_order.len() > MAX_FINISHED {
                let old = mb.finished_order.pop_front().unwrap();
                mb.finished.remove(&old);
            }
        }
    }

    fn mailbox_for(&self, op: u64, lane: u16) -> CoreResult<Option<mpsc::Sender<Piece>>> {
        let mut mb = self.mailboxes.lock().unwrap();
        if mb.finished.contains(&op) {
            return Ok(None);
        }
        if !mb.open.contains_key(&(op, lane)) && mb.open.len() >= MAX_UNCLAIMED {
            return Err(CoreError::Protocol("too many unclaimed collectives".into()));
        }
        let entry = mb.open.entry((op, lane)).or_insert_with(|| {
            let (tx, rx) = mpsc::channel(MAILBOX_DEPTH);
            Mailbox { tx, rx: Some(rx) }
        });
        Ok(Some(entry.tx.clone()))
    }

    /// Sends one piece on `lane`. A timeout or error poisons the links (the stream may
    /// hold half a frame now).
    pub async fn send_piece(&self, lane: usize, header: PieceHeader, payload: &[u8]) -> CoreResult<()> {
        if self.is_poisoned() {
            return Err(self.poison_error());
        }
        let writer = &self.writers[lane];
        let write = async {
            let mut w = writer.lock().await;
            w.write_all(&header.encode()).await?;
            w.write_all(payload).await?;
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

    /// Stops the reader tasks and closes every stream.
    pub async fn close(&self) {
        self.cancel.cancel();
        self.poison("ring links closed (topology changed or peer closing)".into());
        self.tracker.close();
        self.tracker.wait().await;
    }
}

impl Drop for RingLinks {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

async fn read_lane(
    links: &std::sync::Weak<RingLinks>,
    read: &mut OwnedReadHalf,
    lane: u16,
) -> CoreResult<()> {
    let max_piece = match links.upgrade() {
        Some(l) => l.max_piece,
        None => return Ok(()),
    };
    loop {
        let mut h = [0u8; HEADER_LEN];
        match read.read_exact(&mut h).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Err(CoreError::PeerConnection("connection closed".into()))
            }
            Err(e) => return Err(CoreError::io("reading a piece header", e)),
        }
        let header = PieceHeader::decode(&h)
            .ok_or_else(|| CoreError::Protocol("garbage on a ring link (bad frame magic)".into()))?;
        if header.len as usize > max_piece {
            return Err(CoreError::Protocol(format!(
                "piece of {} bytes exceeds the limit of {max_piece}",
                header.len
            )));
        }
        let mut payload = BytesMut::zeroed(header.len as usize);
        read.read_exact(&mut payload)
            .await
            .map_err(|e| CoreError::io("reading a piece", e))?;
        let Some(l) = links.upgrade() else { return Ok(()) };
        let tx = l.mailbox_for(header.op, lane)?;
        drop(l);
        if let Some(tx) = tx {
            // A closed receiver means the op ended; its stragglers are dropped.
            let _ = tx.send(Piece { header, payload }).await;
        }
    }
}
