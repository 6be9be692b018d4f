//! Tests of the secure transport over in-memory pipes and loopback TCP: round trips of
//! every suite (and REKEY against snow's), the identities and secrets a handshake
//! accepts or refuses (with the error each side sees), and records tampered with on the
//! path (flipped, replayed, dropped, reordered, injected, truncated, cut).

use super::handshake::*;
use super::noise::*;
use super::stream::*;
use super::*;
use crate::error::{CoreError, CoreResult};
use crate::net::identity::{self, fingerprint_hex, Identity, PublicKey};
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};
use std::future::Future;
use std::io;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{duplex, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};
use tokio::net::{TcpListener, TcpStream};

const HS_TIMEOUT: Duration = Duration::from_secs(10);
const PROLOGUE: &[u8] = b"pccl-test p2p v1";

/// Every test runs under this limit.
async fn within<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(120), f)
        .await
        .expect("test timed out")
}

fn random_bytes(rng: &mut StdRng, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rng.fill_bytes(&mut v);
    v
}

async fn handshake_pair(
    dial_psk: Option<[u8; 32]>,
    accept_psk: Option<[u8; 32]>,
    dial_prologue: &[u8],
    accept_prologue: &[u8],
) -> (
    CoreResult<SecureStream<DuplexStream>>,
    CoreResult<SecureStream<DuplexStream>>,
) {
    let (a, b) = duplex(1 << 16);
    tokio::join!(
        secure_dial(a, dial_psk.as_ref(), dial_prologue, HS_TIMEOUT),
        secure_accept(b, accept_psk.as_ref(), accept_prologue, HS_TIMEOUT),
    )
}

/// Writes `data` in random chunks with random flushes, then ends the stream.
async fn send_all<W: AsyncWrite + Unpin>(mut w: W, data: Vec<u8>, seed: u64) -> W {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut pos = 0;
    while pos < data.len() {
        let max = if rng.random_bool(0.5) { 100 } else { 3 << 20 };
        let n = rng.random_range(1..=max).min(data.len() - pos);
        w.write_all(&data[pos..pos + n]).await.unwrap();
        pos += n;
        if rng.random_bool(0.3) {
            w.flush().await.unwrap();
        }
    }
    w.shutdown().await.unwrap();
    w
}

/// Reads to the authenticated end of stream in random-size reads.
async fn recv_all<R: AsyncRead + Unpin>(mut r: R, seed: u64) -> io::Result<Vec<u8>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = rng.random_range(1..=buf.len());
        let got = r.read(&mut buf[..n]).await?;
        if got == 0 {
            return Ok(out);
        }
        out.extend_from_slice(&buf[..got]);
    }
}

/// Random payload of 1 byte, a few bytes, and several MiB.
fn payload(seed: u64) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed);
    let n = match seed % 3 {
        0 => 1,
        1 => rng.random_range(1..70_000),
        _ => rng.random_range(3 << 20..6 << 20),
    };
    random_bytes(&mut rng, n)
}

async fn exchange<R1, W1, R2, W2>(
    (r1, w1): (SecureReadHalf<R1>, SecureWriteHalf<W1>),
    (r2, w2): (SecureReadHalf<R2>, SecureWriteHalf<W2>),
    seed: u64,
) where
    R1: AsyncRead + Unpin,
    W1: AsyncWrite + Unpin,
    R2: AsyncRead + Unpin,
    W2: AsyncWrite + Unpin,
{
    let (to2, to1) = (payload(seed), payload(seed + 1));
    let (_, _, got2, got1) = tokio::join!(
        send_all(w1, to2.clone(), seed + 2),
        send_all(w2, to1.clone(), seed + 3),
        recv_all(r2, seed + 4),
        recv_all(r1, seed + 5),
    );
    assert!(got2.unwrap() == to2, "1 -> 2 differs");
    assert!(got1.unwrap() == to1, "2 -> 1 differs");
}

