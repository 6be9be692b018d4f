//! All-reduce throughput of the Rust ring alone (no Python), k peers in one process
//! over loopback, next to the raw loopback TCP throughput of one stream measured in
//! the same run.
//!
//! Usage: `cargo run --release --bin ring_bench -- [peers] [MiB] [lanes] [piece KiB]`

use _core::net::handshake::Purpose;
use _core::net::node::PoolKey;
use _core::net::{Node, NodeConfig};
use _core::reduce::{DType, ReduceOp};
use _core::ring::allreduce::{OpMemory, ScratchPool};
use _core::ring::{ring_all_reduce, ReduceSpec, RingLinks};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn arg(i: usize, default: usize) -> usize {
    std::env::args()
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
    let k = arg(1, 2);
    let mib = arg(2, 64);
    let lanes = arg(3, 4) as u16;
    let piece = arg(4, 1024) << 10;
    let any = "127.0.0.1:0".parse().unwrap();
    let mut nodes = Vec::new();
    for i in 0..k {
        let cfg = NodeConfig {
            peer_id: i as u64 + 1,
            secret: None,
            handshake_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
        };
        nodes.push(Node::bind(cfg, any).await.unwrap());
    }
    for i in 0..k {
        let next = &nodes[(i + 1) % k];
        nodes[i]
            .connect_pool(next.local_addr(), next.peer_id(), 1, lanes, Purpose::Ring)
            .await
            .unwrap();
    }
    let mut links = Vec::new();
    for i in 0..k {
        let next = nodes[(i + 1) % k].peer_id();
        let prev = nodes[(i + k - 1) % k].peer_id();
        let out = nodes[i]
            .take_outbound(PoolKey {
                peer: next,
                epoch: 1,
                purpose: Purpose::Ring,
            })
            .unwrap();
        let inp = nodes[i]
            .take_inbound(
                PoolKey {
                    peer: prev,
                    epoch: 1,
                    purpose: Purpose::Ring,
                },
                Duration::from_secs(5),
            )
            .await
            .unwrap();
        links.push(RingLinks::new(
            1,
            next,
            prev,
            out,
            inp,
            16 << 20,
            Duration::from_secs(30),
        ));
    }
    let bytes = mib << 20;
    let inputs: Vec<Arc<Vec<u8>>> = (0..k).map(|_| Arc::new(vec![0u8; bytes])).collect();
    let pools: Vec<_> = (0..k).map(|_| ScratchPool::new(1 << 30)).collect();
    println!(
        "loopback 1 stream: {:.2} GB/s",
        loopback_gbps(1 << 30).await
    );
    for op_id in 0..5u64 {
        let t = Instant::now();
        let mut tasks = Vec::new();
        for i in 0..k {
            let input = inputs[i].clone();
            let mem = Arc::new(unsafe {
                OpMemory::new(
                    input.as_ptr(),
                    input.len(),
                    Box::new(input.clone()),
                    Some(pools[i].clone()),
                )
            });
            let spec = ReduceSpec {
                op_id,
                rank: i,
                world: k,
                dtype: DType::F32,
                op: ReduceOp::Sum,
                piece_bytes: piece,
                quant: None,
            };
            tasks.push(tokio::spawn(ring_all_reduce(
                links[i].clone(),
                spec,
                mem,
                Default::default(),
            )));
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
