//! Tests of the p2p node over loopback TCP: pools dialed and filed on both ends, kept
//! transfer streams, refusals and how they are logged, encryption and its opt-out,
//! reverse pools, the reachability echo, the roster's bound, and early reverse dials.

use super::routes::route_frame;
use super::*;
use crate::net::frame::write_frame;
use crate::net::handshake::Purpose;
use crate::net::secure::Auth;
use crate::net::stream::REACH_PROLOGUE;

fn cfg(id: u64, secret: Option<&[u8]>) -> NodeConfig {
    NodeConfig {
        peer_id: id,
        secret: secret.map(|s| s.to_vec()),
        identity: Identity::ephemeral(),
        handshake_timeout: Duration::from_secs(2),
        connect_timeout: Duration::from_secs(2),
        insecure: false,
    }
}

/// A test node bound on loopback, knowing every test node's key.
async fn bound(cfg: NodeConfig) -> Arc<Node> {
    crate::testutil::known_node(cfg, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap()
}

async fn node(id: u64, secret: Option<&[u8]>) -> Arc<Node> {
    bound(cfg(id, secret)).await
}

#[tokio::test]
async fn pools_connect_and_are_filed_on_both_ends() {
    let a = node(1, Some(b"k")).await;
    let b = node(2, Some(b"k")).await;
    a.connect_pool(b.local_addr(), 2, 5, 4, Purpose::Ring)
        .await
        .unwrap();
    let key = PoolKey {
        peer: 1,
        epoch: 5,
        purpose: Purpose::Ring,
    };
    let streams = b.take_inbound(key, Duration::from_secs(2)).await.unwrap();
    assert_eq!(streams.len(), 4);
    let out = a
        .take_outbound(PoolKey {
            peer: 2,
            epoch: 5,
            purpose: Purpose::Ring,
        })
        .unwrap();
    assert_eq!(out.len(), 4);
    a.close().await;
    b.close().await;
}

/// Peers 1 (the fetcher) and 2 (the source), with a shared secret.
async fn fetcher_and_source() -> (Arc<Node>, Arc<Node>) {
    let a = node(1, Some(b"k")).await;
    let b = node(2, Some(b"k")).await;
    (a, b)
}

/// Serves `data` under `key` on `node`.
fn serve_vec(node: &Node, key: &str, data: Vec<u8>) {
    let (ptr, len) = (data.as_ptr(), data.len());
    // SAFETY: the Vec's buffer lives in the keep-alive box, unmodified.
    let served = unsafe { crate::net::transfer::Served::new(ptr, len, Box::new(data)) };
    node.transfers.serve(key.into(), served);
}

#[tokio::test]
async fn transfer_streams_are_kept_for_the_next_fetch_until_dropped() {
    use crate::net::transfer::fetch;
    let (a, b) = fetcher_and_source().await;
    let len = 3000;
    serve_vec(&b, "w", (0..len as u32).map(|i| i as u8).collect());
    let landed = AtomicU64::new(0);
    let mut dst = vec![0u8; len];
    for round in 0..3 {
        let (mut s, reused) = a.take_transfer(b.local_addr(), 2).await.unwrap();
        assert_eq!(reused, round > 0, "round {round}");
        let timeout = Duration::from_secs(2);
        fetch(&mut s, "w", 0, len as u64, &mut dst, timeout, &landed)
            .await
            .unwrap();
        a.put_transfer(b.local_addr(), 2, s);
    }
    assert_eq!(landed.into_inner(), 3 * len as u64);
    a.drop_idle_transfers();
    let (_, reused) = a.take_transfer(b.local_addr(), 2).await.unwrap();
    assert!(!reused);
    a.close().await;
    b.close().await;
}

#[tokio::test]
async fn pipelined_fetches_answer_in_order_and_refusals_keep_the_stream() {
    use crate::hash::{content_hash, root_of_digests};
    use crate::net::transfer::{fetch_many, Wanted};
    let (a, b) = fetcher_and_source().await;
    // A large tensor first, then many small ones with long keys: the requests behind
    // the large reply must not wait for it to be read (nor block it).
    let mut served = vec![("big".to_string(), vec![7u8; 9 << 20])];
    for i in 0..300u32 {
        let key = format!("{i:0>200}");
        served.push((key, (0..1000 + i).map(|j| (i + j) as u8).collect()));
    }
    for (key, data) in &served {
        serve_vec(&b, key, data.clone());
    }
    let mut dsts: Vec<Vec<u8>> = served.iter().map(|(_, d)| vec![0u8; d.len()]).collect();
    dsts.insert(2, vec![0u8; 10]);
    let mut keys: Vec<&str> = served.iter().map(|(k, _)| k.as_str()).collect();
    keys.insert(2, "nobody serves this");
    let mut items: Vec<Wanted<'_>> = keys
        .iter()
        .zip(dsts.iter_mut())
        .map(|(key, dst)| Wanted { key, dst })
        .collect();
    let landed = AtomicU64::new(0);
    let timeout = Duration::from_secs(5);
    let (mut s, _) = a.take_transfer(b.local_addr(), 2).await.unwrap();
    let (results, in_step) = fetch_many(&mut s, &mut items, timeout, &landed).await;
    drop(items);
    assert!(in_step);
    assert!(
        matches!(&results[2], Err(CoreError::PeerConnection(m)) if m.contains("does not serve"))
    );
    let ok: Vec<&Vec<u8>> = results
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 2)
        .map(|(_, r)| r.as_ref().unwrap())
        .collect();
    let dsts: Vec<&Vec<u8>> = dsts
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 2)
        .map(|(_, d)| d)
        .collect();
    for ((digests, dst), (_, data)) in ok.iter().zip(&dsts).zip(&served) {
        assert_eq!(*dst, data);
        assert_eq!(
            root_of_digests(digests, data.len()),
            Some(content_hash(data))
        );
    }
    let total: usize = served.iter().map(|(_, d)| d.len()).sum();
    assert_eq!(landed.load(Ordering::Relaxed), total as u64);
    // The stream is still in step: a plain fetch on it works.
    let mut again = vec![0u8; served[1].1.len()];
    crate::net::transfer::fetch(
        &mut s,
        &served[1].0,
        0,
        again.len() as u64,
        &mut again,
        timeout,
        &landed,
    )
    .await
    .unwrap();
    assert_eq!(again, served[1].1);
    // A source that goes away fails the items it had not delivered.
    let (mut s2, _) = a.take_transfer(b.local_addr(), 2).await.unwrap();
    b.close().await;
    let mut d1 = vec![0u8; 9 << 20];
    let mut d2 = vec![0u8; 1000];
    let mut items = vec![
        Wanted {
            key: "big",
            dst: &mut d1,
        },
        Wanted {
            key: &served[1].0,
            dst: &mut d2,
        },
    ];
    let (results, in_step) = fetch_many(&mut s2, &mut items, timeout, &landed).await;
    assert!(!in_step);
    assert!(results.iter().all(|r| r.is_err()));
    a.close().await;
}