#[tokio::test]
async fn round_trip_random_sizes_both_ways_on_split_halves_over_duplex() {
    within(async {
        for seed in [1u64, 10, 20] {
            let psk = psk_from_secret(b"hunter2");
            let (d, a) = handshake_pair(Some(psk), Some(psk), PROLOGUE, PROLOGUE).await;
            exchange(d.unwrap().into_split(), a.unwrap().into_split(), seed).await;
        }
        // Single bytes, and without a PSK.
        let (d, a) = handshake_pair(None, None, PROLOGUE, PROLOGUE).await;
        let (mut d, mut a) = (d.unwrap(), a.unwrap());
        d.write_all(b"x").await.unwrap();
        d.flush().await.unwrap();
        let mut one = [0u8; 1];
        a.read_exact(&mut one).await.unwrap();
        assert_eq!(&one, b"x");
        a.write_all(b"y").await.unwrap();
        a.shutdown().await.unwrap();
        d.read_exact(&mut one).await.unwrap();
        assert_eq!(&one, b"y");
        assert_eq!(
            d.read(&mut one).await.unwrap(),
            0,
            "authenticated end of stream"
        );
    })
    .await
}

/// Records arriving 100 bytes at a time: every attempt to read one straight into the
/// caller's (large) buffer gets part of it, moves that into the stream's own buffer
/// and finishes it there.
#[tokio::test]
async fn records_trickling_in_are_read_whole_into_large_buffers() {
    within(async {
        let psk = psk_from_secret(b"trickle");
        let (a, b) = duplex(100);
        let (d, acc) = tokio::join!(
            secure_dial(a, Some(&psk), PROLOGUE, HS_TIMEOUT),
            secure_accept(b, Some(&psk), PROLOGUE, HS_TIMEOUT),
        );
        let (mut d, mut acc) = (d.unwrap(), acc.unwrap());
        let data = random_bytes(&mut StdRng::seed_from_u64(9), 300_000);
        let sent = data.clone();
        let writer = tokio::spawn(async move {
            d.write_all(&sent).await.unwrap();
            d.shutdown().await.unwrap();
            d
        });
        let mut got = vec![0u8; data.len()];
        acc.read_exact(&mut got).await.unwrap();
        assert!(got == data, "the bytes differ");
        let mut rest = vec![0u8; MAX_RECORD + 1];
        assert_eq!(acc.read(&mut rest).await.unwrap(), 0, "authenticated end");
        drop(writer.await.unwrap());
    })
    .await
}

#[tokio::test]
async fn round_trip_over_loopback_tcp() {
    within(async {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let psk = psk_from_secret(b"a shared secret");
        let accept = async {
            let (s, _) = listener.accept().await.unwrap();
            secure_accept(s, Some(&psk), PROLOGUE, HS_TIMEOUT)
                .await
                .unwrap()
                .into_split()
        };
        let dial = async {
            let s = TcpStream::connect(addr).await.unwrap();
            let (r, w) = s.into_split();
            secure_dial_split(r, w, Some(&psk), PROLOGUE, HS_TIMEOUT)
                .await
                .unwrap()
        };
        let (a, d) = tokio::join!(accept, dial);
        exchange(d, a, 77).await;
    })
    .await
}

#[test]
fn rekey_is_noises_and_matches_snows() {
    let mut d = Handshake::new(true, Auth::ephemeral(None), PROLOGUE, SUITE).unwrap();
    let mut a = Handshake::new(false, Auth::ephemeral(None), PROLOGUE, SUITE).unwrap();
    let m2 = a.on_frame(&d.hello().unwrap()).unwrap().unwrap();
    let m3 = d.on_frame(&m2).unwrap().unwrap();
    let verdict = a.on_frame(&m3).unwrap().unwrap();
    assert!(d.on_frame(&verdict).unwrap().is_none());
    let (_, keys, _) = d.into_parts().unwrap();
    let (mut snow_side, _, _) = a.into_parts().unwrap();
    let (mut send, _) = keys.unwrap();
    let mut record = [0u8; 64];
    let mut out = [0u8; 64];
    for n in 0..5u64 {
        let len = send.seal(n, b"records", &mut record).unwrap();
        let got = snow_side.read_message(n, &record[..len], &mut out).unwrap();
        assert_eq!(&out[..got], b"records");
        send.rekey();
        snow_side.rekey_incoming();
    }
    // Without the other end's rekey, the next record does not open.
    let len = send.seal(5, b"records", &mut record).unwrap();
    send.rekey();
    let len2 = send.seal(6, b"records", &mut record[..]).unwrap();
    assert_eq!(len, len2);
    assert!(snow_side
        .read_message(5, &record[..len2], &mut out)
        .is_err());
}

