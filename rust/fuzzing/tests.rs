//! The fuzz entry points under plain `cargo test` (no cargo-fuzz, stable): random bytes
//! and mutated valid inputs, a bounded number of cases each; a real dialer against a
//! real listener through a tampering relay; and the regression inputs fuzzing found.

use super::*;
use proptest::collection::vec;
use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const CASES: u32 = 400;

/// One edit of a valid input; positions wrap around its length.
#[derive(Clone, Debug)]
enum Edit {
    Flip(usize, u8),
    Set(usize, u8),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
    Truncate(usize),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        4 => (any::<usize>(), 1..=255u8).prop_map(|(i, x)| Edit::Flip(i, x)),
        2 => (any::<usize>(), prop::sample::select(vec![0u8, 1, 2, 0x7F, 0x80, 0xFF]))
            .prop_map(|(i, x)| Edit::Set(i, x)),
        1 => (any::<usize>(), vec(any::<u8>(), 1..8)).prop_map(|(i, b)| Edit::Insert(i, b)),
        1 => (any::<usize>(), 1..8usize).prop_map(|(i, n)| Edit::Remove(i, n)),
        1 => any::<usize>().prop_map(Edit::Truncate),
    ]
}

fn apply(mut v: Vec<u8>, edits: Vec<Edit>) -> Vec<u8> {
    for e in edits {
        let n = v.len();
        match e {
            Edit::Flip(i, x) if n > 0 => v[i % n] ^= x,
            Edit::Set(i, x) if n > 0 => v[i % n] = x,
            Edit::Insert(i, b) => {
                let at = i % (n + 1);
                v.splice(at..at, b);
            }
            Edit::Remove(i, k) if n > 0 => {
                let at = i % n;
                v.drain(at..(at + k).min(n));
            }
            Edit::Truncate(i) => v.truncate(i % (n + 1)),
            _ => {}
        }
    }
    v
}

/// A valid input of `target` with one to four edits.
fn mutated(target: &str) -> impl Strategy<Value = Vec<u8>> {
    (prop::sample::select(seeds(target)), vec(edit(), 1..5)).prop_map(|(v, e)| apply(v, e))
}

macro_rules! fuzz_props {
    ($($target:ident),* $(,)?) => {$(
        mod $target {
            use super::*;
            proptest! {
                #![proptest_config(ProptestConfig { cases: CASES, ..ProptestConfig::default() })]

                #[test]
                fn random_bytes(data in vec(any::<u8>(), 0..600)) {
                    super::super::$target(&data);
                }

                #[test]
                fn mutated_valid(data in mutated(stringify!($target))) {
                    super::super::$target(&data);
                }
            }

            #[test]
            fn valid_seeds() {
                for seed in seeds(stringify!($target)) {
                    super::super::$target(&seed);
                }
            }
        }
    )*};
}

fuzz_props!(
    frames,
    handshake_accept,
    handshake_dial,
    piece_header,
    quant_chunk,
    ring_receive,
    transfer_serve,
    transfer_fetch,
    transfer_fetch_many,
    probe,
);

#[test]
fn every_target_has_seeds() {
    for (name, entry) in TARGETS {
        assert!(!seeds(name).is_empty(), "{name}");
        entry(&[]);
    }
}

// ---- the valid inputs reach the deep paths -----------------------------------------------

#[test]
fn valid_ring_streams_complete_the_op() {
    for seed in seeds("ring_receive") {
        let (landed, total) = ring_receive_counts(&seed);
        assert!(total > 0);
        assert_eq!(landed, total, "knobs {:?}", &seed[..8]);
    }
}

#[test]
fn valid_handshakes_are_accepted() {
    for seed in &seeds("handshake_accept")[..2] {
        let mut s = Script::new(&seed[2..], read_step(seed[1]));
        block_on(handshake::accept(&mut s, None, 2)).unwrap();
    }
    let seed = &seeds("handshake_dial")[0];
    let mut s = Script::new(&seed[2..], usize::MAX);
    block_on(handshake::dial(&mut s, None, HELLO)).unwrap();
}

