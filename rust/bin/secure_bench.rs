//! Throughput over loopback TCP: a clear `TcpStream` next to `_core::net::secure` streams
//! with each cipher and provider. One stream, one direction, `--mib` MiB (default 1024)
//! written in 1 MiB `write_all`s, read in 1 MiB reads.
//!
//! With `--streams K`: K streams at once, clear and with the default suite (what pccl's
//! ring links use), each carrying `--mib` MiB; the aggregate rate divided by K is the
//! bound on a K-peer ring's busbw on this host, clear or encrypted (every byte a ring
//! peer sends is sealed by it and opened by its neighbour on the same cores).
//!
//! With `--aead`: one core's AES-256-GCM rate at pccl's record size, as the record layer
//! calls it, for each of its two codes (ring's, AWS-LC's; which one this process picks
//! is printed first): seal, then open, of `--mib` MiB in records of the largest
//! plaintext, one JSON line per round and code. A lane of the encrypted ring seals on one core
//! and its neighbour opens on another, so `lanes x` this rate is what the lanes' AEAD
//! work allows where every lane has its cores.
//!
//! The runtime has a worker thread per core (tokio's default), so on a host with many
//! cores the K streams run in parallel as a ring's lanes do.
//!
//! Usage: `cargo run --release --bin secure_bench -- [--mib N] [--streams K] [--rounds R]
//! [--aead]`
//!
//! Rates are MB/s (10^6 bytes per second) of payload, handshake excluded.

use _core::net::secure::{
    psk_from_secret, secure_split_with, Aead, Cipher, DirKey, Joined, Provider, Suite,
    MAX_PLAINTEXT, SUITE, TAG_LEN,
};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const CHUNK: usize = 1 << 20;

async fn pump<W: AsyncWrite + Unpin, R: AsyncRead + Unpin + Send + 'static>(
    mut w: W,
    mut r: R,
    bytes: usize,
) -> Duration {
    let reader = tokio::spawn(async move {
        let mut buf = vec![0u8; CHUNK];
        let mut total = 0usize;
        loop {
            let n = r.read(&mut buf).await.expect("read");
            if n == 0 {
                return total;
            }
            total += n;
        }
    });
    let data: Vec<u8> = (0..CHUNK).map(|i| (i * 31 % 251) as u8).collect();
    let t = Instant::now();
    let mut left = bytes;
    while left > 0 {
        let n = left.min(CHUNK);
        w.write_all(&data[..n]).await.expect("write");
        left -= n;
    }
    w.shutdown().await.expect("shutdown");
    let got = reader.await.unwrap();
    let elapsed = t.elapsed();
    assert_eq!(got, bytes);
    elapsed
}

async fn tcp_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (a, b) = tokio::join!(TcpStream::connect(l.local_addr().unwrap()), l.accept());
    let (a, b) = (a.unwrap(), b.unwrap().0);
    a.set_nodelay(true).unwrap();
    b.set_nodelay(true).unwrap();
    (a, b)
}

/// A secure stream pair over loopback with `suite`: the dialer's write half and the
/// acceptor's read half (the other halves are returned too, to keep the sockets whole).
async fn secure_pair(
    suite: Suite,
) -> (
    impl AsyncWrite + Unpin + Send + 'static,
    impl AsyncRead + Unpin + Send + 'static,
    impl Send,
) {
    let psk = psk_from_secret(b"bench");
    let (a, b) = tcp_pair().await;
    let ((ar, aw), (br, bw)) = (a.into_split(), b.into_split());
    let timeout = Duration::from_secs(10);
    let (d, acc) = tokio::join!(
        secure_split_with(
            Joined {
                read: ar,
                write: aw
            },
            true,
            Some(&psk),
            b"bench",
            timeout,
            suite
        ),
        secure_split_with(
            Joined {
                read: br,
                write: bw
            },
            false,
            Some(&psk),
            b"bench",
            timeout,
            suite
        ),
    );
    let ((dr, dw), (ar, aw)) = (d.unwrap(), acc.unwrap());
    (dw, ar, (dr, aw))
}

/// `k` streams pumping `bytes` each at once; the wall time of the slowest.
async fn pump_many<W, R>(pairs: Vec<(W, R)>, bytes: usize) -> Duration
where
    W: AsyncWrite + Unpin + Send + 'static,
    R: AsyncRead + Unpin + Send + 'static,
{
    let t = Instant::now();
    let tasks: Vec<_> = pairs
        .into_iter()
        .map(|(w, r)| tokio::spawn(pump(w, r, bytes)))
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    t.elapsed()
}