#[tokio::test]
async fn every_cipher_and_provider_round_trips() {
    within(async {
        for cipher in [Cipher::AesGcm, Cipher::ChaChaPoly] {
            for provider in [Provider::Ring, Provider::RustCrypto] {
                // (A key change every 3 records, where this module seals them.)
                let suite = Suite {
                    cipher,
                    provider,
                    rekey_every: 3,
                };
                let (a, b) = duplex(1 << 16);
                let ((ar, aw), (br, bw)) = (tokio::io::split(a), tokio::io::split(b));
                let psk = psk_from_secret(b"s");
                let (d, a) = tokio::join!(
                    secure_split_with(
                        Joined {
                            read: ar,
                            write: aw
                        },
                        true,
                        Some(&psk),
                        PROLOGUE,
                        HS_TIMEOUT,
                        suite
                    ),
                    secure_split_with(
                        Joined {
                            read: br,
                            write: bw
                        },
                        false,
                        Some(&psk),
                        PROLOGUE,
                        HS_TIMEOUT,
                        suite
                    ),
                );
                exchange(d.unwrap(), a.unwrap(), 5).await;
            }
        }
    })
    .await
}

fn assert_auth(r: CoreResult<SecureStream<DuplexStream>>, side: &str) {
    match r {
        Err(CoreError::Authentication(m)) => assert!(m.contains("secure handshake"), "{m}"),
        other => panic!("{side}: expected an authentication error, got {other:?}"),
    }
}

/// A run key, and identities it certified (or not) for tests.
struct Run {
    seed: [u8; 32],
}

impl Run {
    fn new() -> Run {
        Run {
            seed: rand::random(),
        }
    }
    fn anchors(&self) -> Vec<PublicKey> {
        vec![identity::run_public(&self.seed)]
    }
    /// A node certified by `by`, trusting it, for `groups`, valid in `window`
    /// (seconds around now).
    fn node(&self, by: &Run, groups: &[&str], window: (i64, i64)) -> Arc<Identity> {
        let key = identity::NodeKey::generate();
        let now = identity::now_secs() as i64;
        let groups: Vec<String> = groups.iter().map(|g| g.to_string()).collect();
        let cert = identity::Cert::sign(
            &by.seed,
            *key.public(),
            "test",
            &groups,
            (now + window.0) as u64,
            (now + window.1) as u64,
        )
        .unwrap();
        Identity::new(key, Some(cert), by.anchors()).unwrap()
    }
}

fn auth(id: &Arc<Identity>, group: &'static str, expect: Option<PublicKey>) -> Auth {
    Auth {
        identity: id.clone(),
        psk: Some(psk_from_secret(b"0123456789abcdef0123456789abcdef")),
        also: Vec::new(),
        group,
        expect,
    }
}

async fn pair_as(
    dialer: Auth,
    acceptor: Auth,
) -> (
    CoreResult<SecureStream<DuplexStream>>,
    CoreResult<SecureStream<DuplexStream>>,
) {
    let (a, b) = duplex(1 << 16);
    tokio::join!(
        secure_dial_as(a, &dialer, PROLOGUE, HS_TIMEOUT),
        secure_accept_first(b, None, &acceptor, PROLOGUE, HS_TIMEOUT),
    )
}

fn identity_refused(r: CoreResult<SecureStream<DuplexStream>>, needle: &str, side: &str) {
    match r {
        Err(CoreError::Identity(m)) => assert!(m.contains(needle), "{side}: {m}"),
        other => panic!("{side}: expected an identity error, got {other:?}"),
    }
}

#[tokio::test]
async fn certified_nodes_learn_each_other_and_carry_data() {
    within(async {
        let run = Run::new();
        let peer = run.node(&run, &["peer"], (-10, 3600));
        let master = run.node(&run, &["master"], (-10, 3600));
        let (d, a) = pair_as(
            auth(&peer, identity::GROUP_MASTER, Some(*master.key().public())),
            auth(&master, identity::GROUP_PEER, None),
        )
        .await;
        let (d, a) = (d.unwrap(), a.unwrap());
        assert_eq!(&d.remote().key, master.key().public());
        assert_eq!(&a.remote().key, peer.key().public());
        assert_eq!(
            a.remote().cert.as_ref().unwrap().groups,
            vec!["peer".to_string()]
        );
        exchange(d.into_split(), a.into_split(), 11).await;
    })
    .await
}

