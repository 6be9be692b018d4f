//! Throughput over loopback TCP: a clear `TcpStream` next to `_core::net::secure` streams
//! with each cipher and provider. One stream, one direction, `--mib` MiB (default 1024)
//! written in 1 MiB `write_all`s, read in 1 MiB reads.
//!
//! Usage: `cargo run --release --bin secure_bench -- [--mib N]`
//!
//! Rates are MB/s (10^6 bytes per second) of payload, handshake excluded.

use _core::net::secure::{psk_from_secret, secure_split_with, Cipher, Joined, Provider, Suite};
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

fn main() {
    let mut mib = 1024usize;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match (flag.as_str(), it.next().and_then(|v| v.parse().ok())) {
            ("--mib", Some(v)) => mib = v,
            _ => {
                eprintln!("usage: secure_bench [--mib N]");
                std::process::exit(2);
            }
        }
    }
    let bytes = mib << 20;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
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
        let psk = psk_from_secret(b"bench");
        for cipher in [Cipher::AesGcm, Cipher::ChaChaPoly] {
            for provider in [Provider::Ring, Provider::RustCrypto] {
                let suite = Suite { cipher, provider };
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
                let ((_dr, dw), (ar, _aw)) = (d.unwrap(), acc.unwrap());
                report(
                    &format!("secure {cipher:?}/{provider:?}"),
                    pump(dw, ar, bytes).await,
                );
            }
        }
    });
}