// ---- regressions ----------------------------------------------------------------------

/// The descriptor digest of the op that `knobs` describe, read as `ring_receive` does.
fn knob_digest(knobs: &[u8]) -> u32 {
    let (spec, count) = knob_spec(knobs.try_into().expect("8 knob bytes"));
    spec.digest(count * spec.dtype.size())
}

/// The previous peer announces the same piece on two lanes before sending either
/// payload. Both lanes used to be handed the same destination (two tasks writing one
/// buffer) and the piece counted twice, so an op could complete with another piece
/// never received.
#[test]
fn a_piece_announced_on_two_lanes_is_refused() {
    let knobs = ring_knobs(2, 0, DType::F32, ReduceOp::Sum, 8, 2, None, 2);
    let header = PieceHeader {
        op: OP,
        step: 0,
        piece: 0,
        len: 8,
        digest: knob_digest(&knobs),
    };
    let input = cat(&[
        &knobs,
        &[0],
        &header.encode(),
        &[1],
        &header.encode(),
        &[0],
        &[1; 8],
    ]);
    ring_receive(&input);
    // The same with the quantized wire format.
    let knobs = ring_knobs(3, 0, DType::F16, ReduceOp::Sum, 12, 2, Some((0, 0)), 2);
    let header = PieceHeader {
        len: quant::quantized_len(2) as u32,
        digest: knob_digest(&knobs),
        ..header
    };
    let input = cat(&[&knobs, &[0], &header.encode(), &[1], &header.encode()]);
    ring_receive(&input);
}

/// The input cargo-fuzz found for the bug above (`ring_receive`, after about 4.3
/// million runs): F32 SUM over two peers on two lanes, with piece 1/0 announced on both
/// lanes while the first copy is still in flight. Its headers carry the op's descriptor
/// digest since the header grew one (28 bytes); the events are the same.
const RING_DUPLICATE_PIECE: [u8; 154] = [
    0x00, 0x02, 0x08, 0x01, 0x00, 0x01, 0x00, 0x03, 0x00, 0x50, 0x43, 0x43, 0x4c, 0x00, 0x00, 0x00,
    0x00, 0x00, 0x00, 0x00, 0x07, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    0x08, 0xdb, 0x2e, 0x34, 0x35, 0x00, 0x00, 0x07, 0x0e, 0x15, 0x1c, 0x23, 0x2a, 0x32, 0x05, 0x50,
    0x43, 0x43, 0x4c, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x07, 0x00, 0x00, 0x00, 0x00, 0x00,
    0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x08, 0xdb, 0x2e, 0x34, 0x35, 0x01, 0x00, 0x07, 0x0e, 0x15,
    0x1c, 0x23, 0x2a, 0x31, 0x00, 0x50, 0x43, 0x43, 0x4c, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    0x07, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x08, 0xdb, 0x2e, 0x34,
    0x35, 0x01, 0x50, 0x43, 0x43, 0x4c, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x07, 0x00, 0x00,
    0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x08, 0xdb, 0x2e, 0x34, 0x35, 0x01, 0x00,
    0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x1d, 0x24, 0x2b, 0x32,
];

#[test]
fn fuzz_found_duplicate_piece_is_refused() {
    ring_receive(&RING_DUPLICATE_PIECE);
    // It is refused at the second announcement, before any payload of it is read.
    let (landed, total) = ring_receive_counts(&RING_DUPLICATE_PIECE);
    assert_eq!(landed, 2, "the two pieces of step 0 land");
    assert!(landed < total);
}

// ---- a real dialer and listener through a tampering relay --------------------------------