#[tokio::test]
async fn wrong_identities_are_refused_naming_the_fingerprint_on_both_sides() {
    within(async {
        let run = Run::new();
        let other_run = Run::new();
        let good = run.node(&run, &["peer"], (-10, 3600));
        // The dialer pins a key the acceptor does not hold (someone stands in).
        let stand_in = run.node(&run, &["peer"], (-10, 3600));
        let (d, a) = pair_as(
            auth(&good, identity::GROUP_PEER, Some(*good.key().public())),
            auth(&stand_in, identity::GROUP_PEER, None),
        )
        .await;
        let fp = fingerprint_hex(stand_in.key().public());
        identity_refused(d, &fp, "dialer");
        identity_refused(a, "refused our identity", "acceptor");
        // Certified by another run (self-signed, as far as this run knows), expired,
        // for the wrong group, revoked: the acceptor refuses, the dialer hears why.
        let foreign = {
            let key = identity::NodeKey::generate();
            let now = identity::now_secs();
            let cert = identity::Cert::sign(
                &other_run.seed,
                *key.public(),
                "intruder",
                &["peer".to_string()],
                now - 10,
                now + 3600,
            )
            .unwrap();
            // (It checks nobody: it is the one being refused.)
            Identity::new(key, Some(cert), Vec::new()).unwrap()
        };
        let expired = run.node(&run, &["peer"], (-7200, -3600));
        let master = run.node(&run, &["master"], (-10, 3600));
        for (who, needle) in [
            (&foreign, "not trusted"),
            (&expired, "expired"),
            (&master, "not as a peer"),
        ] {
            let (d, a) = pair_as(
                auth(who, identity::GROUP_PEER, None),
                auth(&good, identity::GROUP_PEER, None),
            )
            .await;
            let fp = fingerprint_hex(who.key().public());
            identity_refused(a, &fp, "acceptor");
            identity_refused(d, needle, "dialer");
        }
        let list = identity::Denylist::sign(
            &run.seed,
            1,
            identity::now_secs(),
            &[identity::fingerprint(stand_in.key().public())],
        )
        .unwrap();
        assert!(good.install_denylist(&list).unwrap());
        let (d, a) = pair_as(
            auth(&stand_in, identity::GROUP_PEER, None),
            auth(&good, identity::GROUP_PEER, None),
        )
        .await;
        identity_refused(a, "revoked", "acceptor");
        identity_refused(d, "revoked", "dialer");
    })
    .await
}

#[test]
fn a_low_order_ephemeral_key_fails_the_handshake() {
    for point in [[0u8; 32], {
        let mut one = [0u8; 32];
        one[0] = 1;
        one
    }] {
        let mut acceptor = Handshake::new(false, Auth::ephemeral(None), PROLOGUE, SUITE).unwrap();
        let mut hello = HELLO_MAGIC.to_vec();
        hello.extend_from_slice(&[0, SUITE.cipher.wire()]);
        hello.extend_from_slice(&point);
        let err = acceptor.on_frame(&hello).unwrap_err();
        assert!(
            matches!(err.error, CoreError::PeerConnection(_)),
            "{:?}",
            err.error
        );
    }
}

#[tokio::test]
async fn wrong_psk_is_an_authentication_error_on_both_sides() {
    within(async {
        let (d, a) = handshake_pair(
            Some(psk_from_secret(b"one")),
            Some(psk_from_secret(b"two")),
            PROLOGUE,
            PROLOGUE,
        )
        .await;
        assert_auth(d, "dialer");
        assert_auth(a, "acceptor");
    })
    .await
}

