//! The ring all-gather over real loopback rings: every peer ends with every peer's
//! bytes in rank order, through every lane and piece split, beside all-reduces on the
//! same links, and fails with the ring's typed errors (a dead peer, another descriptor).

use super::assembly::{loopback_ring, Ring};
use super::gather::{GatherMemory, GatherOp, GatherSpec};
use super::links::Dest;
use super::tests::{
    bounded, close_all, link_cfg, random_input, spec, start_into, stashed, until, Output,
};
use super::ReduceStats;
use crate::error::CoreError;
use crate::reduce::{DType, ReduceOp};
use std::sync::Arc;
use std::time::Duration;

fn gather_spec(op_id: u64, rank: usize, world: usize, piece_bytes: usize) -> GatherSpec {
    GatherSpec {
        op_id,
        rank,
        world,
        piece_bytes,
    }
}

/// An all-gather of `mine` on `ring`'s links into `out` (`world * mine.len()` bytes).
fn start_gather(
    ring: &Ring,
    spec: GatherSpec,
    mine: &[u8],
    out: &Arc<Output>,
) -> Result<GatherOp, CoreError> {
    // SAFETY: the output lives in the keep-alive; only this op touches it while it runs.
    unsafe { ring.start_all_gather(spec, mine, out.ptr(), Box::new(out.clone()), true) }
}

