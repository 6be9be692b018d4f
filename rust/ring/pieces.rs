//! What a ring op keeps of the pieces it receives, shared by the all-reduce and the
//! all-gather: the checks every piece header passes before a byte of it is read (its
//! descriptor digest, that it lies inside the op and is its slot's next step, that no
//! other lane has it), how far each piece has come, the bytes moved, and the op's own
//! failure (a peer that runs another collective under this op id).

use crate::error::{CoreError, CoreResult};
use crate::ring::allreduce::ReduceStats;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use tokio::sync::Notify;

/// `claimed[p]` of an op that failed here: no reader may start landing a piece of it.
pub(crate) const CLOSED: u32 = u32::MAX;

/// How an op names itself in the errors its pieces raise.
pub(crate) struct OpWords {
    /// "collective", "all-gather".
    pub noun: &'static str,
    /// After "peer P runs a different collective as op N (...): ": what may differ.
    pub differs: &'static str,
    /// Appended to the error of a piece outside the op.
    pub outside_hint: &'static str,
}

/// The receiving bookkeeping of one op of `steps x pieces` pieces.
pub(crate) struct PieceTracker {
    op_id: u64,
    words: OpWords,
    /// Every piece sent carries it, every piece received must.
    pub digest: u32,
    /// The previous peer (named in errors).
    prev: u64,
    steps: usize,
    /// Why this op failed, when that is its own fault rather than the links' (a peer
    /// runs another descriptor): reported instead of the poisoned links' error.
    failure: Mutex<Option<CoreError>>,
    /// progress[p] = steps whose piece p has landed (and, in an all-reduce, been
    /// reduced).
    pub progress: Vec<AtomicU32>,
    /// claimed[p] = steps whose piece p some lane has started to receive: each piece is
    /// handed to one lane only, even if the previous peer announces it on several.
    claimed: Vec<AtomicU32>,
    /// Pieces landed so far, out of `steps * pieces`.
    landed: AtomicU64,
    /// Notified whenever a piece landed, or the op failed on its own.
    pub advanced: Notify,
    pub tx: AtomicU64,
    pub rx: AtomicU64,
}

impl PieceTracker {
    pub(crate) fn new(
        words: OpWords,
        op_id: u64,
        digest: u32,
        prev: u64,
        steps: usize,
        pieces: usize,
    ) -> PieceTracker {
        PieceTracker {
            op_id,
            words,
            digest,
            prev,
            steps,
            failure: Mutex::new(None),
            progress: (0..pieces).map(|_| AtomicU32::new(0)).collect(),
            claimed: (0..pieces).map(|_| AtomicU32::new(0)).collect(),
            landed: AtomicU64::new(0),
            advanced: Notify::new(),
            tx: AtomicU64::new(0),
            rx: AtomicU64::new(0),
        }
    }

    fn pieces(&self) -> usize {
        self.progress.len()
    }

    /// The op's id (on the wire, in errors).
    pub(crate) fn op_id(&self) -> u64 {
        self.op_id
    }

    /// Pieces the op receives in all: `steps x pieces`.
    pub(crate) fn total(&self) -> u64 {
        (self.steps * self.pieces()) as u64
    }

    /// A piece header's digest, and that piece `(step, p)` lies inside the op and is
    /// the next step of its slot. Another digest is the op's own failure (recorded, and
    /// the waiters woken).
    pub(crate) fn check(&self, step: usize, p: usize, digest: u32) -> CoreResult<()> {
        let noun = self.words.noun;
        if digest != self.digest {
            let e = CoreError::InvalidUsage(format!(
                "peer {} runs a different collective as op {} (descriptor digest \
                 {digest:08x}, ours {:08x}): {}",
                self.prev, self.op_id, self.digest, self.words.differs
            ));
            self.failure.lock().unwrap().get_or_insert(e.clone());
            self.advanced.notify_waiters();
            return Err(e);
        }
        if step >= self.steps || p >= self.pieces() {
            return Err(CoreError::Protocol(format!(
                "piece {step}/{p} is outside {noun} {} ({} steps x {} pieces){}",
                self.op_id,
                self.steps,
                self.pieces(),
                self.words.outside_hint
            )));
        }
        if self.progress[p].load(Ordering::Acquire) != step as u32 {
            return Err(CoreError::Protocol(format!(
                "piece {step}/{p} of {noun} {} arrived out of order",
                self.op_id
            )));
        }
        Ok(())
    }

    /// Hands piece `(step, p)` to the calling reader, unless another has it or the op
    /// ended here.
    pub(crate) fn claim(&self, step: usize, p: usize) -> CoreResult<()> {
        let noun = self.words.noun;
        match self.claimed[p].compare_exchange(
            step as u32,
            step as u32 + 1,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => Ok(()),
            Err(CLOSED) => Err(CoreError::Aborted(format!(
                "a piece of {noun} {} arrived after it ended here",
                self.op_id
            ))),
            Err(_) => Err(CoreError::Protocol(format!(
                "piece {step}/{p} of {noun} {} arrived twice",
                self.op_id
            ))),
        }
    }

    /// Piece `(step, p)` has landed (and is done with): its slot's next step may come,
    /// and whoever waits on progress hears of it.
    pub(crate) fn finish(&self, step: usize, p: usize) {
        self.progress[p].store(step as u32 + 1, Ordering::Release);
        self.landed.fetch_add(1, Ordering::AcqRel);
        self.advanced.notify_waiters();
    }

    /// Pieces landed so far.
    pub(crate) fn landed_count(&self) -> u64 {
        self.landed.load(Ordering::Acquire)
    }

    /// Stops every later landing of this op: no reader may claim a piece from now on.
    /// True when no piece is being received now (so nothing writes the op's memory any
    /// more), false while one still is.
    pub(crate) fn close(&self) -> bool {
        let mut idle = true;
        for (claimed, progress) in self.claimed.iter().zip(&self.progress) {
            let c = claimed.load(Ordering::Acquire);
            if c == CLOSED {
                continue;
            }
            if progress.load(Ordering::Acquire) == c {
                // Nothing in flight on this piece: close it, unless a reader claimed it
                // just now (then it is in flight: wait for it like the others).
                if claimed
                    .compare_exchange(c, CLOSED, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    continue;
                }
            }
            idle = false;
        }
        idle
    }

    /// Why the op failed, when it was its own fault (see `check`).
    pub(crate) fn own_failure(&self) -> Option<CoreError> {
        self.failure.lock().unwrap().clone()
    }

    /// The bytes sent and received so far, headers included.
    pub(crate) fn stats(&self) -> ReduceStats {
        ReduceStats {
            tx_bytes: self.tx.load(Ordering::Relaxed),
            rx_bytes: self.rx.load(Ordering::Relaxed),
        }
    }
}