/// A handshake between a dialer holding `dial` secrets and an acceptor holding
/// `accept` (each: the current one first, then older ones of a rotation); then one
/// message each way over the session.
async fn rotation_pair(dial: &[&[u8]], accept: &[&[u8]]) -> (CoreResult<()>, CoreResult<()>) {
    let auth = |s: &[&[u8]]| Auth {
        also: s[1..].iter().map(|x| psk_from_secret(x)).collect(),
        ..Auth::ephemeral(Some(&psk_from_secret(s[0])))
    };
    let (a, b) = duplex(1 << 16);
    let (dial, accept) = (auth(dial), auth(accept));
    let (d, acc) = tokio::join!(
        secure_dial_as(a, &dial, PROLOGUE, HS_TIMEOUT),
        secure_accept_first(b, None, &accept, PROLOGUE, HS_TIMEOUT),
    );
    match (d, acc) {
        (Ok(mut d), Ok(mut acc)) => {
            d.write_all(b"ping").await.unwrap();
            d.flush().await.unwrap();
            let mut got = [0u8; 4];
            acc.read_exact(&mut got).await.unwrap();
            assert_eq!(&got, b"ping");
            (Ok(()), Ok(()))
        }
        (d, acc) => (d.map(|_| ()), acc.map(|_| ())),
    }
}

#[tokio::test]
async fn during_a_rotation_any_secret_both_hold_is_agreed_on() {
    within(async {
        let (old, new): (&[u8], &[u8]) = (b"the old secret", b"the new secret");
        for (dial, accept) in [
            (vec![new, old], vec![old]), // rotated dialer, not yet rotated acceptor
            (vec![old], vec![new, old]), // the other way round
            (vec![new, old], vec![new, old]), // both rotated: the new one
            (vec![new], vec![new, old]), // the old one retired at the dialer
        ] {
            let (d, a) = rotation_pair(&dial, &accept).await;
            assert!(d.is_ok() && a.is_ok(), "{d:?} {a:?}");
        }
        // No secret in common: an authentication error at both ends, by name.
        let (d, a) = rotation_pair(&[new], &[old]).await;
        match d {
            Err(CoreError::Authentication(m)) => {
                assert!(m.contains("none of the shared secrets we offered"), "{m}")
            }
            other => panic!("{other:?}"),
        }
        match a {
            Err(CoreError::Authentication(m)) => {
                assert!(m.contains("none of the 1 shared secret(s)"), "{m}")
            }
            other => panic!("{other:?}"),
        }
    })
    .await
}

#[test]
fn a_hello_offering_more_secrets_than_allowed_is_garbage() {
    let psk = psk_from_secret(b"k");
    for count in [MAX_PSKS as u8 + 1, 3] {
        let mut acceptor =
            Handshake::new(false, Auth::ephemeral(Some(&psk)), PROLOGUE, SUITE).unwrap();
        let mut hello = HELLO_MAGIC.to_vec();
        hello.extend_from_slice(&[count, SUITE.cipher.wire()]);
        hello.extend_from_slice(&[0u8; PSK_ID_LEN]); // fewer ids than the count says
        let err = acceptor.on_frame(&hello).unwrap_err();
        assert!(
            matches!(err.error, CoreError::PeerConnection(_)),
            "{:?}",
            err.error
        );
    }
}

#[tokio::test]
async fn psk_on_one_side_only_fails_on_both_sides() {
    within(async {
        let psk = Some(psk_from_secret(b"one"));
        for (dp, ap) in [(psk, None), (None, psk)] {
            let (d, a) = handshake_pair(dp, ap, PROLOGUE, PROLOGUE).await;
            assert_auth(d, "dialer");
            assert_auth(a, "acceptor");
        }
    })
    .await
}

#[tokio::test]
async fn different_prologue_fails_the_handshake() {
    within(async {
        for psk in [Some(psk_from_secret(b"one")), None] {
            let (d, a) = handshake_pair(psk, psk, b"pccl p2p v1", b"pccl p2p v2").await;
            assert_auth(d, "dialer");
            assert_auth(a, "acceptor");
        }
    })
    .await
}

#[tokio::test]
async fn garbage_and_silence_fail_the_handshake() {
    within(async {
        let (mut a, b) = duplex(1 << 16);
        a.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        match secure_accept(b, None, PROLOGUE, HS_TIMEOUT).await {
            Err(CoreError::PeerConnection(m)) => assert!(m.contains("garbage"), "{m}"),
            other => panic!("{other:?}"),
        }
        let (_a, b) = duplex(1 << 16);
        let t = std::time::Instant::now();
        match secure_accept(b, None, PROLOGUE, Duration::from_millis(200)).await {
            Err(CoreError::PeerConnection(m)) => assert!(m.contains("did not finish"), "{m}"),
            other => panic!("{other:?}"),
        }
        assert!(t.elapsed() < Duration::from_secs(5));
    })
    .await
}

