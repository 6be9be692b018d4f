//! All-reduce throughput of the Rust ring alone (no Python), k peers in one process
//! over loopback, next to the raw loopback TCP throughput of one stream measured in
//! the same run.
//!
//! Usage: `cargo run --release --bin ring_bench -- [--insecure] [peers] [MiB] [lanes]
//! [piece KiB]`; `--insecure`: clear-text p2p streams instead of the encrypted default.

use _core::reduce::{DType, ReduceOp};
use _core::ring::assembly::loopback_ring_with;
use _core::ring::{LinkConfig, ReduceSpec};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn flag(name: &str) -> bool {
    std::env::args().skip(1).any(|a| a == name)
}

fn arg(i: usize, default: usize) -> usize {
    std::env::args()
        .filter(|a| !a.starts_with("--"))
        .nth(i)
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

async fn loopback_gbps(bytes: usize) -> f64 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let reader = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0;
        while got < bytes {
            got += s.read(&mut buf).await.unwrap();
        }
    });
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let buf = vec![1u8; 1 << 20];
    let t = Instant::now();
    let mut sent = 0;
    while sent < bytes {
        s.write_all(&buf).await.unwrap();
        sent += buf.len();
    }
    reader.await.unwrap();
    bytes as f64 / t.elapsed().as_secs_f64() / 1e9
}

#[tokio::main]
async fn main() {
    if flag("--help") || flag("-h") {
        println!(
            "usage: ring_bench [--insecure] [peers=2] [MiB=64] [lanes=4] [piece KiB=1024]\n\
             all-reduce busbw of a loopback ring; p2p streams are encrypted unless --insecure"
        );
        return;
    }
    let insecure = flag("--insecure");
    let k = arg(1, 2);
    let mib = arg(2, 64);
    let lanes = arg(3, 4) as u16;
    let piece = arg(4, 1024) << 10;
    let cfg = LinkConfig {
        pool_timeout: Duration::from_secs(5),
        io_timeout: Duration::from_secs(30),
        max_piece: 16 << 20,
    };
    let peers = loopback_ring_with(k, lanes, 1, cfg, insecure)
        .await
        .unwrap();
    println!(
        "p2p streams: {}",
        if insecure {
            "clear (--insecure)"
        } else {
            "encrypted"
        }
    );
    let bytes = mib << 20;
    // Written, not just allocated: untouched zeroed memory reads as the kernel's one
    // shared zero page, which is always in cache and flatters the ring.
    let inputs: Vec<Arc<Vec<u8>>> = (0..k)
        .map(|i| {
            let one = (i as f32 + 1.0).to_le_bytes();
            Arc::new((0..bytes).map(|b| one[b % 4]).collect())
        })
        .collect();
    println!(
        "loopback 1 stream: {:.2} GB/s",
        loopback_gbps(1 << 30).await
    );
    for op_id in 0..5u64 {
        let t = Instant::now();
        let mut tasks = Vec::new();
        for (i, ((_, ring), input)) in peers.iter().zip(&inputs).enumerate() {
            let spec = ReduceSpec {
                op_id,
                rank: i,
                world: k,
                dtype: DType::F32,
                op: ReduceOp::Sum,
                piece_bytes: piece,
                quant: None,
            };
            let op = ring.start_all_reduce_shared(spec, input.clone()).unwrap();
            tasks.push(tokio::spawn(op.run().unwrap()));
        }
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        let dt = t.elapsed().as_secs_f64();
        let busbw = bytes as f64 / dt / 1e9 * 2.0 * (k as f64 - 1.0) / k as f64;
        println!(
            "k={k} {mib} MiB lanes={lanes} piece={}KiB: {:.1} ms, busbw {busbw:.2} GB/s",
            piece >> 10,
            dt * 1e3
        );
    }
}