/// Waits (bounded) for captured records containing `needle` (they are logged by the
/// listener's tasks, a moment after the dialer saw the outcome).
async fn logged(needle: &str) -> Vec<crate::py::logging::capture::Entry> {
    for _ in 0..200 {
        let got = crate::py::logging::capture::matching(needle);
        if !got.is_empty() {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("nothing was logged containing {needle:?}");
}

#[tokio::test]
async fn wrong_secret_is_refused_and_logged() {
    crate::py::logging::capture::install();
    // Peer ids no other test uses: the captured records are process-wide.
    let a = node(7101, Some(b"x")).await;
    let b = node(7102, Some(b"y")).await;
    let err = a
        .connect_pool(b.local_addr(), 7102, 1, 2, Purpose::Ring)
        .await
        .unwrap_err();
    assert!(matches!(err, CoreError::Authentication(_)));
    // (Of a pool of two, the other stream may just see the dialer hang up.)
    // The encrypted transport's handshake (keyed by the secret) fails first.
    let records = logged("peer 7102: p2p connection from").await;
    assert!(records
        .iter()
        .all(|(level, target, msg)| *level == log::Level::Warn
            && target == "_core::net::node"
            && msg.starts_with("peer 7102: p2p connection from 127.0.0.1:")
            && msg.contains("secure handshake failed")
            && msg.contains("same secret")));
    b.close().await;
    a.close().await;
}

#[tokio::test]
async fn garbage_and_huge_prefix_do_not_disturb_the_listener() {
    use tokio::io::AsyncWriteExt;
    crate::py::logging::capture::install();
    let a = node(7201, None).await;
    let b = node(7202, None).await;
    let mut s = TcpStream::connect(b.local_addr()).await.unwrap();
    s.write_all(&u32::MAX.to_be_bytes()).await.unwrap();
    let mut s2 = TcpStream::connect(b.local_addr()).await.unwrap();
    s2.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    a.connect_pool(b.local_addr(), 7202, 1, 2, Purpose::Ring)
        .await
        .unwrap();
    b.take_inbound(
        PoolKey {
            peer: 7201,
            epoch: 1,
            purpose: Purpose::Ring,
        },
        Duration::from_secs(2),
    )
    .await
    .unwrap();
    // Both strangers were refused out loud, the real streams noted quietly.
    let refused = logged("peer 7202: p2p connection from").await;
    assert!(refused
        .iter()
        .all(|(level, _, _)| *level == log::Level::Warn));
    let accepted = logged("peer 7202: accepted p2p stream").await;
    assert!(accepted
        .iter()
        .all(|(level, _, _)| *level == log::Level::Debug));
    a.close().await;
    b.close().await;
}

#[tokio::test]
async fn streams_are_encrypted_by_default_and_clear_when_both_opt_out() {
    for (insecure, secret) in [(false, Some(&b"k"[..])), (false, None), (true, None)] {
        let mut ca = cfg(1, secret);
        let mut cb = cfg(2, secret);
        (ca.insecure, cb.insecure) = (insecure, insecure);
        let a = bound(ca).await;
        let b = bound(cb).await;
        a.connect_pool(b.local_addr(), 2, 1, 2, Purpose::Ring)
            .await
            .unwrap();
        let key = |peer| PoolKey {
            peer,
            epoch: 1,
            purpose: Purpose::Ring,
        };
        let inbound = b
            .take_inbound(key(1), Duration::from_secs(2))
            .await
            .unwrap();
        let outbound = a.take_outbound(key(2)).unwrap();
        assert!(inbound
            .iter()
            .chain(&outbound)
            .all(|s| s.is_secure() != insecure));
        a.close().await;
        b.close().await;
    }
}

#[tokio::test]
async fn an_insecure_peer_and_an_encrypting_one_fail_at_once_both_ways() {
    for dialer_insecure in [true, false] {
        let mut ca = cfg(1, Some(b"k"));
        ca.insecure = dialer_insecure;
        let mut cb = cfg(2, Some(b"k"));
        cb.insecure = !dialer_insecure;
        // Far longer than the test waits: the mismatch is told, not timed out.
        ca.handshake_timeout = Duration::from_secs(30);
        cb.handshake_timeout = Duration::from_secs(30);
        let a = bound(ca).await;
        let b = bound(cb).await;
        let err = tokio::time::timeout(
            Duration::from_secs(5),
            a.connect_pool(b.local_addr(), 2, 1, 2, Purpose::Ring),
        )
        .await
        .expect("a transport mismatch must not wait for the handshake timeout")
        .unwrap_err();
        match err {
            CoreError::Authentication(m) => assert!(m.contains("clear text"), "{m}"),
            e => panic!("expected an authentication error, got {e:?}"),
        }
        a.close().await;
        b.close().await;
    }
}

#[tokio::test]
async fn take_inbound_times_out() {
    let b = node(2, None).await;
    let key = PoolKey {
        peer: 7,
        epoch: 1,
        purpose: Purpose::Ring,
    };
    let err = b
        .take_inbound(key, Duration::from_millis(50))
        .await
        .unwrap_err();
    assert!(matches!(err, CoreError::PeerConnection(_)));
    b.close().await;
}

/// Takes the ring pool of `epoch` from `sender` (peer `ids.0`) to `receiver` (peer
/// `ids.1`) at both ends and checks that data flows through it.
async fn ring_pool_carries_data(sender: &Node, receiver: &Node, ids: (u64, u64), epoch: u64) {
    let key = |peer| PoolKey {
        peer,
        epoch,
        purpose: Purpose::Ring,
    };
    let inn = receiver
        .take_inbound(key(ids.0), Duration::from_secs(2))
        .await
        .unwrap();
    let out = sender.take_outbound(key(ids.1)).unwrap();
    data_flows(out, inn).await;
}

/// Writes `msg` on every stream of `out` and reads it back on the matching stream of
/// `inn` (the data direction is the pool's, whoever opened the TCP connection).
async fn data_flows(out: Vec<P2PStream>, inn: Vec<P2PStream>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    assert_eq!(out.len(), inn.len());
    for (mut o, mut i) in out.into_iter().zip(inn) {
        o.write_all(b"through the reverse path").await.unwrap();
        o.flush().await.unwrap();
        let mut got = [0u8; 24];
        i.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"through the reverse path");
    }
}

#[tokio::test]
async fn a_reverse_pool_is_dialed_by_the_receiver_and_filed_as_usual() {
    let a = node(1, Some(b"k")).await;
    let b = node(2, Some(b"k")).await;
    let token = [7u8; TOKEN_LEN];
    // The receiver may dial back before the sender asks for the pool: parked.
    let (sent, opened) = tokio::join!(
        async {
            tokio::task::yield_now().await;
            a.connect_pool_via(Route::Reverse(token), 2, 5, 3, Purpose::Ring)
                .await
        },
        b.open_inbound(Inbound::Reverse(a.local_addr(), token), None),
    );
    sent.unwrap();
    opened.unwrap();
    ring_pool_carries_data(&a, &b, (1, 2), 5).await;
    a.close().await;
    b.close().await;
}

#[tokio::test]
async fn a_reverse_pool_with_the_wrong_token_times_out_as_a_peer_error() {
    let mut c = cfg(1, Some(b"k"));
    c.connect_timeout = Duration::from_millis(200);
    c.handshake_timeout = Duration::from_millis(300);
    let a = bound(c).await;
    let b = node(2, Some(b"k")).await;
    let (sent, opened) = tokio::join!(
        a.connect_pool_via(Route::Reverse([1; TOKEN_LEN]), 2, 5, 1, Purpose::Ring),
        b.open_inbound(Inbound::Reverse(a.local_addr(), [2; TOKEN_LEN]), None),
    );
    assert!(matches!(sent.unwrap_err(), CoreError::PeerConnection(m) if m.contains("dial back")));
    assert!(opened.is_err());
    a.close().await;
    b.close().await;
}

/// A connection to `node`'s listener that opened the master's reachability check.
async fn reach_probe(node: &Node, token: [u8; TOKEN_LEN]) -> TcpStream {
    let mut tcp = TcpStream::connect(node.local_addr()).await.unwrap();
    let mut probe = REACH_MAGIC.to_vec();
    probe.extend_from_slice(&token);
    write_frame(&mut tcp, &probe).await.unwrap();
    tcp
}

#[tokio::test]
async fn the_listener_echoes_a_reachability_token() {
    use crate::net::secure::secure_dial_as;
    use tokio::io::AsyncReadExt;
    let b = node(2, Some(b"k")).await;
    // The master asks for the key peer 2 proved on its control connection; a
    // listener holding another key fails the handshake instead of echoing.
    for (expect, echoed) in [(b.public_key(), true), ([3u8; 32], false)] {
        let tcp = reach_probe(&b, [9u8; TOKEN_LEN]).await;
        let master = Auth {
            identity: Identity::ephemeral(),
            psk: Some(crate::net::secure::psk_from_secret(b"k")),
            also: Vec::new(),
            group: crate::net::identity::GROUP_PEER,
            expect: Some(expect),
        };
        let dialed = secure_dial_as(tcp, &master, REACH_PROLOGUE, Duration::from_secs(5)).await;
        if !echoed {
            assert!(matches!(dialed, Err(CoreError::Identity(_))), "{dialed:?}");
            continue;
        }
        let mut s = dialed.unwrap();
        let mut got = [0u8; TOKEN_LEN];
        s.read_exact(&mut got).await.unwrap();
        assert_eq!(got, [9u8; TOKEN_LEN]);
    }
    b.close().await;
    // In clear text, the token comes back in clear.
    let mut c = cfg(3, None);
    c.insecure = true;
    let clear = bound(c).await;
    let mut tcp = reach_probe(&clear, [7u8; TOKEN_LEN]).await;
    let mut got = Vec::new();
    assert!(crate::net::frame::read_frame(&mut tcp, &mut got, 64)
        .await
        .unwrap());
    assert_eq!(got, [7u8; TOKEN_LEN]);
    clear.close().await;
}

#[tokio::test]
async fn the_roster_forgets_the_keys_learned_longest_ago_past_its_bound() {
    let n = node(2, Some(b"k")).await;
    let many: Vec<_> = (100..100 + MAX_ROSTER as u64 + 10)
        .map(|id| (id, [id as u8; 32]))
        .collect();
    n.set_peer_keys(&many).unwrap();
    assert_eq!(n.keys.lock().unwrap().keys.len(), MAX_ROSTER);
    // The first learned are gone (the test roster's ids among them), the last kept.
    assert!(matches!(n.expected_key(1), Err(CoreError::Identity(_))));
    assert!(matches!(n.expected_key(100), Err(CoreError::Identity(_))));
    let last = 100 + MAX_ROSTER as u64 + 9;
    assert_eq!(n.expected_key(last).unwrap(), Some([last as u8; 32]));
    n.close().await;
}

/// Opens `n` connections to `addr` that each send a reverse frame with a random
/// token, and keeps them open.
async fn strangers(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    let mut conns = Vec::with_capacity(n);
    for _ in 0..n {
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        let token: [u8; TOKEN_LEN] = rand::random();
        write_frame(&mut tcp, &route_frame(REVERSE_MAGIC, &token, 0))
            .await
            .unwrap();
        conns.push(tcp);
    }
    conns
}

/// Waits (bounded) until `node`'s parking lot holds `want` (see `parked_counts`).
async fn parked_become(node: &Node, want: (usize, usize)) {
    for _ in 0..500 {
        if node.parked_counts() == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("parked {:?}, never {want:?}", node.parked_counts());
}

#[tokio::test]
async fn a_refused_early_dial_back_is_dialed_again_and_taken_once_wanted() {
    crate::py::logging::capture::install();
    let a = node(7301, Some(b"k")).await;
    let b = node(7302, Some(b"k")).await;
    // Strangers from our address hold all of its share of the early area.
    let flood = strangers(a.local_addr(), 3 * MAX_EARLY_PER_SOURCE).await;
    parked_become(&a, (0, MAX_EARLY_PER_SOURCE)).await;
    let token = [7u8; TOKEN_LEN];
    let (sent, opened) = tokio::join!(
        async {
            // Only once b's early stream was refused (after the strangers' surplus)
            // does a ask for the link.
            let refusals = || {
                crate::py::logging::capture::matching("peer 7301: reverse p2p stream from").len()
            };
            for _ in 0..500 {
                if refusals() > 2 * MAX_EARLY_PER_SOURCE {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert!(refusals() > 2 * MAX_EARLY_PER_SOURCE);
            a.connect_pool_via(Route::Reverse(token), 7302, 5, 2, Purpose::Ring)
                .await
        },
        b.open_inbound(Inbound::Reverse(a.local_addr(), token), None),
    );
    sent.unwrap();
    opened.unwrap();
    ring_pool_carries_data(&a, &b, (7301, 7302), 5).await;
    assert_eq!(a.parked_counts(), (0, MAX_EARLY_PER_SOURCE));
    drop(flood);
    a.close().await;
    assert_eq!(a.parked_counts(), (0, 0));
    b.close().await;
}