#[test]
fn psk_from_secret_is_hkdf_sha256() {
    // RFC 5869, test case 1 (first 32 bytes of the OKM).
    let ikm = [0x0bu8; 22];
    let salt: Vec<u8> = (0x00..=0x0c).collect();
    let info: Vec<u8> = (0xf0..=0xf9).collect();
    let okm = hkdf_sha256_32(&salt, &ikm, &info);
    let hex: String = okm.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(
        hex,
        "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf"
    );
    assert_ne!(psk_from_secret(b"a"), psk_from_secret(b"b"));
    assert_eq!(psk_from_secret(b"a"), psk_from_secret(b"a"));
}

// -----------------------------------------------------------------------------------
// A man in the middle that relays frames (handshake frames and records share the
// u32 length prefix) and may tamper with them.

enum Act {
    Frame(Vec<u8>),
    Raw(Vec<u8>),
    Close,
}

type Tamper = Box<dyn FnMut(usize, Vec<u8>) -> Vec<Act> + Send>;

fn pass() -> Tamper {
    Box::new(|_, f| vec![Act::Frame(f)])
}

async fn relay<R, W>(mut r: R, mut w: W, mut tamper: Tamper, seen: Arc<Mutex<Vec<u8>>>)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut i = 0;
    'frames: loop {
        let mut h = [0u8; 4];
        if r.read_exact(&mut h).await.is_err() {
            break;
        }
        let mut body = vec![0u8; u32::from_be_bytes(h) as usize];
        if r.read_exact(&mut body).await.is_err() {
            break;
        }
        {
            let mut s = seen.lock().unwrap();
            s.extend_from_slice(&h);
            s.extend_from_slice(&body);
        }
        for act in tamper(i, body) {
            let ok = match act {
                Act::Frame(f) => {
                    let mut bytes = (f.len() as u32).to_be_bytes().to_vec();
                    bytes.extend_from_slice(&f);
                    w.write_all(&bytes).await.is_ok()
                }
                Act::Raw(b) => w.write_all(&b).await.is_ok(),
                Act::Close => break 'frames,
            };
            if !ok {
                break 'frames;
            }
        }
        i += 1;
    }
    let _ = w.shutdown().await;
}

/// Dialer and acceptor connected through a relay; `to_acceptor` sees the dialer's
/// frames: 0 and 1 are handshake frames, records start at 2.
async fn through_mitm(
    to_acceptor: Tamper,
) -> (
    SecureStream<DuplexStream>,
    SecureStream<DuplexStream>,
    Arc<Mutex<Vec<u8>>>,
) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (d, m1) = duplex(1 << 20);
    let (m2, a) = duplex(1 << 20);
    let ((m1r, m1w), (m2r, m2w)) = (tokio::io::split(m1), tokio::io::split(m2));
    tokio::spawn(relay(m1r, m2w, to_acceptor, seen.clone()));
    tokio::spawn(relay(m2r, m1w, pass(), seen.clone()));
    let psk = psk_from_secret(b"secret");
    let (d, a) = tokio::join!(
        secure_dial(d, Some(&psk), PROLOGUE, HS_TIMEOUT),
        secure_accept(a, Some(&psk), PROLOGUE, HS_TIMEOUT),
    );
    (d.unwrap(), a.unwrap(), seen)
}

/// Sends 8 records of 1000 bytes each through a tampering relay; the acceptor must
/// fail (and keep failing) with `expect` in the message, never see a wrong byte.
/// Twice: reading 1000 bytes at a time (each record through the stream's own
/// buffer), and with room for whole records (each one read and opened in the
/// caller's buffer).
async fn tampered(tamper: impl Fn() -> Tamper, expect: &str) {
    for read_size in [1000, MAX_RECORD + 1] {
        tampered_with(tamper(), expect, read_size).await;
    }
}