async fn run_gathers(ops: &[GatherOp]) -> Vec<Result<ReduceStats, CoreError>> {
    let tasks: Vec<_> = ops
        .iter()
        .map(|op| tokio::spawn(op.run().unwrap()))
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("the op's task panicked"));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_peer_gets_every_contribution_in_rank_order_through_any_split() {
    bounded("the all-gathers", async {
        // (world, lanes, bytes per peer, piece bytes): one piece, many, a short last
        // one, pieces larger than the slot, empty contributions.
        let cases = [
            (2, 1, 1000, 1 << 20),
            (3, 2, 1001, 24),
            (4, 3, 777, 100),
            (5, 2, 5, 2),
            (3, 1, 0, 64),
        ];
        for (i, (k, lanes, len, piece)) in cases.into_iter().enumerate() {
            let peers = loopback_ring(k, lanes, 40 + i as u64, link_cfg(Duration::from_secs(5)))
                .await
                .unwrap();
            let mine: Vec<Vec<u8>> = (0..k)
                .map(|r| random_input(DType::U8, len, 9 * r as u64 + i as u64))
                .collect();
            let outs: Vec<Arc<Output>> = (0..k).map(|_| Arc::new(Output::new(k * len))).collect();
            let ops: Vec<GatherOp> = (0..k)
                .map(|r| {
                    start_gather(&peers[r].1, gather_spec(5, r, k, piece), &mine[r], &outs[r])
                        .unwrap()
                })
                .collect();
            let stats: Vec<ReduceStats> = run_gathers(&ops)
                .await
                .into_iter()
                .map(Result::unwrap)
                .collect();
            let want: Vec<u8> = mine.concat();
            for (r, out) in outs.iter().enumerate() {
                assert!(
                    out.bytes() == want,
                    "case {i}: rank {r} gathered other bytes"
                );
            }
            // Each peer forwards world - 1 slots, each in whole pieces with a header.
            let pieces = len.div_ceil(piece).max(1);
            for (r, s) in stats.iter().enumerate() {
                let expected = ((k - 1) * (len + pieces * super::links::HEADER_LEN)) as u64;
                assert_eq!(
                    (s.tx_bytes, s.rx_bytes),
                    (expected, expected),
                    "case {i}: rank {r}"
                );
            }
            close_all(&peers).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gathers_and_all_reduces_share_the_links_and_a_late_peer_lands_stashed_pieces() {
    bounded("mixed ops", async {
        let k = 3;
        let peers = loopback_ring(k, 2, 50, link_cfg(Duration::from_secs(5)))
            .await
            .unwrap();
        let mine: Vec<Vec<u8>> = (0..k)
            .map(|r| random_input(DType::U8, 3001, 100 + r as u64))
            .collect();
        let outs: Vec<Arc<Output>> = (0..k).map(|_| Arc::new(Output::new(k * 3001))).collect();
        let inputs: Vec<Arc<Vec<u8>>> = (0..k)
            .map(|r| Arc::new(random_input(DType::F32, 999, r as u64)))
            .collect();
        let sums: Vec<Arc<Output>> = (0..k).map(|_| Arc::new(Output::new(999 * 4))).collect();
        // Ranks 0 and 1 start both ops at once; rank 2 joins once its pieces wait for it.
        let mut runs = Vec::new();
        for r in 0..2 {
            let g =
                start_gather(&peers[r].1, gather_spec(11, r, k, 256), &mine[r], &outs[r]).unwrap();
            let a = start_into(
                &peers[r].1,
                spec(12, r, k, DType::F32, ReduceOp::Sum),
                &inputs[r],
                &sums[r],
            )
            .unwrap();
            runs.push(tokio::spawn(g.run().unwrap()));
            runs.push(tokio::spawn(a.run().unwrap()));
        }
        until("pieces stashed at rank 2", || stashed(&peers[2].1) > 0).await;
        let a = start_into(
            &peers[2].1,
            spec(12, 2, k, DType::F32, ReduceOp::Sum),
            &inputs[2],
            &sums[2],
        )
        .unwrap();
        let g = start_gather(&peers[2].1, gather_spec(11, 2, k, 256), &mine[2], &outs[2]).unwrap();
        runs.push(tokio::spawn(a.run().unwrap()));
        runs.push(tokio::spawn(g.run().unwrap()));
        for run in runs {
            run.await.unwrap().unwrap();
        }
        let want = mine.concat();
        for (r, (out, sum)) in outs.iter().zip(&sums).enumerate() {
            assert!(out.bytes() == want, "rank {r}: gathered other bytes");
            assert!(
                sum.bytes() == sums[0].bytes(),
                "rank {r}: the all-reduce differs"
            );
        }
        close_all(&peers).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_size_or_an_all_reduce_under_the_same_op_id_fails_with_invalid_usage() {
    let io_timeout = Duration::from_millis(300);
    bounded("the mismatched gathers", async {
        let peers = loopback_ring(2, 1, 60, link_cfg(io_timeout)).await.unwrap();
        let outs: Vec<Arc<Output>> = (0..2).map(|_| Arc::new(Output::new(2 * 100))).collect();
        let small = Arc::new(Output::new(2 * 99));
        let g0 =
            start_gather(&peers[0].1, gather_spec(7, 0, 2, 64), &[1u8; 100], &outs[0]).unwrap();
        let g1 = start_gather(&peers[1].1, gather_spec(7, 1, 2, 64), &[2u8; 99], &small).unwrap();
        let (a, b) = tokio::join!(g0.run().unwrap(), g1.run().unwrap());
        for e in [a.unwrap_err(), b.unwrap_err()] {
            match e {
                CoreError::InvalidUsage(m) => {
                    assert!(m.contains("runs a different collective as op 7"), "{m}")
                }
                // The peer that failed first poisons the links under the other.
                CoreError::PeerConnection(_) | CoreError::Aborted(_) => {}
                other => panic!("{other:?}"),
            }
        }
        close_all(&peers).await;
        // An all-reduce and an all-gather under one op id never take each other's pieces.
        let peers = loopback_ring(2, 1, 61, link_cfg(io_timeout)).await.unwrap();
        let input = Arc::new(random_input(DType::U8, 200, 1));
        let sum = Arc::new(Output::new(200));
        let a = start_into(
            &peers[0].1,
            spec(8, 0, 2, DType::U8, ReduceOp::Sum),
            &input,
            &sum,
        )
        .unwrap();
        let g = start_gather(&peers[1].1, gather_spec(8, 1, 2, 24), &[3u8; 100], &outs[1]).unwrap();
        let (a, b) = tokio::join!(a.run().unwrap(), g.run().unwrap());
        let invalid = |e: &CoreError| matches!(e, CoreError::InvalidUsage(_));
        assert!(invalid(&a.unwrap_err()) | invalid(&b.unwrap_err()));
        close_all(&peers).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_peer_fails_the_others_with_a_peer_connection_error() {
    let io_timeout = Duration::from_millis(500);
    bounded("the dead-peer gather", async {
        let k = 4;
        let peers = loopback_ring(k, 2, 70, link_cfg(io_timeout)).await.unwrap();
        let outs: Vec<Arc<Output>> = (0..k).map(|_| Arc::new(Output::new(k * 50_000))).collect();
        let mine: Vec<Vec<u8>> = (0..k)
            .map(|r| random_input(DType::U8, 50_000, r as u64))
            .collect();
        let mut runs = Vec::new();
        for r in [0usize, 1, 3] {
            let g =
                start_gather(&peers[r].1, gather_spec(3, r, k, 4096), &mine[r], &outs[r]).unwrap();
            runs.push((r, tokio::spawn(g.run().unwrap())));
        }
        let (node, ring) = &peers[2];
        ring.close().await;
        node.close().await;
        for (r, run) in runs {
            match run.await.unwrap() {
                Err(CoreError::PeerConnection(m)) => assert!(!m.is_empty()),
                other => panic!("rank {r}: {other:?}"),
            }
            assert!(!peers[r].1.is_ok(), "rank {r}: links still usable");
        }
        for (r, (node, ring)) in peers.iter().enumerate() {
            if r != 2 {
                ring.close().await;
                node.close().await;
            }
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_op_runs_once_and_refuses_a_rank_outside_the_world() {
    bounded("the refusals", async {
        let peers = loopback_ring(2, 1, 80, link_cfg(Duration::from_secs(1)))
            .await
            .unwrap();
        let out = Arc::new(Output::new(20));
        let e = start_gather(&peers[0].1, gather_spec(1, 2, 2, 8), &[0u8; 10], &out)
            .err()
            .unwrap();
        assert!(matches!(e, CoreError::InvalidArgument(_)), "{e:?}");
        let g = start_gather(&peers[0].1, gather_spec(1, 0, 2, 8), &[0u8; 10], &out).unwrap();
        let _first = g.run().unwrap();
        assert!(matches!(g.run().err().unwrap(), CoreError::InvalidUsage(_)));
        close_all(&peers).await;
    })
    .await;
}

#[test]
fn a_lying_previous_peer_cannot_land_a_byte_outside_the_slot_it_owes() {
    // World 3, rank 0, 100-byte contributions in pieces of 40: step 0 brings slot 2
    // (bytes 200..300) as pieces of 40, 40 and 20 bytes; step 1 brings slot 1.
    let out = Arc::new(Output::new(300));
    let spec = gather_spec(9, 0, 3, 40);
    let digest = spec.digest(100);
    // SAFETY: the output lives in the keep-alive; only this receiver writes it.
    let mem = unsafe {
        GatherMemory::with_contribution(&[7u8; 100], 0, out.ptr(), 3, Box::new(out.clone()))
    }
    .unwrap();
    let rx = super::gather::receiver(spec, Arc::new(mem), 1 << 20).unwrap();
    let protocol = |r: Result<Dest, CoreError>| match r {
        Err(CoreError::Protocol(_)) => {}
        other => panic!("{other:?}"),
    };
    // Another descriptor (an all-reduce, another size): refused before a byte lands.
    assert!(matches!(
        rx.landing(0, 0, 40, digest ^ 1),
        Err(CoreError::InvalidUsage(_))
    ));
    protocol(rx.landing(2, 0, 40, digest)); // past the last step
    protocol(rx.landing(0, 3, 20, digest)); // past the last piece
    protocol(rx.landing(1, 0, 40, digest)); // step 1 before step 0
    protocol(rx.landing(0, 0, 41, digest)); // longer than the piece
    protocol(rx.landing(0, 2, 40, digest)); // the short last piece, claimed long

    // A piece as owed lands exactly in its place of slot 2, once.
    match rx.landing(0, 1, 40, digest).unwrap() {
        Dest::Direct(ptr, n) => {
            assert_eq!((ptr as usize - out.ptr() as usize, n), (240, 40));
        }
        Dest::Streamed => panic!("gather pieces land whole"),
    }
    protocol(rx.landing(0, 1, 40, digest)); // the same piece again
    assert!(rx.land_part(0, 1, 0, &[0u8; 8]).is_err()); // no streamed parts
    rx.landed(0, 1).unwrap();
    protocol(rx.landing(0, 1, 40, digest)); // landed already: out of order now

    // This peer's own slot was never offered to the sender.
    assert!(out.bytes()[..100].iter().all(|&b| b == 7));
}