/// Copies `from` to `to`, XOR-ing the byte at offset `at.0` with `at.1`, until EOF or
/// an error; then closes `to`.
async fn relay<R, W>(mut from: R, mut to: W, at: Option<(usize, u8)>)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = [0u8; 64];
    let mut offset = 0;
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some((i, x)) = at {
            if (offset..offset + n).contains(&i) {
                buf[i - offset] ^= x;
            }
        }
        offset += n;
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

/// Bytes each direction carries in a successful handshake.
const TO_LISTENER: usize = 4 + DIALER_LEN;
const TO_DIALER: usize = 4 + CHALLENGE_LEN + 4 + REPLY_LEN;

/// `dial` and `accept` over in-memory pipes, both bounded by a (paused-clock) timeout
/// like the node's handshake timeout, with one byte tampered in one direction.
fn relayed(
    secret: Option<&'static [u8]>,
    to_listener: bool,
    at: usize,
    x: u8,
) -> (CoreResult<()>, CoreResult<StreamHello>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async move {
        let (mut d, d_relay) = tokio::io::duplex(256);
        let (l_relay, mut l) = tokio::io::duplex(256);
        let (from_d, to_d) = tokio::io::split(d_relay);
        let (from_l, to_l) = tokio::io::split(l_relay);
        let limit = Duration::from_secs(5);
        let dialer = async move {
            let r = tokio::time::timeout(limit, handshake::dial(&mut d, secret, HELLO)).await;
            drop(d);
            r.unwrap_or_else(|_| Err(CoreError::PeerConnection("timed out".into())))
        };
        let listener = async move {
            let r = tokio::time::timeout(limit, handshake::accept(&mut l, secret, 2)).await;
            drop(l);
            r.unwrap_or_else(|_| Err(CoreError::PeerConnection("timed out".into())))
        };
        let tamper = Some((at, x));
        let (dr, lr, (), ()) = tokio::time::timeout(Duration::from_secs(60), async {
            tokio::join!(
                dialer,
                listener,
                relay(from_d, to_l, if to_listener { tamper } else { None }),
                relay(from_l, to_d, if to_listener { None } else { tamper }),
            )
        })
        .await
        .expect("everything ends within the handshake timeout");
        (dr, lr)
    })
}

#[test]
fn untampered_relay_handshakes() {
    for secret in [None, Some(SECRET)] {
        let (d, l) = relayed(secret, true, usize::MAX, 1);
        d.unwrap();
        assert_eq!(l.unwrap(), HELLO);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// With a secret, no single tampered byte gets a stream accepted on both ends, and
    /// the listener never accepts an identity the dialer did not send. Without one, any
    /// outcome is allowed but both ends finish within their timeouts.
    #[test]
    fn tampered_handshakes_fail_closed(
        with_secret: bool,
        to_listener: bool,
        at in 0..TO_LISTENER.max(TO_DIALER),
        x in 1..=255u8,
    ) {
        let secret = with_secret.then_some(SECRET);
        let (d, l) = relayed(secret, to_listener, at, x);
        if secret.is_some() {
            if let Ok(hello) = &l {
                prop_assert_eq!(*hello, HELLO);
            }
            let reached = at < if to_listener { TO_LISTENER } else { TO_DIALER };
            prop_assert!(!(reached && d.is_ok() && l.is_ok()), "tampering went unnoticed");
        }
        for e in [d.err(), l.err()].into_iter().flatten() {
            prop_assert!(matches!(
                e,
                CoreError::Protocol(_) | CoreError::PeerConnection(_) | CoreError::Authentication(_)
            ), "{:?}", e);
        }
    }
}

/// Writes the seed corpus of the cargo-fuzz targets, `fuzz/seeds/<target>/`:
/// `cargo test --lib write_fuzz_seeds -- --ignored`.
#[test]
#[ignore = "writes files; run by hand when the seeds change"]
fn write_fuzz_seeds() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds");
    for (name, _) in TARGETS {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        for (i, seed) in seeds(name).iter().enumerate() {
            std::fs::write(dir.join(format!("seed-{i}")), seed).unwrap();
        }
    }
}