async fn tampered_with(tamper: Tamper, expect: &str, read_size: usize) {
    let (mut d, mut a, _) = through_mitm(tamper).await;
    let data: Vec<u8> = (0..8000u32).map(|i| (i % 251) as u8).collect();
    let writer = tokio::spawn(async move {
        for chunk in data.chunks(1000) {
            if d.write_all(chunk).await.is_err() || d.flush().await.is_err() {
                return;
            }
        }
        let _ = d.shutdown().await;
        // Keep the dialer open until the acceptor is done.
        let mut sink = Vec::new();
        let _ = d.read_to_end(&mut sink).await;
    });
    let mut got = Vec::new();
    let mut buf = vec![0u8; read_size];
    let err = loop {
        match a.read(&mut buf).await {
            Ok(0) => panic!("tampering went unnoticed ({} bytes read)", got.len()),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => break e,
        }
    };
    let expected: Vec<u8> = (0..got.len() as u32).map(|i| (i % 251) as u8).collect();
    assert_eq!(
        got, expected,
        "bytes before the error must be the sent ones"
    );
    assert!(err.to_string().contains(expect), "{err}");
    let core = CoreError::io("reading from peer", err);
    assert!(matches!(core, CoreError::PeerConnection(_)), "{core:?}");
    // The stream stays failed.
    let again = a.read(&mut buf).await.unwrap_err();
    assert!(again.to_string().contains(expect), "{again}");
    drop(a);
    writer.await.unwrap();
}

const INTEGRITY: &str = "integrity check failed";

#[tokio::test]
async fn flipped_bit_in_a_record_is_an_integrity_error() {
    within(tampered(
        || {
            Box::new(|i, mut f| {
                if i == 4 {
                    let mid = f.len() / 2;
                    f[mid] ^= 0x10;
                }
                vec![Act::Frame(f)]
            })
        },
        INTEGRITY,
    ))
    .await
}

#[tokio::test]
async fn replayed_record_is_an_integrity_error() {
    within(tampered(
        || {
            let mut prev = Vec::new();
            Box::new(move |i, f| {
                let out = if i == 4 {
                    vec![Act::Frame(f.clone()), Act::Frame(prev.clone())]
                } else {
                    vec![Act::Frame(f.clone())]
                };
                prev = f;
                out
            })
        },
        INTEGRITY,
    ))
    .await
}

#[tokio::test]
async fn dropped_record_is_an_integrity_error() {
    within(tampered(
        || Box::new(|i, f| if i == 4 { vec![] } else { vec![Act::Frame(f)] }),
        INTEGRITY,
    ))
    .await
}

#[tokio::test]
async fn reordered_records_are_an_integrity_error() {
    within(tampered(
        || {
            let mut held = None;
            Box::new(move |i, f| match i {
                3 => {
                    held = Some(f);
                    vec![]
                }
                4 => vec![Act::Frame(f), Act::Frame(held.take().unwrap())],
                _ => vec![Act::Frame(f)],
            })
        },
        INTEGRITY,
    ))
    .await
}

#[tokio::test]
async fn injected_record_is_an_integrity_error() {
    within(tampered(
        || {
            Box::new(|i, f| {
                if i == 4 {
                    vec![Act::Frame(vec![0x5a; 1016]), Act::Frame(f)]
                } else {
                    vec![Act::Frame(f)]
                }
            })
        },
        INTEGRITY,
    ))
    .await
}

#[tokio::test]
async fn truncated_record_is_an_error() {
    within(tampered(
        || {
            Box::new(|i, f| {
                if i == 4 {
                    let mut raw = (f.len() as u32).to_be_bytes().to_vec();
                    raw.extend_from_slice(&f[..f.len() / 2]);
                    vec![Act::Raw(raw), Act::Close]
                } else {
                    vec![Act::Frame(f)]
                }
            })
        },
        INTEGRITY,
    ))
    .await
}

#[tokio::test]
async fn cut_between_records_is_an_error_not_an_end() {
    within(tampered(
        || {
            Box::new(|i, f| {
                if i == 4 {
                    vec![Act::Close]
                } else {
                    vec![Act::Frame(f)]
                }
            })
        },
        "truncated",
    ))
    .await
}

/// Whether `seen` holds 16 bytes of the counter pattern (4 consecutive big-endian
/// u32 counters below `n`), or 16 bytes of 0xA5.
fn leaks(seen: &[u8], n: u32) -> bool {
    if seen.windows(16).any(|w| w.iter().all(|&b| b == 0xA5)) {
        return true;
    }
    seen.windows(16).any(|w| {
        let c: Vec<u32> = w
            .chunks(4)
            .map(|c| u32::from_be_bytes(c.try_into().unwrap()))
            .collect();
        c[0] < n && c[1] == c[0] + 1 && c[2] == c[0] + 2 && c[3] == c[0] + 3
    })
}