/// The `--streams K` mode: K clear, then K encrypted streams at once, `rounds` times;
/// one JSON line per round and transport.
async fn many_streams(k: usize, bytes: usize, rounds: usize) {
    for round in 0..rounds {
        let mut clear = Vec::new();
        for _ in 0..k {
            clear.push(tcp_pair().await);
        }
        let t_clear = pump_many(clear, bytes).await;
        let mut secure = Vec::new();
        let mut keep = Vec::new();
        for _ in 0..k {
            let (w, r, rest) = secure_pair(SUITE).await;
            secure.push((w, r));
            keep.push(rest);
        }
        let t_secure = pump_many(secure, bytes).await;
        for (name, t) in [("clear", t_clear), ("encrypted", t_secure)] {
            let agg = (k * bytes) as f64 / t.as_secs_f64() / 1e9;
            println!(
                "{{\"transport\": \"{name}\", \"streams\": {k}, \"round\": {round}, \
                 \"bytes_per_stream\": {bytes}, \"aggregate_GBps\": {agg:.4}, \
                 \"busbw_bound_GBps\": {:.4}}}",
                agg / k as f64
            );
        }
    }
}

/// The `--aead` mode: one thread seals `bytes` of records of the largest plaintext with
/// AES-256-GCM through the record layer's key (`DirKey`), then opens them, `rounds`
/// times, with each of the two codes pccl has; one JSON line per round and code.
fn aead_rate(bytes: usize, rounds: usize) {
    let records = bytes.div_ceil(MAX_PLAINTEXT);
    let payload: Vec<u8> = (0..MAX_PLAINTEXT).map(|i| (i * 31 % 251) as u8).collect();
    // Written once before any timing: first touches fault pages in.
    let mut buf = vec![1u8; records * (MAX_PLAINTEXT + TAG_LEN)];
    println!("{{\"chosen\": \"{:?}\"}}", Aead::chosen());
    for round in 0..rounds {
        for aead in [Aead::Ring, Aead::AwsLc] {
            let key = DirKey::with(aead, &[7u8; 32]).unwrap();
            let t = Instant::now();
            for (n, rec) in buf.chunks_mut(MAX_PLAINTEXT + TAG_LEN).enumerate() {
                key.seal(n as u64, &payload, rec).unwrap();
            }
            let sealed = t.elapsed();
            let t = Instant::now();
            for (n, rec) in buf.chunks_mut(MAX_PLAINTEXT + TAG_LEN).enumerate() {
                key.open(n as u64, rec)
                    .expect("a record sealed above opens");
            }
            let opened = t.elapsed();
            let rate = |d: Duration| (records * MAX_PLAINTEXT) as f64 / d.as_secs_f64() / 1e9;
            println!(
                "{{\"aead\": \"{aead:?}\", \"round\": {round}, \"record_bytes\": \
                 {MAX_PLAINTEXT}, \"seal_GBps\": {:.4}, \"open_GBps\": {:.4}}}",
                rate(sealed),
                rate(opened)
            );
        }
    }
}

fn main() {
    let mut mib = 1024usize;
    let mut streams = 0usize;
    let mut rounds = 3usize;
    let mut aead = false;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--aead" {
            aead = true;
            continue;
        }
        match (flag.as_str(), it.next().and_then(|v| v.parse().ok())) {
            ("--mib", Some(v)) => mib = v,
            ("--streams", Some(v)) if v > 0 => streams = v,
            ("--rounds", Some(v)) if v > 0 => rounds = v,
            _ => {
                eprintln!("usage: secure_bench [--mib N] [--streams K] [--rounds R] [--aead]");
                std::process::exit(2);
            }
        }
    }
    let bytes = mib << 20;
    if aead {
        aead_rate(bytes, rounds);
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    if streams > 0 {
        rt.block_on(many_streams(streams, bytes, rounds));
        return;
    }
    rt.block_on(async {
        let report = |name: &str, t: Duration| {
            println!(
                "{name:<28} {:>9.0} MB/s  ({mib} MiB in {:.2} s)",
                bytes as f64 / t.as_secs_f64() / 1e6,
                t.as_secs_f64()
            );
        };
        let (a, b) = tcp_pair().await;
        report("clear TcpStream", pump(a, b, bytes).await);
        for cipher in [Cipher::AesGcm, Cipher::ChaChaPoly] {
            for provider in [Provider::Ring, Provider::RustCrypto] {
                let (w, r, _rest) = secure_pair(Suite {
                    cipher,
                    provider,
                    rekey_every: _core::net::secure::REKEY_INTERVAL,
                })
                .await;
                report(
                    &format!("secure {cipher:?}/{provider:?}"),
                    pump(w, r, bytes).await,
                );
            }
        }
    });
}
