//! Fuzzing entry points: every decoder that reads bytes from another peer, driven from
//! one byte slice, with the invariants it must keep checked by assertions. A violated
//! invariant (or any panic inside the decoder) is a bug.
//!
//! The `fuzz/` crate (cargo-fuzz, nightly) calls each function from one target; the
//! proptests in `tests` below feed the same functions random and mutated-valid inputs
//! under plain `cargo test`. Compiled only for tests and with the `fuzzing` feature;
//! none of this is API.
//!
//! Conventions: the first byte or two of an input are knobs (secret on/off, how many
//! bytes each read returns, limits), the rest is what the peer sent. Reads come from an
//! in-memory [`Script`] that ends in EOF, so no harness can wait for more data.

use crate::error::{CoreError, CoreResult};
use crate::net::frame::{read_frame, write_frame};
use crate::net::handshake::{self, Purpose, StreamHello, MAGIC, VERSION};
use crate::net::transfer::{self, Served, TransferRegistry};
use crate::quant::{self, QuantAlgorithm, QuantParams, WireType, PARAMS_LEN};
use crate::reduce::{self, DType, ReduceOp};
use crate::ring::allreduce::{OpMemory, Receiver, ReduceSpec};
use crate::ring::links::{PieceHeader, HEADER_LEN};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The shared secret of the harnesses that authenticate.
pub const SECRET: &[u8] = b"fuzz-secret";
/// The identity every dialing harness claims.
pub const HELLO: StreamHello = StreamHello {
    from: 1,
    to: 2,
    epoch: 3,
    stream: 0,
    pool: 4,
    purpose: Purpose::Ring,
};
/// Op id of the collective the ring harness receives.
pub const OP: u64 = 7;

// ---------------------------------------------------------------------------------------
// In-memory streams and a runtime
// ---------------------------------------------------------------------------------------

/// A stream whose reads replay `input`, at most `step` bytes per read (so partial reads
/// happen), then EOF; writes are collected in `written`.
pub struct Script<'a> {
    input: &'a [u8],
    pos: usize,
    step: usize,
    pub written: Vec<u8>,
    pub shut_down: bool,
}

impl<'a> Script<'a> {
    pub fn new(input: &'a [u8], step: usize) -> Self {
        Script {
            input,
            pos: 0,
            step: step.max(1),
            written: Vec::new(),
            shut_down: false,
        }
    }

    /// Bytes of the input read so far.
    pub fn consumed(&self) -> usize {
        self.pos
    }
}

impl AsyncRead for Script<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let n = self
            .step
            .min(buf.remaining())
            .min(self.input.len() - self.pos);
        let start = self.pos;
        buf.put_slice(&self.input[start..start + n]);
        self.pos += n;
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Script<'_> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.written.extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.shut_down = true;
        Poll::Ready(Ok(()))
    }
}

/// Runs `f` to completion on this thread's current-thread runtime (timers enabled,
/// for the transfer code's I/O timeouts).
pub fn block_on<F: Future>(f: F) -> F::Output {
    thread_local! {
        static RT: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a current-thread runtime");
    }
    RT.with(|rt| rt.block_on(f))
}

/// Read size from a knob byte: 1..=16 bytes per read, or everything at once.
fn read_step(knob: u8) -> usize {
    if knob >= 0x80 {
        usize::MAX
    } else {
        1 + usize::from(knob % 16)
    }
}

/// `(knob, knob, rest)` of an input, or `None` if it is shorter than two bytes.
fn knobs(data: &[u8]) -> Option<(u8, u8, &[u8])> {
    match data {
        [a, b, rest @ ..] => Some((*a, *b, rest)),
        _ => None,
    }
}

/// One length-prefixed frame at the start of `bytes`, as the protocol defines it:
/// `Some((body, rest))` when the prefix is complete, within `max`, and the body is all
/// there.
fn split_frame(bytes: &[u8], max: usize) -> Option<(&[u8], &[u8])> {
    let prefix: [u8; 4] = bytes.get(..4)?.try_into().unwrap();
    let n = u32::from_be_bytes(prefix) as usize;
    if n > max || bytes.len() < 4 + n {
        return None;
    }
    Some((&bytes[4..4 + n], &bytes[4 + n..]))
}

fn hmac(label: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    use hmac::Mac;
    let mut m = hmac::Hmac::<sha2::Sha256>::new_from_slice(SECRET).unwrap();
    m.update(label);
    for p in parts {
        m.update(p);
    }
    m.finalize().into_bytes().to_vec()
}

// ---------------------------------------------------------------------------------------
// Length-prefixed frames (`net/frame.rs`)
// ---------------------------------------------------------------------------------------