#[tokio::test]
async fn known_plaintext_never_appears_on_the_wire() {
    within(async {
        let (mut d, mut a, seen) = through_mitm(pass()).await;
        let n = (1u32 << 20) / 4;
        let mut data = vec![0xA5u8; 1 << 20];
        data.extend((0..n).flat_map(|i| i.to_be_bytes()));
        assert!(leaks(&data[..1 << 20], n) && leaks(&data[1 << 20..], n));
        let sent = data.clone();
        let writer = tokio::spawn(async move {
            d.write_all(&sent).await.unwrap();
            d.shutdown().await.unwrap();
            d
        });
        let mut got = Vec::new();
        a.read_to_end(&mut got).await.unwrap();
        let _d = writer.await.unwrap();
        assert!(got == data);
        let seen = seen.lock().unwrap();
        assert!(seen.len() > data.len());
        assert!(!leaks(&seen, n), "plaintext visible on the wire");
    })
    .await
}

#[test]
fn both_aes_gcm_codes_seal_the_same_records_and_open_each_others() {
    // ring's and AWS-LC's AES-256-GCM: byte-identical records and REKEYs, so ends that
    // picked different code (by their CPUs) read each other.
    let mut rng = StdRng::seed_from_u64(41);
    let mut raw = [0u8; 32];
    rng.fill_bytes(&mut raw);
    let mut ring_key = DirKey::with(Aead::Ring, &raw).unwrap();
    let mut lc_key = DirKey::with(Aead::AwsLc, &raw).unwrap();
    assert_eq!((ring_key.aead(), lc_key.aead()), (Aead::Ring, Aead::AwsLc));
    let sizes = [0usize, 1, 15, 16, 17, 4096, MAX_PLAINTEXT];
    for (n, &len) in sizes.iter().enumerate() {
        let nonce = n as u64 * 1_000_003;
        let mut payload = vec![0u8; len];
        rng.fill_bytes(&mut payload);
        let mut by_ring = vec![0u8; len + TAG_LEN];
        let mut by_lc = vec![0u8; len + TAG_LEN];
        assert_eq!(
            ring_key.seal(nonce, &payload, &mut by_ring),
            Some(len + TAG_LEN)
        );
        assert_eq!(
            lc_key.seal(nonce, &payload, &mut by_lc),
            Some(len + TAG_LEN)
        );
        assert_eq!(by_ring, by_lc, "{len} bytes");
        for (key, record) in [(&ring_key, &by_lc), (&lc_key, &by_ring)] {
            let mut opened = record.clone();
            assert_eq!(key.open(nonce, &mut opened), Some(len));
            assert_eq!(&opened[..len], &payload[..]);
            // A flipped bit, in the text or the tag, or another nonce: refused by both.
            for at in [0, len / 2, len + TAG_LEN - 1] {
                let mut bad = record.clone();
                bad[at] ^= 0x20;
                assert_eq!(key.open(nonce, &mut bad), None, "bit at {at} of {len}");
            }
            assert_eq!(key.open(nonce + 1, &mut record.clone()), None);
        }
        // The next keys agree too (the next round seals with them).
        ring_key.rekey();
        lc_key.rekey();
    }
}

#[test]
fn the_chosen_aes_gcm_code_is_one_of_the_two() {
    // AWS-LC only where the CPU runs its wide VAES code (or PCCL_AEAD says so).
    let chosen = Aead::chosen();
    assert!(matches!(chosen, Aead::Ring | Aead::AwsLc));
    match std::env::var("PCCL_AEAD").as_deref() {
        Ok("ring") => assert_eq!(chosen, Aead::Ring),
        Ok("aws-lc") => assert_eq!(chosen, Aead::AwsLc),
        _ => {
            #[cfg(target_arch = "x86_64")]
            let wide = std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vl")
                && std::arch::is_x86_feature_detected!("vaes")
                && std::arch::is_x86_feature_detected!("vpclmulqdq");
            #[cfg(not(target_arch = "x86_64"))]
            let wide = false;
            assert_eq!(chosen == Aead::AwsLc, wide);
        }
    }
    let key = DirKey::with(chosen, &[3u8; 32]).unwrap();
    assert_eq!(key.aead(), chosen);
}