/// Knobs: the frame cap (`2 * k`, 0..=510) and the read size. Reads frames until EOF or
/// an error and checks every outcome against the framing rules.
pub fn frames(data: &[u8]) {
    let Some((cap, step, stream)) = knobs(data) else {
        return;
    };
    let max = 2 * usize::from(cap);
    let mut script = Script::new(stream, read_step(step));
    let mut buf = Vec::new();
    let mut at = 0;
    loop {
        let rest = &stream[at..];
        let got = block_on(read_frame(&mut script, &mut buf, max));
        let declared = rest
            .get(..4)
            .map(|p| u32::from_be_bytes(p.try_into().unwrap()) as usize);
        match got {
            Ok(true) => {
                let (body, _) = split_frame(rest, max).expect("a frame the rules refuse");
                assert_eq!(buf, body);
                assert!(buf.len() <= max);
                at += 4 + body.len();
                assert_eq!(script.consumed(), at, "read past the frame");
                // What we read, written again, is the same bytes.
                let mut again = Script::new(&[], 1);
                block_on(write_frame(&mut again, &buf)).unwrap();
                assert_eq!(again.written, rest[..4 + body.len()]);
            }
            // A clean end only where a prefix should start; EOF inside one is an error.
            Ok(false) => {
                assert!(rest.is_empty(), "a truncated prefix read as a clean end");
                return;
            }
            Err(CoreError::Protocol(_)) => {
                assert!(declared.expect("a complete prefix") > max);
                if at == 0 {
                    assert_eq!(buf.capacity(), 0, "allocated for a refused frame");
                }
                return;
            }
            Err(CoreError::PeerConnection(_)) => {
                match declared {
                    None => assert!(!rest.is_empty(), "an error at a clean end"),
                    Some(n) => assert!(n <= max && rest.len() < 4 + n, "a truncated body only"),
                }
                return;
            }
            Err(e) => panic!("unexpected error kind: {e:?}"),
        }
    }
}

// ---------------------------------------------------------------------------------------
// The p2p handshake (`net/handshake.rs`)
// ---------------------------------------------------------------------------------------

const CHALLENGE_LEN: usize = 8 + 2 + 16;
const DIALER_LEN: usize = 8 + 2 + 8 + 8 + 8 + 2 + 2 + 1 + 16 + 32;
const REPLY_LEN: usize = 1 + 32;

/// The dialer's fields as the protocol lays them out, if `body` is a well-formed
/// dialer message.
fn dialer_fields(body: &[u8]) -> Option<StreamHello> {
    if body.len() != DIALER_LEN || &body[..8] != MAGIC {
        return None;
    }
    let u64_at = |i: usize| u64::from_be_bytes(body[i..i + 8].try_into().unwrap());
    let u16_at = |i: usize| u16::from_be_bytes(body[i..i + 2].try_into().unwrap());
    let purpose = match body[38] {
        0 => Purpose::Ring,
        1 => Purpose::Transfer,
        2 => Purpose::Probe,
        3 => Purpose::Mesh,
        _ => return None,
    };
    (u16_at(8) == VERSION).then_some(StreamHello {
        from: u64_at(10),
        to: u64_at(18),
        epoch: u64_at(26),
        stream: u16_at(34),
        pool: u16_at(36),
        purpose,
    })
}

/// Listener side. Knobs: bit 0 = with the shared secret, bit 1 = answer for peer
/// `u64::MAX` instead of 2; the read size. The rest is what the dialer sends.
pub fn handshake_accept(data: &[u8]) {
    let Some((mode, step, input)) = knobs(data) else {
        return;
    };
    let secret = (mode & 1 != 0).then_some(SECRET);
    let own = if mode & 2 != 0 { u64::MAX } else { 2 };
    let mut script = Script::new(input, read_step(step));
    let got = block_on(handshake::accept(&mut script, secret, own));
    // The listener always speaks first: MAGIC, version, a fresh nonce.
    let (challenge, reply) =
        split_frame(&script.written, 128).expect("the listener sent its challenge");
    assert_eq!(challenge.len(), CHALLENGE_LEN);
    assert_eq!(&challenge[..8], MAGIC);
    assert_eq!(challenge[8..10], VERSION.to_be_bytes());
    let nonce_l = &challenge[10..];
    let sent = split_frame(input, handshake::MAX_HANDSHAKE_FRAME).map(|(body, _)| body);
    let claimed = sent.and_then(dialer_fields);
    let status = split_frame(reply, 128).map(|(body, rest)| {
        assert!(rest.is_empty(), "more than one reply");
        assert_eq!(body.len(), REPLY_LEN);
        body[0]
    });
    assert_eq!(status.is_some(), !reply.is_empty());
    match got {
        Ok(hello) => {
            // Without the secret nobody can forge the dialer's MAC over our nonce.
            let body = sent.unwrap();
            if secret.is_some() {
                let (fields, tag) = body.split_at(DIALER_LEN - 32);
                assert_eq!(hmac(b"pccl-p2p-dialer", &[nonce_l, fields]), tag);
            }
            assert_eq!(Some(hello), claimed);
            assert_eq!(hello.to, own);
            assert_eq!(status, Some(handshake::STATUS_OK));
        }
        Err(CoreError::Authentication(_)) => {
            assert!(secret.is_some() && claimed.is_some());
            assert_eq!(status, Some(handshake::STATUS_AUTH_FAILED));
        }
        Err(CoreError::PeerConnection(_)) if status.is_some() => {
            assert_ne!(claimed.expect("a well-formed hello").to, own);
            assert_eq!(status, Some(handshake::STATUS_WRONG_PEER));
        }
        // Nothing answered: a truncated, malformed or foreign first message.
        Err(CoreError::PeerConnection(_) | CoreError::Protocol(_)) => {
            assert!(claimed.is_none());
        }
        Err(e) => panic!("unexpected error kind: {e:?}"),
    }
}

/// Dialer side. Knobs: bit 0 = with the shared secret; the read size. The rest is what
/// the listener sends (its challenge, then its reply).
pub fn handshake_dial(data: &[u8]) {
    let Some((mode, step, input)) = knobs(data) else {
        return;
    };
    let secret = (mode & 1 != 0).then_some(SECRET);
    let mut script = Script::new(input, read_step(step));
    let got = block_on(handshake::dial(&mut script, secret, HELLO));
    let max = handshake::MAX_HANDSHAKE_FRAME;
    let challenge = split_frame(input, max).filter(|(body, _)| {
        body.len() == CHALLENGE_LEN && &body[..8] == MAGIC && body[8..10] == VERSION.to_be_bytes()
    });
    match challenge {
        None => assert!(script.written.is_empty(), "answered a bad challenge"),
        Some((body, _)) => {
            // Exactly one message, with our identity, MAC'd over the listener's nonce.
            let (msg, rest) = split_frame(&script.written, max).expect("a hello");
            assert!(rest.is_empty());
            assert_eq!(dialer_fields(msg), Some(HELLO));
            let (fields, tag) = msg.split_at(DIALER_LEN - 32);
            match secret {
                Some(_) => assert_eq!(hmac(b"pccl-p2p-dialer", &[&body[10..], fields]), tag),
                None => assert_eq!(tag, [0u8; 32]),
            }
        }
    }
    let reply = challenge.and_then(|(_, rest)| split_frame(rest, max));
    match got {
        Ok(()) => {
            let ((challenge, _), (reply, _)) = (challenge.unwrap(), reply.unwrap());
            assert_eq!(reply.len(), REPLY_LEN);
            assert_eq!(reply[0], handshake::STATUS_OK);
            if secret.is_some() {
                // Accepted only with the listener's proof over our fresh nonce.
                let nonce_d = &script.written[4 + DIALER_LEN - 48..4 + DIALER_LEN - 32];
                let mac = hmac(b"pccl-p2p-listener", &[nonce_d, &challenge[10..]]);
                assert_eq!(reply[1..], mac[..]);
            }
        }
        Err(CoreError::Authentication(_)) => assert!(challenge.is_some()),
        Err(CoreError::PeerConnection(_) | CoreError::Protocol(_)) => {}
        Err(e) => panic!("unexpected error kind: {e:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// Ring piece headers (`ring/links.rs`)
// ---------------------------------------------------------------------------------------

/// 28 header bytes, then (optionally) a 4-byte piece limit.
pub fn piece_header(data: &[u8]) {
    let Some(h) = data.get(..HEADER_LEN) else {
        return;
    };
    let h: &[u8; HEADER_LEN] = h.try_into().unwrap();
    let max = data.get(HEADER_LEN..HEADER_LEN + 4).map_or(16 << 20, |b| {
        u32::from_be_bytes(b.try_into().unwrap()) as usize
    });
    let decoded = PieceHeader::decode(h);
    assert_eq!(decoded.is_some(), &h[..4] == b"PCCL");
    if let Some(d) = decoded {
        assert_eq!(&d.encode(), h);
        assert_eq!(PieceHeader::decode(&d.encode()), Some(d));
    }
    match PieceHeader::parse(h, max) {
        Ok(p) => {
            assert_eq!(Some(p), decoded);
            assert!(p.len as usize <= max);
        }
        Err(CoreError::Protocol(_)) => {
            assert!(decoded.is_none_or(|d| d.len as usize > max));
        }
        Err(e) => panic!("unexpected error kind: {e:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// Quantized pieces (`quant/mod.rs`)
// ---------------------------------------------------------------------------------------

fn value_at(dtype: DType, bytes: &[u8]) -> f64 {
    match dtype {
        DType::F16 => half::f16::from_le_bytes([bytes[0], bytes[1]]).to_f64(),
        DType::BF16 => half::bf16::from_le_bytes([bytes[0], bytes[1]]).to_f64(),
        DType::F32 => f64::from(f32::from_le_bytes(bytes[..4].try_into().unwrap())),
        _ => f64::from_le_bytes(bytes[..8].try_into().unwrap()),
    }
}

/// A quantized chunk as it arrives: the 24-byte header, then the codes (at most 4096
/// are used). A header that parses must describe itself exactly, decode without error
/// into values inside its own range, and the fused reduce kernels must agree bit for
/// bit with decoding followed by the plain reduce.
pub fn quant_chunk(data: &[u8]) {
    let params = match QuantParams::from_bytes(data) {
        Ok(p) => p,
        Err(CoreError::Protocol(_)) => return,
        Err(e) => panic!("unexpected error kind: {e:?}"),
    };
    assert_eq!(params.to_bytes()[..], data[..PARAMS_LEN]);
    let count = (data.len() - PARAMS_LEN).min(4096);
    let chunk = &data[..PARAMS_LEN + count];
    let (wire, dtype) = (params.wire, params.dtype);
    let size = dtype.size();
    let mut out = vec![0u8; count * size];
    quant::dequantize(wire, dtype, chunk, &mut out).expect("a valid header decodes");

    // Every value inside the range the header announces; NaN and infinities only in
    // chunks flagged as holding them.
    let (min, max) = (params.min, params.max);
    let (lo, hi) = match (wire, params.algorithm) {
        (WireType::U8 | WireType::I8, QuantAlgorithm::MinMax) => (min, max),
        (WireType::U8 | WireType::I8, _) => (min.min(0.0), max.max(0.0)),
        _ => {
            let r = min.abs().max(max.abs());
            (-r, r)
        }
    };
    let int_wire = matches!(wire, WireType::U8 | WireType::I8);
    for v in out.chunks_exact(size).map(|b| value_at(dtype, b)) {
        if v.is_finite() {
            assert!(
                lo <= v && v <= hi,
                "{v:e} outside [{lo:e}, {hi:e}] for {params:?}"
            );
        } else {
            // 8-bit float formats have NaN (and E5M2 infinity) codes of their own.
            assert!(
                params.nonfinite || !int_wire,
                "{v} from a chunk without the flag"
            );
        }
    }

    // A receiver expecting other codes or another dtype refuses the chunk untouched.
    let other = WireType::ALL[(WireType::ALL.iter().position(|w| *w == wire).unwrap() + 1) % 4];
    let mut untouched = vec![0xA5u8; out.len()];
    assert!(matches!(
        quant::dequantize(other, dtype, chunk, &mut untouched),
        Err(CoreError::Protocol(_))
    ));
    assert!(untouched.iter().all(|&b| b == 0xA5));

    // The fused kernels against decode-then-reduce, with the codes reused as `x`.
    let op = ReduceOp::ALL[usize::from(data[PARAMS_LEN..].first().copied().unwrap_or(0)) % 5];
    let x: Vec<u8> = (0..out.len())
        .map(|i| data[PARAMS_LEN + i % count.max(1)])
        .collect();
    let mut want = vec![0u8; out.len()];
    reduce::reduce(dtype, op, &mut want, &out, &x).unwrap();
    let mut acc = vec![0u8; out.len()];
    quant::dequantize_reduce(wire, dtype, op, chunk, &x, &mut acc).unwrap();
    assert_eq!(
        acc, want,
        "dequantize_reduce differs from dequantize + reduce"
    );
    let mut want = x.clone();
    reduce::reduce_inplace(dtype, op, &mut want, &out).unwrap();
    let mut acc = x;
    quant::dequantize_reduce_inplace(wire, dtype, op, chunk, &mut acc).unwrap();
    assert_eq!(acc, want, "dequantize_reduce_inplace differs");
}

// ---------------------------------------------------------------------------------------
// The receiving side of a ring all-reduce (`ring/links.rs`, `ring/allreduce.rs`)
// ---------------------------------------------------------------------------------------

/// What the previous peer sends on the receiving lanes of one op, interleaved.
///
/// Eight knob bytes pick the op (world 2..=4, rank, dtype, operator, element count
/// 0..=255, piece size, quantization, 1..=3 lanes, piece limit). Then a sequence of
/// events: a byte naming a lane, followed by the next thing that lane reads: a 28-byte
/// header when it is idle, the piece's payload when one is in flight. This is what each
/// lane's reader task does (decode and size-check the header, ask the op where the
/// piece goes, refused for another descriptor digest, read the payload there, hand it
/// over), with the lanes' reads interleaved
/// arbitrarily. The op must never hand out memory that another lane is still writing,
/// never count a piece twice, and complete only once every piece arrived.
pub fn ring_receive(data: &[u8]) {
    ring_receive_counts(data);
}

/// The op that [`ring_receive`]'s first knob bytes describe, and its element count.
fn knob_spec(knobs: &[u8; 8]) -> (ReduceSpec, usize) {
    let world = 2 + usize::from(knobs[0] % 3);
    let dtype = DType::ALL[usize::from(knobs[1] % 12)];
    let op = ReduceOp::ALL[usize::from(knobs[1] / 12) % 5];
    let quant = match knobs[4] % 9 {
        0 => None,
        k => Some((
            [QuantAlgorithm::MinMax, QuantAlgorithm::ZeroPointScale][usize::from(k - 1) / 4],
            WireType::ALL[usize::from(k - 1) % 4],
        )),
    }
    .filter(|_| dtype.is_float() && matches!(op, ReduceOp::Sum | ReduceOp::Avg));
    let spec = ReduceSpec {
        op_id: OP,
        rank: usize::from(knobs[0] / 3) % world,
        world,
        dtype,
        op,
        piece_bytes: (1 + usize::from(knobs[3] % 64)) * dtype.size(),
        quant,
    };
    (spec, usize::from(knobs[2]))
}

/// [`ring_receive`], returning how many pieces landed out of how many the op has.
fn ring_receive_counts(data: &[u8]) -> (u64, u64) {
    let Some((knobs, mut events)) = data.split_first_chunk::<8>() else {
        return (0, 0);
    };
    let (spec, count) = knob_spec(knobs);
    let (dtype, piece_bytes) = (spec.dtype, spec.piece_bytes);
    let lanes = 1 + usize::from(knobs[5] % 3);
    // Usually room for a quantized piece; sometimes exactly the raw piece size.
    let max_piece = if knobs[6] & 1 == 0 {
        quant::quantized_len(piece_bytes)
    } else {
        piece_bytes
    };
    let input: Vec<u8> = (0..count * dtype.size())
        .map(|i| knobs[7].wrapping_add(i as u8))
        .collect();
    let (ptr, len) = (input.as_ptr(), input.len());
    // SAFETY: the Vec's heap buffer lives in the keep-alive box, unmodified.
    let mem = Arc::new(unsafe { OpMemory::new(ptr, len, Box::new(input), None) });
    let rx = Receiver::new(spec, mem, max_piece).expect("a valid op");
    let (steps, pieces) = rx.shape();
    let total = (steps * pieces) as u64;

    // Per lane: the piece in flight, with where its payload goes.
    let mut in_flight: Vec<Option<(PieceHeader, *mut u8, usize)>> = vec![None; lanes];
    let mut seen = std::collections::HashSet::new();
    while let Some((&which, rest)) = events.split_first() {
        let lane = usize::from(which) % lanes;
        let outcome: CoreResult<()> = match in_flight[lane] {
            None => {
                let Some((h, rest)) = rest.split_first_chunk::<HEADER_LEN>() else {
                    break;
                };
                events = rest;
                PieceHeader::parse(h, max_piece).and_then(|h| {
                    if h.op != OP {
                        // Another op: it never starts here (the reader waits, then fails).
                        return Err(CoreError::Protocol("unknown op".into()));
                    }
                    let landing = rx.landing(h.step, h.piece, h.len, h.digest);
                    // Another descriptor is refused before anything else is checked.
                    assert_eq!(
                        matches!(landing, Err(CoreError::InvalidUsage(_))),
                        h.digest != rx.digest()
                    );
                    let (ptr, n) = landing?;
                    assert_eq!(n, h.len as usize);
                    for (other, p, m) in in_flight.iter().flatten() {
                        let disjoint = ptr as usize + n <= *p as usize
                            || *p as usize + m <= ptr as usize
                            || n == 0
                            || *m == 0;
                        assert!(
                            disjoint,
                            "piece {}/{} was handed memory that piece {}/{} is being \
                             written to",
                            h.step, h.piece, other.step, other.piece
                        );
                    }
                    in_flight[lane] = Some((h, ptr, n));
                    Ok(())
                })
            }
            Some((h, ptr, n)) => {
                let Some((payload, rest)) = rest.split_at_checked(n) else {
                    break;
                };
                events = rest;
                // SAFETY: `landing` handed this lane `n` bytes at `ptr`, alive as long
                // as the receiver.
                unsafe { std::ptr::copy_nonoverlapping(payload.as_ptr(), ptr, n) };
                in_flight[lane] = None;
                assert!(seen.insert((h.step, h.piece)), "a piece landed twice");
                rx.landed(h.step, h.piece)
            }
        };
        match outcome {
            Ok(()) => {}
            // The links are poisoned (the op's own failure, for another descriptor).
            Err(CoreError::Protocol(_) | CoreError::InvalidUsage(_)) => break,
            Err(e) => panic!("unexpected error kind: {e:?}"),
        }
        assert_eq!(rx.landed_count(), seen.len() as u64);
        assert!(rx.landed_count() <= total);
    }
    (rx.landed_count(), total)
}

// ---------------------------------------------------------------------------------------
// Shared-state transfers and bandwidth probes (`net/transfer.rs`)
// ---------------------------------------------------------------------------------------

const KEYS: [(&str, usize); 3] = [("a", 5), ("", 0), ("weights", 300)];

fn content(key: &str, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8) ^ key.len() as u8).collect()
}

/// Source side. Knobs: unused, the read size. The rest is the fetcher's requests.
/// Every complete request gets exactly its answer, in order.
pub fn transfer_serve(data: &[u8]) {
    let Some((_, step, input)) = knobs(data) else {
        return;
    };
    let registry = TransferRegistry::default();
    for (key, len) in KEYS {
        let bytes = content(key, len);
        let (ptr, n) = (bytes.as_ptr(), bytes.len());
        // SAFETY: the Vec's heap buffer lives in the keep-alive box, unmodified.
        registry.serve(key.to_string(), unsafe {
            Served::new(ptr, n, Box::new(bytes))
        });
    }
    let mut script = Script::new(input, read_step(step));
    let got = block_on(transfer::serve(
        &registry,
        &mut script,
        Duration::from_secs(5),
    ));
    // Replay the requests by the rules and compare the answers.
    let mut want = Vec::new();
    let mut rest = input;
    let mut bad = false; // a request without a range, or a key that is not UTF-8
    while let Some((body, next)) = split_frame(rest, 4096) {
        if body.len() < 16 {
            bad = true;
            break;
        }
        let offset = u64::from_be_bytes(body[..8].try_into().unwrap());
        let len = u64::from_be_bytes(body[8..16].try_into().unwrap());
        let Ok(key) = std::str::from_utf8(&body[16..]) else {
            bad = true;
            break;
        };
        match KEYS.iter().find(|(k, _)| *k == key) {
            Some(&(k, n)) => match offset.checked_add(len).filter(|&e| e <= n as u64) {
                Some(end) => {
                    want.push(0);
                    want.extend_from_slice(&(n as u64).to_be_bytes());
                    want.extend_from_slice(&content(k, n)[offset as usize..end as usize]);
                }
                None => want.push(2),
            },
            None => want.push(1),
        }
        rest = next;
    }
    assert_eq!(script.written, want);
    // What stopped the replay: EOF (nothing left), a bad request, an oversized one, or
    // a truncated one (prefix or body).
    let declared = rest
        .get(..4)
        .map(|p| u32::from_be_bytes(p.try_into().unwrap()) as usize);
    match got {
        Ok(()) => assert!(!bad && rest.is_empty(), "served past a bad request"),
        Err(CoreError::Protocol(_)) => assert!(bad || declared.unwrap() > 4096),
        Err(CoreError::PeerConnection(_)) => {
            // A truncated length prefix, or a truncated request body.
            assert!(!bad && !rest.is_empty() && declared.is_none_or(|n| n <= 4096));
        }
        Err(e) => panic!("unexpected error kind: {e:?}"),
    }
    let served: u64 = want.len() as u64;
    assert!(registry.bytes_sent() <= served);
}

/// Fetcher side. Knobs: the destination length (0..=255), the read size. The rest is
/// the source's answer. Success only for the exact announced length, with the bytes.
pub fn transfer_fetch(data: &[u8]) {
    let Some((len, step, input)) = knobs(data) else {
        return;
    };
    let mut dst = vec![0u8; usize::from(len)];
    let landed = std::sync::atomic::AtomicU64::new(0);
    let mut script = Script::new(input, read_step(step));
    let got = block_on(transfer::fetch(
        &mut script,
        "weights",
        0,
        dst.len() as u64,
        &mut dst,
        Duration::from_secs(5),
        &landed,
    ));
    let mut request = Script::new(&[], 1);
    let body = cat(&[
        &0u64.to_be_bytes(),
        &(dst.len() as u64).to_be_bytes(),
        b"weights",
    ]);
    block_on(write_frame(&mut request, &body)).unwrap();
    assert_eq!(
        script.written, request.written,
        "the request is the range and the key"
    );
    match got {
        Ok(digests) => {
            assert_eq!(input[0], 0);
            assert_eq!(input[1..9], (dst.len() as u64).to_be_bytes());
            assert_eq!(dst[..], input[9..9 + dst.len()]);
            assert_eq!(
                crate::hash::root_of_digests(&digests, dst.len()),
                Some(crate::hash::content_hash(&dst)),
                "hashed while landing"
            );
            assert_eq!(landed.into_inner(), dst.len() as u64, "every byte counted");
        }
        Err(CoreError::PeerConnection(_)) => {
            assert!(landed.into_inner() <= dst.len() as u64);
        }
        Err(CoreError::InvalidUsage(_)) => {
            let announced = input
                .get(1..9)
                .map(|b| u64::from_be_bytes(b.try_into().unwrap()));
            assert!(input[0] == 2 || announced != Some(dst.len() as u64));
        }
        Err(CoreError::Protocol(_)) => assert!(input[0] > 2),
        Err(e) => panic!("unexpected error kind: {e:?}"),
    }
}

/// Fetcher side of a pipelined batch of three whole tensors, "a", "bb" and "ccc".
/// Knobs: the first one's length (the others: half and a third of it), the read size.
/// The rest is the source's replies. Every request goes out, in order, whatever comes
/// back; each item's outcome is what reading the replies in order gives (data only with
/// the exact announced length; a refusal fails that item alone; anything else fails
/// it and every later one); the stream is reported in step exactly when nothing broke.
pub fn transfer_fetch_many(data: &[u8]) {
    let Some((len, step, input)) = knobs(data) else {
        return;
    };
    let keys = ["a", "bb", "ccc"];
    let lens = [usize::from(len), usize::from(len) / 2, usize::from(len) / 3];
    let mut dsts: Vec<Vec<u8>> = lens.iter().map(|&n| vec![0u8; n]).collect();
    let landed = std::sync::atomic::AtomicU64::new(0);
    let mut script = Script::new(input, read_step(step));
    let mut items: Vec<transfer::Wanted<'_>> = keys
        .iter()
        .zip(dsts.iter_mut())
        .map(|(key, dst)| transfer::Wanted { key, dst })
        .collect();
    let (results, in_step) = block_on(transfer::fetch_many(
        &mut script,
        &mut items,
        Duration::from_secs(5),
        &landed,
    ));
    drop(items);
    let mut request = Script::new(&[], 1);
    for (key, n) in keys.iter().zip(lens) {
        block_on(write_frame(
            &mut request,
            &range_request(0, n as u64, key.as_bytes()),
        ))
        .unwrap();
    }
    assert_eq!(script.written, request.written, "all requests, in order");
    assert_eq!(results.len(), 3);
    let (mut at, mut broken) = (0usize, false);
    for ((result, dst), n) in results.iter().zip(&dsts).zip(lens) {
        if broken {
            assert!(result.is_err(), "nothing after a broken reply");
            continue;
        }
        let announced = input
            .get(at + 1..at + 9)
            .map(|b| u64::from_be_bytes(b.try_into().unwrap()));
        match input.get(at) {
            Some(1) | Some(2) => {
                assert!(result.is_err(), "a refusal fails its item");
                at += 1;
            }
            Some(0) if announced == Some(n as u64) && input.len() >= at + 9 + n => {
                let digests = result.as_ref().expect("a whole reply is data");
                assert_eq!(dst[..], input[at + 9..at + 9 + n]);
                assert_eq!(
                    crate::hash::root_of_digests(digests, n),
                    Some(crate::hash::content_hash(dst)),
                    "hashed while landing"
                );
                at += 9 + n;
            }
            _ => {
                assert!(result.is_err());
                broken = true;
            }
        }
    }
    assert_eq!(in_step, !broken);
    let total: usize = lens.iter().sum();
    assert!(landed.into_inner() <= total as u64);
}

/// Both ends of a bandwidth probe. Knobs: the listener's byte limit (`k * 8`), the
/// read size. The listener counts the rest as probe data and must answer exactly that
/// count or refuse past the limit; the prober reads the rest as the listener's answer.
pub fn probe(data: &[u8]) {
    let Some((limit, step, input)) = knobs(data) else {
        return;
    };
    let limit = u64::from(limit) * 8;
    let mut script = Script::new(input, read_step(step));
    let got = block_on(transfer::absorb_probe(
        &mut script,
        limit,
        Duration::from_secs(5),
    ));
    let n = input.len() as u64;
    match got {
        Ok(()) => {
            assert!(n <= limit);
            assert_eq!(script.written, n.to_be_bytes());
        }
        Err(CoreError::Protocol(_)) => {
            assert!(n > limit);
            assert!(script.written.is_empty());
        }
        Err(e) => panic!("unexpected error kind: {e:?}"),
    }
    let mut script = Script::new(input, read_step(step));
    let rate = block_on(transfer::run_probe(
        &mut script,
        Duration::ZERO,
        0,
        Duration::from_secs(5),
    ));
    assert!(script.shut_down);
    match rate {
        Ok(r) => assert!(input.len() >= 8 && r >= 0.0),
        Err(CoreError::PeerConnection(_)) => assert!(input.len() < 8),
        Err(e) => panic!("unexpected error kind: {e:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// Targets and valid inputs
// ---------------------------------------------------------------------------------------

/// A fuzz entry point: takes any bytes, panics on a violated invariant.
pub type Entry = fn(&[u8]);

/// Every entry point, by the name of its cargo-fuzz target.
pub const TARGETS: [(&str, Entry); 10] = [
    ("frames", frames),
    ("handshake_accept", handshake_accept),
    ("handshake_dial", handshake_dial),
    ("piece_header", piece_header),
    ("quant_chunk", quant_chunk),
    ("ring_receive", ring_receive),
    ("transfer_serve", transfer_serve),
    ("transfer_fetch", transfer_fetch),
    ("transfer_fetch_many", transfer_fetch_many),
    ("probe", probe),
];

fn framed(body: &[u8]) -> Vec<u8> {
    let mut out = (body.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(body);
    out
}

fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

/// The body of a transfer request for bytes `offset..offset + len` of `key`.
fn range_request(offset: u64, len: u64, key: &[u8]) -> Vec<u8> {
    cat(&[&offset.to_be_bytes(), &len.to_be_bytes(), key])
}

/// A dialer message for `hello` with `nonce_d` and an all-zero MAC (no secret).
fn dialer_message(hello: StreamHello, nonce_d: [u8; 16]) -> Vec<u8> {
    cat(&[
        MAGIC,
        &VERSION.to_be_bytes(),
        &hello.from.to_be_bytes(),
        &hello.to.to_be_bytes(),
        &hello.epoch.to_be_bytes(),
        &hello.stream.to_be_bytes(),
        &hello.pool.to_be_bytes(),
        &[hello.purpose as u8],
        &nonce_d,
        &[0u8; 32],
    ])
}

/// The eight knob bytes of [`ring_receive`] for an op.
#[allow(clippy::too_many_arguments)]
fn ring_knobs(
    world: usize,
    rank: usize,
    dtype: DType,
    op: ReduceOp,
    count: u8,
    piece_elems: u8,
    quant: Option<(usize, usize)>,
    lanes: u8,
) -> [u8; 8] {
    [
        (world - 2 + 3 * rank) as u8,
        dtype as u8 + 12 * op as u8,
        count,
        piece_elems - 1,
        quant.map_or(0, |(alg, wire)| (1 + alg * 4 + wire) as u8),
        lanes - 1,
        0,
        3,
    ]
}

/// A complete, valid piece stream for the op `knobs` describe: every (step, piece) in
/// order, piece `p` on lane `p % lanes`, quantized payloads made by the real encoder.
fn ring_stream(knobs: [u8; 8]) -> Vec<u8> {
    // The very op `ring_receive` decodes from these knobs.
    let (spec, count) = knob_spec(&knobs);
    let (dtype, quant, piece_bytes) = (spec.dtype, spec.quant, spec.piece_bytes);
    let lanes = 1 + usize::from(knobs[5] % 3);
    let len = count * dtype.size();
    // A receiver of the same shape tells the wire length of every piece.
    let probe_mem = vec![0u8; len];
    let (ptr, n) = (probe_mem.as_ptr(), probe_mem.len());
    // SAFETY: the Vec's heap buffer lives in the keep-alive box, unmodified.
    let probe = Arc::new(unsafe { OpMemory::new(ptr, n, Box::new(probe_mem), None) });
    let rx = Receiver::new(spec, probe, quant::quantized_len(piece_bytes)).expect("valid op");
    let (steps, pieces) = rx.shape();
    let mut out = knobs.to_vec();
    for step in 0..steps {
        for p in 0..pieces {
            let wire = rx.wire_len(step, p);
            let payload = match quant {
                None => (0..wire).map(|i| (i * 7 + step) as u8 & 0x3F).collect(),
                Some((alg, w)) => {
                    let count = wire - PARAMS_LEN;
                    let one = match dtype {
                        DType::F16 => half::f16::from_f32(0.5 + p as f32).to_le_bytes().to_vec(),
                        DType::BF16 => half::bf16::from_f32(1.5).to_le_bytes().to_vec(),
                        DType::F32 => (step as f32 - 1.25).to_le_bytes().to_vec(),
                        _ => 3.0f64.to_le_bytes().to_vec(),
                    };
                    let src = one.repeat(count);
                    let mut q = vec![0u8; wire];
                    quant::quantize(alg, w, dtype, &src, &mut q).unwrap();
                    q
                }
            };
            let header = PieceHeader {
                op: OP,
                step: step as u32,
                piece: p as u32,
                len: wire as u32,
                digest: rx.digest(),
            };
            out.push((p % lanes) as u8);
            out.extend_from_slice(&header.encode());
            out.push((p % lanes) as u8);
            out.extend_from_slice(&payload);
        }
    }
    out
}

/// Valid (and nearly valid) inputs of a target: the starting points of the fuzz corpus
/// and the bases the proptests mutate.
pub fn seeds(target: &str) -> Vec<Vec<u8>> {
    let all = 0x80u8; // read size knob: everything at once
    match target {
        "frames" => vec![
            cat(&[
                &[64, all],
                &framed(b"hello"),
                &framed(b""),
                &framed(&[7; 100]),
            ]),
            cat(&[&[3, 1], &framed(b"abcdef"), &framed(b"1234567")]),
            cat(&[&[0, 2], &framed(b""), &[0, 0]]),
        ],
        "handshake_accept" => {
            let msg = framed(&dialer_message(HELLO, [9; 16]));
            let transfer = StreamHello {
                purpose: Purpose::Transfer,
                stream: 3,
                ..HELLO
            };
            vec![
                cat(&[&[0, all], &msg]),
                cat(&[&[0, 5], &framed(&dialer_message(transfer, [1; 16]))]),
                cat(&[&[1, all], &msg]),
                cat(&[&[2, 3], &msg]),
            ]
        }
        "handshake_dial" => {
            let challenge = framed(&cat(&[MAGIC, &VERSION.to_be_bytes(), &[4; 16]]));
            let ok = framed(&cat(&[&[handshake::STATUS_OK], &[0; 32]]));
            let refused = framed(&cat(&[&[handshake::STATUS_WRONG_PEER], &[0; 32]]));
            vec![
                cat(&[&[0, all], &challenge, &ok]),
                cat(&[&[0, 7], &challenge, &refused]),
                cat(&[&[1, all], &challenge, &ok]),
            ]
        }
        "piece_header" => {
            let h = PieceHeader {
                op: OP,
                step: 1,
                piece: 2,
                len: 4096,
                digest: 0x1234_5678,
            };
            vec![
                cat(&[&h.encode(), &(1u32 << 20).to_be_bytes()]),
                cat(&[&h.encode(), &100u32.to_be_bytes()]),
                h.encode().to_vec(),
            ]
        }
        "quant_chunk" => {
            let mut out = Vec::new();
            let values = [1.5f32, -2.0, 0.25, 3.0, f32::NAN, f32::INFINITY, -7.0, 0.0];
            for (i, alg) in [QuantAlgorithm::MinMax, QuantAlgorithm::ZeroPointScale]
                .into_iter()
                .enumerate()
            {
                for (j, wire) in WireType::ALL.into_iter().enumerate() {
                    let dtype = DType::ALL[(i + j) % 4];
                    // Flagged chunks (NaN, infinity) for every other combination.
                    let vals = &values[..if j % 2 == 0 { 4 } else { 8 }];
                    let src: Vec<u8> = vals
                        .iter()
                        .flat_map(|&v| match dtype {
                            DType::F16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
                            DType::BF16 => half::bf16::from_f32(v).to_le_bytes().to_vec(),
                            DType::F32 => v.to_le_bytes().to_vec(),
                            _ => f64::from(v).to_le_bytes().to_vec(),
                        })
                        .collect();
                    let mut q = vec![0u8; quant::quantized_len(vals.len())];
                    quant::quantize(alg, wire, dtype, &src, &mut q).unwrap();
                    out.push(q);
                }
            }
            out
        }
        "ring_receive" => vec![
            ring_stream(ring_knobs(2, 0, DType::F32, ReduceOp::Sum, 8, 2, None, 2)),
            ring_stream(ring_knobs(3, 1, DType::I32, ReduceOp::Max, 7, 3, None, 1)),
            ring_stream(ring_knobs(
                3,
                2,
                DType::F16,
                ReduceOp::Avg,
                12,
                2,
                Some((0, 0)),
                2,
            )),
            ring_stream(ring_knobs(
                4,
                3,
                DType::F32,
                ReduceOp::Sum,
                9,
                4,
                Some((1, 2)),
                3,
            )),
            ring_stream(ring_knobs(
                2,
                1,
                DType::F64,
                ReduceOp::Avg,
                5,
                5,
                Some((1, 3)),
                1,
            )),
            ring_stream(ring_knobs(2, 0, DType::U8, ReduceOp::Prod, 0, 1, None, 1)),
        ],
        "transfer_serve" => vec![
            cat(&[
                &[0, all],
                &framed(&range_request(0, 5, b"a")),
                &framed(&range_request(0, 1, b"nope")),
                &framed(&range_request(2, 3, b"a")),
                &framed(&range_request(4, 2, b"a")),
                &framed(&range_request(100, 200, b"weights")),
            ]),
            cat(&[
                &[0, 3],
                &framed(&range_request(0, 0, b"")),
                &framed(b"a"),
                &[0, 0],
            ]),
        ],
        "transfer_fetch" => vec![
            cat(&[&[5, all], &[0], &5u64.to_be_bytes(), b"12345"]),
            cat(&[&[0, 2], &[0], &0u64.to_be_bytes()]),
            cat(&[&[9, all], &[1]]),
            cat(&[&[9, all], &[2]]),
            cat(&[&[9, all], &[7]]),
        ],
        "transfer_fetch_many" => vec![
            cat(&[
                &[6, all],
                &[0],
                &6u64.to_be_bytes(),
                b"123456",
                &[0],
                &3u64.to_be_bytes(),
                b"abc",
                &[0],
                &2u64.to_be_bytes(),
                b"xy",
            ]),
            cat(&[&[6, 3], &[0], &6u64.to_be_bytes(), b"123456", &[1], &[2]]),
            cat(&[&[9, all], &[1], &[0], &4u64.to_be_bytes(), b"abcd", &[7]]),
            cat(&[&[9, all], &[0], &9u64.to_be_bytes(), b"abc"]),
            cat(&[&[9, 1], &[0], &8u64.to_be_bytes()]),
        ],
        "probe" => vec![
            cat(&[&[255, all], &[0; 100]]),
            cat(&[&[1, 3], &7u64.to_be_bytes()]),
        ],
        _ => panic!("no fuzz target named {target:?}"),
    }
}

#[cfg(test)]
mod tests;
