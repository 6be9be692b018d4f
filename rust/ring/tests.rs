//! Real rings over loopback TCP: every peer has its own node and listener, the ring is
//! assembled by `assembly.rs` exactly as for Python, and results are checked bit for
//! bit against a scalar reference that folds each chunk in the documented ring order.

use super::allreduce::{OpMemory, Receiver};
use super::assembly::{loopback_mesh, loopback_ring, Ring, RingOp};
use super::links::LinkConfig;
use super::links::{Dest, HEADER_LEN, STREAM_BLOCK};
use super::mesh::{mesh_partners, mesh_rounds};
use super::{ReduceSpec, ReduceStats};
use crate::error::CoreError;
use crate::net::node::Node;
use crate::quant::{QuantAlgorithm, WireType};
use crate::reduce::{DType, ReduceOp};
use crate::testutil::SplitMix;
use half::{bf16, f16};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// Bound on any whole test: a broken ring fails the test instead of hanging it.
const TEST_BOUND: Duration = Duration::from_secs(60);

pub(super) fn link_cfg(io_timeout: Duration) -> LinkConfig {
    LinkConfig {
        pool_timeout: Duration::from_secs(5),
        io_timeout,
        max_piece: 1 << 20,
    }
}

pub(super) async fn bounded<T>(what: &str, f: impl Future<Output = T>) -> T {
    match tokio::time::timeout(TEST_BOUND, f).await {
        Ok(v) => v,
        Err(_) => panic!("{what} did not finish within {TEST_BOUND:?}"),
    }
}

pub(super) async fn close_all(peers: &[(Arc<Node>, Ring)]) {
    for (node, ring) in peers {
        ring.close().await;
        node.close().await;
    }
}

/// `count` random elements of `dtype`: floats in [-2, 2), integers of any bits.
pub(super) fn random_input(dtype: DType, count: usize, seed: u64) -> Vec<u8> {
    let mut rng = SplitMix(seed);
    let mut out = Vec::with_capacity(count * dtype.size());
    for _ in 0..count {
        let x = rng.unit();
        match dtype {
            DType::F16 => out.extend_from_slice(&f16::from_f64(x).to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&bf16::from_f64(x).to_le_bytes()),
            DType::F32 => out.extend_from_slice(&(x as f32).to_le_bytes()),
            DType::F64 => out.extend_from_slice(&x.to_le_bytes()),
            _ => out.extend_from_slice(&rng.next().to_le_bytes()[..dtype.size()]),
        }
    }
    out
}

/// `acc op x` for one element, as the kernels document it: floats in their own
/// precision, 16-bit floats through `f32` with one rounding, integers wrapping.
fn combine(dtype: DType, op: ReduceOp, acc: &[u8], x: &[u8]) -> Vec<u8> {
    macro_rules! scalar {
        ($t:ty, $add:expr, $mul:expr, $max:expr, $min:expr) => {{
            let a = <$t>::from_le_bytes(acc.try_into().unwrap());
            let b = <$t>::from_le_bytes(x.try_into().unwrap());
            let r: $t = match op {
                ReduceOp::Sum | ReduceOp::Avg => $add(a, b),
                ReduceOp::Prod => $mul(a, b),
                ReduceOp::Max => $max(a, b),
                ReduceOp::Min => $min(a, b),
            };
            r.to_le_bytes().to_vec()
        }};
    }
    macro_rules! float {
        ($t:ty) => {
            scalar!(
                $t,
                |a: $t, b: $t| a + b,
                |a: $t, b: $t| a * b,
                |a: $t, b: $t| a.max(b),
                |a: $t, b: $t| a.min(b)
            )
        };
    }
    macro_rules! half {
        ($t:ty) => {
            scalar!(
                $t,
                |a: $t, b: $t| <$t>::from_f32(a.to_f32() + b.to_f32()),
                |a: $t, b: $t| <$t>::from_f32(a.to_f32() * b.to_f32()),
                |a: $t, b: $t| <$t>::from_f32(a.to_f32().max(b.to_f32())),
                |a: $t, b: $t| <$t>::from_f32(a.to_f32().min(b.to_f32()))
            )
        };
    }
    macro_rules! int {
        ($t:ty) => {
            scalar!(
                $t,
                |a: $t, b: $t| a.wrapping_add(b),
                |a: $t, b: $t| a.wrapping_mul(b),
                |a: $t, b: $t| a.max(b),
                |a: $t, b: $t| a.min(b)
            )
        };
    }
    match dtype {
        DType::F16 => half!(f16),
        DType::BF16 => half!(bf16),
        DType::F32 => float!(f32),
        DType::F64 => float!(f64),
        DType::I8 => int!(i8),
        DType::I16 => int!(i16),
        DType::I32 => int!(i32),
        DType::I64 => int!(i64),
        DType::U8 => int!(u8),
        DType::U16 => int!(u16),
        DType::U32 => int!(u32),
        DType::U64 => int!(u64),
    }
}

/// The average's one division by the world size (floats: true division in `f64` for
/// `f64`, else in `f32`; integers: truncating toward zero).
fn divide(dtype: DType, acc: &[u8], world: usize) -> Vec<u8> {
    macro_rules! div {
        ($t:ty, $f:expr) => {{
            let a = <$t>::from_le_bytes(acc.try_into().unwrap());
            let r: $t = $f(a);
            r.to_le_bytes().to_vec()
        }};
    }
    match dtype {
        DType::F16 => div!(f16, |a: f16| f16::from_f32(a.to_f32() / world as f32)),
        DType::BF16 => div!(bf16, |a: bf16| bf16::from_f32(a.to_f32() / world as f32)),
        DType::F32 => div!(f32, |a: f32| a / world as f32),
        DType::F64 => div!(f64, |a: f64| a / world as f64),
        DType::I8 => div!(i8, |a: i8| a / world as i8),
        DType::I16 => div!(i16, |a: i16| a / world as i16),
        DType::I32 => div!(i32, |a: i32| a / world as i32),
        DType::I64 => div!(i64, |a: i64| a / world as i64),
        DType::U8 => div!(u8, |a: u8| a / world as u8),
        DType::U16 => div!(u16, |a: u16| a / world as u16),
        DType::U32 => div!(u32, |a: u32| a / world as u32),
        DType::U64 => div!(u64, |a: u64| a / world as u64),
    }
}

/// What every peer must hold after the all-reduce of `inputs` (one per rank): chunk
/// `c` (elements `count*c/world .. count*(c+1)/world`) folded as
/// `((x_c op x_c+1) op x_c+2) ...`, then divided once for an average.
fn reference(dtype: DType, op: ReduceOp, inputs: &[Vec<u8>]) -> Vec<u8> {
    let world = inputs.len();
    let size = dtype.size();
    let count = inputs[0].len() / size;
    let mut out = vec![0u8; count * size];
    for c in 0..world {
        for i in count * c / world..count * (c + 1) / world {
            let r = i * size..(i + 1) * size;
            let mut acc = inputs[c][r.clone()].to_vec();
            for k in 1..world {
                acc = combine(dtype, op, &acc, &inputs[(c + k) % world][r.clone()]);
            }
            if op == ReduceOp::Avg {
                acc = divide(dtype, &acc, world);
            }
            out[r].copy_from_slice(&acc);
        }
    }
    out
}

pub(super) fn spec(
    op_id: u64,
    rank: usize,
    world: usize,
    dtype: DType,
    op: ReduceOp,
) -> ReduceSpec {
    ReduceSpec {
        op_id,
        rank,
        world,
        dtype,
        op,
        // Small pieces: many per chunk, striped over every lane.
        piece_bytes: 24,
        quant: None,
    }
}

/// Runs one op per peer concurrently; their outcomes in rank order.
async fn run_all(ops: &[RingOp]) -> Vec<Result<ReduceStats, CoreError>> {
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

/// Asserts that every peer ended with exactly `want` and that rank `i + 1` received
/// what rank `i` sent.
fn check(ops: &[RingOp], stats: &[ReduceStats], want: &[u8], what: &str) {
    for (rank, op) in ops.iter().enumerate() {
        assert!(
            op.result() == want,
            "{what}: rank {rank} differs from the reference"
        );
        let mut out = vec![0u8; want.len()];
        op.commit_into(&mut out).unwrap();
        assert_eq!(out, want, "{what}: rank {rank} committed other bytes");
    }
    let k = stats.len();
    for i in 0..k {
        assert_eq!(
            stats[i].tx_bytes,
            stats[(i + 1) % k].rx_bytes,
            "{what}: rank {i}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_rings_of_2_3_4_reduce_exactly_and_alike_on_every_peer() {
    // (dtype, op, elements): odd counts, some below the world size (empty chunks).
    let cases = [
        (DType::F32, ReduceOp::Sum, 1001),
        (DType::F64, ReduceOp::Avg, 333),
        (DType::BF16, ReduceOp::Sum, 257),
        (DType::F16, ReduceOp::Max, 7),
        (DType::F32, ReduceOp::Prod, 3),
        (DType::I32, ReduceOp::Sum, 999),
        (DType::I16, ReduceOp::Avg, 1),
        (DType::U8, ReduceOp::Min, 45),
        (DType::I64, ReduceOp::Prod, 5),
    ];
    bounded("the rings", async {
        for k in 2..=4usize {
            let lanes = k as u16 - 1;
            let peers = loopback_ring(k, lanes, 7, link_cfg(Duration::from_secs(10)))
                .await
                .unwrap();
            for (_, ring) in &peers {
                assert_eq!(ring.lanes(), (lanes as usize, lanes as usize));
                assert!(ring.is_ok());
            }
            // All cases in flight at once on the same links, then each checked.
            let mut started = Vec::new();
            for (c, &(dtype, op, count)) in cases.iter().enumerate() {
                let inputs: Vec<Vec<u8>> = (0..k)
                    .map(|r| random_input(dtype, count, (k * 100 + c * 10 + r) as u64))
                    .collect();
                let ops: Vec<RingOp> = peers
                    .iter()
                    .enumerate()
                    .map(|(rank, (_, ring))| {
                        let input = Arc::new(inputs[rank].clone());
                        let s = spec(c as u64, rank, k, dtype, op);
                        ring.start_all_reduce_shared(s, input).unwrap()
                    })
                    .collect();
                let runs: Vec<_> = ops
                    .iter()
                    .map(|op| tokio::spawn(op.run().unwrap()))
                    .collect();
                started.push((inputs, ops, runs));
            }
            for ((inputs, ops, runs), &(dtype, op, count)) in started.into_iter().zip(&cases) {
                let what = format!("{k} peers, {} {} x{count}", op.name(), dtype.name());
                let mut stats = Vec::new();
                for run in runs {
                    stats.push(run.await.unwrap().unwrap_or_else(|e| panic!("{what}: {e}")));
                }
                check(&ops, &stats, &reference(dtype, op, &inputs), &what);
            }
            close_all(&peers).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quantized_loopback_ring_gives_every_peer_the_same_bits() {
    bounded("the quantized ring", async {
        let k = 3;
        let peers = loopback_ring(k, 2, 1, link_cfg(Duration::from_secs(10)))
            .await
            .unwrap();
        let count = 1001;
        let inputs: Vec<Vec<u8>> = (0..k)
            .map(|r| random_input(DType::F32, count, 40 + r as u64))
            .collect();
        let ops: Vec<RingOp> = peers
            .iter()
            .enumerate()
            .map(|(rank, (_, ring))| {
                let mut s = spec(1, rank, k, DType::F32, ReduceOp::Sum);
                s.piece_bytes = 400;
                s.quant = Some((QuantAlgorithm::MinMax, WireType::U8));
                ring.start_all_reduce_shared(s, Arc::new(inputs[rank].clone()))
                    .unwrap()
            })
            .collect();
        for r in run_all(&ops).await {
            r.unwrap();
        }
        let exact = reference(DType::F32, ReduceOp::Sum, &inputs);
        for (rank, op) in ops.iter().enumerate() {
            assert!(
                op.result() == ops[0].result(),
                "rank {rank} differs from rank 0"
            );
        }
        let values = |b: &[u8]| -> Vec<f32> {
            b.chunks_exact(4)
                .map(|e| f32::from_le_bytes(e.try_into().unwrap()))
                .collect()
        };
        for (got, want) in values(ops[0].result()).into_iter().zip(values(&exact)) {
            // Three 8-bit quantizations of values within [-6, 6].
            assert!((got - want).abs() < 0.1, "{got} vs {want}");
        }
        close_all(&peers).await;
    })
    .await;
}

/// Drops peer `dropped` of a ring of `k` (closes its links and its node) while the
/// others run an op, after one op on the whole ring succeeded. If `started`, the
/// dropped peer runs the op too and is aborted; the peer after it starts only after
/// the drop, so the op cannot complete anywhere. Every other peer must fail with a
/// peer-connection error, and no later than a few I/O timeouts.
/// Where an op's results land (see [`drop_one_peer`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Landing {
    /// Scratch memory (`Ring::start_all_reduce`).
    Scratch,
    /// Per-peer output buffers (`RingOp::with_output`): the inputs must come out of a
    /// failure unwritten.
    Output,
    /// The inputs themselves (`RingOp::in_place`): a failure must put them back.
    InPlace,
}

async fn drop_one_peer(k: usize, dropped: usize, started: bool, landing: Landing) {
    let io_timeout = Duration::from_secs(1);
    let peers = loopback_ring(k, 2, 3, link_cfg(io_timeout)).await.unwrap();
    let inputs: Vec<Arc<Vec<u8>>> = (0..k)
        .map(|r| Arc::new(random_input(DType::F32, 50_001, r as u64)))
        .collect();
    let outputs: Vec<Arc<Output>> = (0..k)
        .map(|r| match landing {
            Landing::InPlace => Arc::new(Output::holding(inputs[r].to_vec())),
            _ => Arc::new(Output::new(50_001 * 4)),
        })
        .collect();
    let start = |op_id: u64, rank: usize| {
        let s = spec(op_id, rank, k, DType::F32, ReduceOp::Sum);
        let s = ReduceSpec {
            piece_bytes: 4096,
            ..s
        };
        match landing {
            Landing::Scratch => peers[rank]
                .1
                .start_all_reduce_shared(s, inputs[rank].clone()),
            Landing::Output => start_into(&peers[rank].1, s, &inputs[rank], &outputs[rank]),
            Landing::InPlace => start_in_place(&peers[rank].1, s, &outputs[rank]),
        }
    };
    // The whole ring works (in place: the group's outcome is taken to be a failure, so
    // the tensors are put back).
    let ops: Vec<RingOp> = (0..k).map(|r| start(1, r).unwrap()).collect();
    for r in run_all(&ops).await {
        r.unwrap();
    }
    for op in &ops {
        op.rollback();
    }
    // Op 2: everyone but the dropped peer and the one after it starts.
    let after = (dropped + 1) % k;
    let mut runs = Vec::new();
    for rank in (0..k).filter(|r| *r != dropped && *r != after) {
        let op = start(2, rank).unwrap();
        runs.push((rank, tokio::spawn(op.run().unwrap())));
    }
    if started {
        let op = start(2, dropped).unwrap();
        let run = tokio::spawn(op.run().unwrap());
        op.abort();
        // Aborted here, or failed because the links went: never a success.
        assert!(run.await.unwrap().is_err());
    }
    let (node, ring) = &peers[dropped];
    ring.close().await;
    node.close().await;
    let t0 = tokio::time::Instant::now();
    // The peer after the dropped one may see its links fail before its op starts.
    let late = start(2, after).map(|op| tokio::spawn(op.run().unwrap()));
    let mut outcomes = Vec::new();
    for (rank, run) in runs {
        outcomes.push((rank, run.await.unwrap().map(|_| ())));
    }
    outcomes.push(match late {
        Ok(run) => (after, run.await.unwrap().map(|_| ())),
        Err(e) => (after, Err(e)),
    });
    for (rank, outcome) in outcomes {
        match outcome {
            Err(CoreError::PeerConnection(msg)) => {
                assert!(!msg.is_empty());
            }
            other => panic!("rank {rank} of {k} (rank {dropped} dropped): {other:?}"),
        }
        assert!(!peers[rank].1.is_ok(), "rank {rank}: links still usable");
        let want = random_input(DType::F32, 50_001, rank as u64);
        assert!(
            *inputs[rank] == want,
            "rank {rank}: the failed op wrote its input"
        );
        if landing == Landing::InPlace {
            assert!(
                outputs[rank].bytes() == want,
                "rank {rank}: the failed in-place op did not put its tensor back"
            );
        }
    }
    // Every peer notices within an I/O timeout or two (of silence, or of a blocked
    // send); the bound leaves room for a loaded machine.
    let bound = io_timeout * 10;
    assert!(t0.elapsed() < bound, "failures took {:?}", t0.elapsed());
    for (rank, (node, ring)) in peers.iter().enumerate() {
        if rank != dropped {
            ring.close().await;
            node.close().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_peer_fails_the_others_with_a_peer_connection_error() {
    bounded("the dropped-peer rings", async {
        drop_one_peer(4, 1, false, Landing::Scratch).await;
        drop_one_peer(2, 0, false, Landing::Scratch).await;
        drop_one_peer(3, 2, false, Landing::Output).await;
        drop_one_peer(3, 1, false, Landing::InPlace).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_dropped_mid_op_fails_the_others_with_a_peer_connection_error() {
    bounded("the aborted-peer rings", async {
        drop_one_peer(3, 0, true, Landing::Scratch).await;
        drop_one_peer(4, 3, true, Landing::Scratch).await;
        drop_one_peer(4, 1, true, Landing::Output).await;
        drop_one_peer(4, 2, true, Landing::InPlace).await;
        drop_one_peer(2, 1, true, Landing::InPlace).await;
    })
    .await;
}

/// An output buffer written by an op's tasks through a raw pointer (as the caller's
/// tensor is from Python): interior mutability, so the test may read it afterwards.
pub(super) struct Output(std::cell::UnsafeCell<Vec<u8>>);

// SAFETY: written only by the op it is lent to, read only after that op finished.
unsafe impl Sync for Output {}

impl Output {
    pub(super) fn new(len: usize) -> Output {
        Output::holding(vec![0xA5; len])
    }

    fn holding(bytes: Vec<u8>) -> Output {
        Output(std::cell::UnsafeCell::new(bytes))
    }

    fn len(&self) -> usize {
        // SAFETY: the length never changes.
        unsafe { (*self.0.get()).len() }
    }

    pub(super) fn ptr(&self) -> *mut u8 {
        // SAFETY: the vector itself is never resized; only its bytes are written.
        unsafe { (*self.0.get()).as_mut_ptr() }
    }

    pub(super) fn bytes(&self) -> Vec<u8> {
        // SAFETY: called once the op that wrote it has finished.
        unsafe { (*self.0.get()).clone() }
    }
}

/// An op on `ring`'s links reducing `input` into `output` (`RingOp::with_output`).
pub(super) fn start_into(
    ring: &Ring,
    spec: ReduceSpec,
    input: &Arc<Vec<u8>>,
    output: &Arc<Output>,
) -> Result<RingOp, CoreError> {
    let links = ring.usable_links()?;
    // SAFETY: both buffers live in the keep-alive; only this op writes the output.
    Ok(unsafe {
        RingOp::with_output(
            links,
            spec,
            input.as_ptr(),
            output.ptr(),
            input.len(),
            Box::new((input.clone(), output.clone())),
        )
    })
}

/// An op on `ring`'s links reducing `tensor` in place (`RingOp::in_place`).
fn start_in_place(
    ring: &Ring,
    spec: ReduceSpec,
    tensor: &Arc<Output>,
) -> Result<RingOp, CoreError> {
    let links = ring.usable_links()?;
    // SAFETY: the buffer lives in the keep-alive; only this op touches it until it is
    // committed or rolled back.
    Ok(unsafe {
        RingOp::in_place(
            links,
            spec,
            tensor.ptr(),
            tensor.len(),
            Box::new(tensor.clone()),
            Some(ring.scratch()),
        )
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_place_ops_give_the_scratch_ops_bytes_and_roll_back_exactly() {
    let cases = [
        (DType::F32, ReduceOp::Sum, 1001, None),
        (DType::F32, ReduceOp::Avg, 5003, None),
        (DType::BF16, ReduceOp::Avg, 257, None),
        (DType::F16, ReduceOp::Min, 3000, None),
        (DType::I64, ReduceOp::Max, 77, None),
        (DType::U8, ReduceOp::Prod, 2, None),
        (DType::I32, ReduceOp::Sum, 1, None),
        // Pieces of several stream blocks, the last one short.
        (DType::F32, ReduceOp::Avg, 300_001, None),
        (DType::F64, ReduceOp::Max, 150_001, None),
        (
            DType::F32,
            ReduceOp::Sum,
            5003,
            Some((QuantAlgorithm::MinMax, WireType::U8)),
        ),
        (
            DType::BF16,
            ReduceOp::Avg,
            999,
            Some((QuantAlgorithm::ZeroPointScale, WireType::F8E4M3)),
        ),
    ];
    bounded("the in-place rings", async {
        for k in [2usize, 3, 5] {
            let peers = loopback_ring(k, 2, 12, link_cfg(Duration::from_secs(10)))
                .await
                .unwrap();
            for (c, &(dtype, op, count, quant)) in cases.iter().enumerate() {
                let what = format!("{k} peers, {} {} x{count}", op.name(), dtype.name());
                let seed = |r: usize| (k * 131 + c * 17 + r) as u64;
                let inputs: Vec<Arc<Vec<u8>>> = (0..k)
                    .map(|r| Arc::new(random_input(dtype, count, seed(r))))
                    .collect();
                // Pieces of 1 KiB and of 24 bytes: many per chunk, on every lane; of
                // 200 KiB and a bit for the large tensors (3 stream blocks and a short one).
                let piece_bytes = match count {
                    100_000.. => 200 * 1024 + 8,
                    _ if c % 2 == 0 => 1024,
                    _ => 24,
                };
                let spec_of = |op_id: u64, rank: usize| ReduceSpec {
                    quant,
                    piece_bytes,
                    ..spec(op_id, rank, k, dtype, op)
                };
                let scratch: Vec<RingOp> = (0..k)
                    .map(|r| {
                        peers[r]
                            .1
                            .start_all_reduce_shared(spec_of(2 * c as u64, r), inputs[r].clone())
                            .unwrap()
                    })
                    .collect();
                for r in run_all(&scratch).await {
                    r.unwrap_or_else(|e| panic!("{what}: {e}"));
                }
                let tensors: Vec<Arc<Output>> = inputs
                    .iter()
                    .map(|i| Arc::new(Output::holding(i.to_vec())))
                    .collect();
                let ops: Vec<RingOp> = (0..k)
                    .map(|r| {
                        start_in_place(&peers[r].1, spec_of(2 * c as u64 + 1, r), &tensors[r])
                            .unwrap()
                    })
                    .collect();
                let stats: Vec<ReduceStats> = run_all(&ops)
                    .await
                    .into_iter()
                    .map(|r| r.unwrap_or_else(|e| panic!("{what}: {e}")))
                    .collect();
                for rank in 0..k {
                    let want = scratch[rank].result().to_vec();
                    assert_eq!(tensors[rank].bytes(), want, "{what}: rank {rank}");
                    if rank % 2 == 0 {
                        // The group failed: the original comes back, once.
                        ops[rank].rollback();
                        assert!(
                            tensors[rank].bytes() == *inputs[rank],
                            "{what}: rank {rank}"
                        );
                        ops[rank].rollback();
                        assert!(
                            tensors[rank].bytes() == *inputs[rank],
                            "{what}: rank {rank}"
                        );
                    } else {
                        // Committed into the tensor itself: nothing to copy, nothing to undo.
                        // SAFETY: the op has finished; nothing else touches the tensor.
                        let dst = unsafe {
                            std::slice::from_raw_parts_mut(tensors[rank].ptr(), tensors[rank].len())
                        };
                        ops[rank].commit_into(dst).unwrap();
                        ops[rank].rollback();
                        assert_eq!(tensors[rank].bytes(), want, "{what}: rank {rank}");
                    }
                }
                assert_eq!(stats[0].tx_bytes, stats[1 % k].rx_bytes, "{what}");
            }
            close_all(&peers).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_place_ops_land_exact_results_in_the_output_and_leave_the_input() {
    let cases = [
        (DType::F32, ReduceOp::Sum, 1001, None),
        (DType::BF16, ReduceOp::Avg, 257, None),
        (DType::I64, ReduceOp::Max, 77, None),
        (DType::U8, ReduceOp::Prod, 2, None),
        (
            DType::F32,
            ReduceOp::Sum,
            5003,
            Some((QuantAlgorithm::MinMax, WireType::U8)),
        ),
    ];
    bounded("the out-of-place rings", async {
        for k in [2usize, 3, 5] {
            let peers = loopback_ring(k, 2, 11, link_cfg(Duration::from_secs(10)))
                .await
                .unwrap();
            for (c, &(dtype, op, count, quant)) in cases.iter().enumerate() {
                let inputs: Vec<Arc<Vec<u8>>> = (0..k)
                    .map(|r| Arc::new(random_input(dtype, count, (k * 31 + c * 7 + r) as u64)))
                    .collect();
                let outputs: Vec<Arc<Output>> = (0..k)
                    .map(|_| Arc::new(Output::new(count * dtype.size())))
                    .collect();
                let ops: Vec<RingOp> = (0..k)
                    .map(|rank| {
                        let s = ReduceSpec {
                            quant,
                            ..spec(c as u64, rank, k, dtype, op)
                        };
                        start_into(&peers[rank].1, s, &inputs[rank], &outputs[rank]).unwrap()
                    })
                    .collect();
                let what = format!("{k} peers, {} {} x{count}", op.name(), dtype.name());
                let stats: Vec<ReduceStats> = run_all(&ops)
                    .await
                    .into_iter()
                    .map(|r| r.unwrap_or_else(|e| panic!("{what}: {e}")))
                    .collect();
                let first = outputs[0].bytes();
                if quant.is_none() {
                    assert_eq!(
                        first,
                        reference(
                            dtype,
                            op,
                            &inputs.iter().map(|i| i.to_vec()).collect::<Vec<_>>()
                        ),
                        "{what}"
                    );
                }
                for rank in 0..k {
                    assert_eq!(outputs[rank].bytes(), first, "{what}: rank {rank} differs");
                    assert!(
                        std::ptr::eq(ops[rank].result().as_ptr(), outputs[rank].ptr()),
                        "{what}: the result is not in the output"
                    );
                    let again = random_input(dtype, count, (k * 31 + c * 7 + rank) as u64);
                    assert!(
                        *inputs[rank] == again,
                        "{what}: rank {rank}'s input was written"
                    );
                }
                assert_eq!(stats[0].tx_bytes, stats[1 % k].rx_bytes, "{what}");
            }
            close_all(&peers).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_without_pools_or_links_refuses_ops() {
    bounded("the refusals", async {
        let peers = loopback_ring(1, 1, 1, link_cfg(Duration::from_secs(1)))
            .await
            .unwrap();
        let (node, ring) = &peers[0];
        // A ring of one has no links: nothing to run an op on.
        assert_eq!(ring.lanes(), (0, 0));
        assert!(!ring.is_ok());
        let s = spec(1, 0, 2, DType::F32, ReduceOp::Sum);
        match ring.start_all_reduce_shared(s.clone(), Arc::new(vec![0u8; 8])) {
            Err(CoreError::PeerConnection(m)) => {
                assert_eq!(m, "no ring links: call update_topology()")
            }
            other => panic!("{:?}", other.err()),
        }
        // No pool was dialed for epoch 9: the install fails and leaves no links.
        let Err(err) = ring
            .install(node, 9, Some((2, 2)), link_cfg(Duration::from_secs(1)))
            .await
        else {
            panic!("installed a ring without pools");
        };
        assert!(
            matches!(&err, CoreError::PeerConnection(m) if m == "no pool to peer 2 for epoch 9"),
            "{err:?}"
        );
        assert!(ring.links().is_none());
        close_all(&peers).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_op_runs_once_and_commits_only_into_its_own_size() {
    bounded("the op", async {
        let peers = loopback_ring(2, 1, 1, link_cfg(Duration::from_secs(10)))
            .await
            .unwrap();
        let inputs: Vec<Vec<u8>> = (0..2).map(|r| random_input(DType::U16, 11, r)).collect();
        let ops: Vec<RingOp> = peers
            .iter()
            .enumerate()
            .map(|(rank, (_, ring))| {
                let s = spec(5, rank, 2, DType::U16, ReduceOp::Max);
                ring.start_all_reduce_shared(s, Arc::new(inputs[rank].clone()))
                    .unwrap()
            })
            .collect();
        let stats: Vec<ReduceStats> = run_all(&ops)
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        check(
            &ops,
            &stats,
            &reference(DType::U16, ReduceOp::Max, &inputs),
            "u16 max",
        );
        assert!(matches!(
            ops[0].run().map(|_| ()),
            Err(CoreError::InvalidUsage(m)) if m == "RingOp.run() called twice"
        ));
        let mut short = vec![0u8; 21];
        assert!(matches!(
            ops[1].commit_into(&mut short),
            Err(CoreError::InvalidArgument(m)) if m == "output has 21 bytes, the result 22"
        ));
        close_all(&peers).await;
    })
    .await;
}

// ---- optimistic start: early pieces, descriptor digests, unarmed ops ------------------

type Run = tokio::task::JoinHandle<Result<ReduceStats, CoreError>>;

/// Polls `f` until it holds.
pub(super) async fn until(what: &str, f: impl Fn() -> bool) {
    bounded(what, async {
        while !f() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
}

/// Payload bytes `ring`'s links hold for ops not registered there yet.
pub(super) fn stashed(ring: &Ring) -> usize {
    ring.links().unwrap().stashed_bytes()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|e| f32::from_le_bytes(e.try_into().unwrap()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_starting_late_lands_the_stashed_pieces_and_all_get_exact_results() {
    let io_timeout = Duration::from_millis(200);
    let q8 = Some((QuantAlgorithm::MinMax, WireType::U8));
    // (dtype, op, elements, piece bytes, quantization)
    let cases = [
        (DType::F32, ReduceOp::Sum, 1001, 24, None),
        (DType::I32, ReduceOp::Max, 333, 24, None),
        (DType::F32, ReduceOp::Sum, 1001, 400, q8),
    ];
    bounded("the late peer", async {
        let (k, late) = (3, 2);
        let peers = loopback_ring(k, 2, 21, link_cfg(io_timeout)).await.unwrap();
        let mut started = Vec::new();
        for (c, &(dtype, op, count, piece_bytes, quant)) in cases.iter().enumerate() {
            let inputs: Vec<Vec<u8>> = (0..k)
                .map(|r| random_input(dtype, count, (c * 10 + r) as u64))
                .collect();
            let ops: Vec<RingOp> = (0..k)
                .map(|rank| {
                    let s = ReduceSpec {
                        piece_bytes,
                        quant,
                        ..spec(c as u64, rank, k, dtype, op)
                    };
                    let input = Arc::new(inputs[rank].clone());
                    // Unarmed until the master would confirm that the late peer started.
                    let op = peers[rank].1.start_all_reduce_shared(s, input).unwrap();
                    op.with_armed(rank == late)
                })
                .collect();
            let runs: Vec<Option<Run>> = (0..k)
                .map(|rank| (rank != late).then(|| tokio::spawn(ops[rank].run().unwrap())))
                .collect();
            started.push((inputs, ops, runs));
        }
        tokio::time::sleep(io_timeout * 3).await;
        assert!(stashed(&peers[late].1) > 0, "nothing reached the late peer");
        for (_, _, runs) in &started {
            assert!(runs.iter().flatten().all(|r| !r.is_finished()));
        }
        for (_, ops, runs) in &mut started {
            runs[late] = Some(tokio::spawn(ops[late].run().unwrap()));
            for op in ops.iter() {
                op.arm();
            }
        }
        for ((inputs, ops, runs), &(dtype, op, count, _, quant)) in started.into_iter().zip(&cases)
        {
            let what = format!(
                "{} {} x{count}, quantized {}",
                op.name(),
                dtype.name(),
                quant.is_some()
            );
            let mut stats = Vec::new();
            for run in runs {
                stats.push(
                    run.unwrap()
                        .await
                        .unwrap()
                        .unwrap_or_else(|e| panic!("{what}: {e}")),
                );
            }
            let exact = reference(dtype, op, &inputs);
            if quant.is_none() {
                check(&ops, &stats, &exact, &what);
            } else {
                check(&ops, &stats, ops[0].result(), &what);
                for (got, want) in f32s(ops[0].result()).into_iter().zip(f32s(&exact)) {
                    assert!((got - want).abs() < 0.1, "{what}: {got} vs {want}");
                }
            }
        }
        assert_eq!(stashed(&peers[late].1), 0);
        close_all(&peers).await;
    })
    .await;
}

/// The output of `op`, which must be untouched (still `Output::new`'s filler), and
/// its input, which must still be `want`.
fn assert_untouched(output: &Output, input: &[u8], want: &[u8], what: &str) {
    assert!(
        output.bytes().iter().all(|&b| b == 0xA5),
        "{what}: output written"
    );
    assert!(input == want, "{what}: input written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_running_another_descriptor_fail_with_invalid_usage_before_a_byte_lands() {
    let io_timeout = Duration::from_millis(300);
    let count = 1000;
    let different = |e: &CoreError, from: u64| match e {
        CoreError::InvalidUsage(m) => {
            assert!(
                m.starts_with(&format!("peer {from} runs a different collective as op 7 ")),
                "{m}"
            );
            assert!(m.contains("element count, dtype, reduce op"), "{m}");
        }
        other => panic!("{other:?}"),
    };
    bounded("the mismatched rings", async {
        // Stashed pieces: rank 0 runs SUM well before rank 1 runs MAX of as many f32.
        let peers = loopback_ring(2, 2, 31, link_cfg(io_timeout)).await.unwrap();
        let inputs: Vec<Arc<Vec<u8>>> = (0..2)
            .map(|r| Arc::new(random_input(DType::F32, count, 70 + r)))
            .collect();
        let outputs: Vec<Arc<Output>> = (0..2).map(|_| Arc::new(Output::new(count * 4))).collect();
        let start = |rank: usize, op| {
            let s = spec(7, rank, 2, DType::F32, op);
            start_into(&peers[rank].1, s, &inputs[rank], &outputs[rank]).unwrap()
        };
        let first = start(0, ReduceOp::Sum);
        let first_run = tokio::spawn(first.run().unwrap());
        until("pieces stashed at rank 1", || stashed(&peers[1].1) > 0).await;
        let second = start(1, ReduceOp::Max);
        let err = second.run().unwrap().await.unwrap_err();
        different(&err, 1);
        assert!(!peers[1].1.is_ok());
        assert_eq!(stashed(&peers[1].1), 0);
        let want = random_input(DType::F32, count, 71);
        assert_untouched(&outputs[1], &inputs[1], &want, "rank 1");
        // Rank 1 sent nothing: rank 0 fails too (here by its stall clock).
        assert!(first_run.await.unwrap().is_err());
        close_all(&peers).await;

        // Straight off the wire: rank 2 runs f32 SUM when rank 1 starts i32 SUM of as
        // many elements.
        let peers = loopback_ring(3, 2, 32, link_cfg(io_timeout)).await.unwrap();
        let inputs: Vec<Arc<Vec<u8>>> = (0..3)
            .map(|r| Arc::new(random_input(DType::F32, count, 80 + r)))
            .collect();
        let outputs: Vec<Arc<Output>> = (0..3).map(|_| Arc::new(Output::new(count * 4))).collect();
        let start = |rank: usize, dtype| {
            let s = spec(7, rank, 3, dtype, ReduceOp::Sum);
            start_into(&peers[rank].1, s, &inputs[rank], &outputs[rank]).unwrap()
        };
        let receiver = start(2, DType::F32).with_armed(false);
        let receiver_run = tokio::spawn(receiver.run().unwrap());
        // Rank 2 registered once its pieces reach rank 0 (which never starts).
        until("rank 2 started", || stashed(&peers[0].1) > 0).await;
        let sender = start(1, DType::I32);
        let sender_run = tokio::spawn(sender.run().unwrap());
        different(&receiver_run.await.unwrap().unwrap_err(), 2);
        let want = random_input(DType::F32, count, 82);
        assert_untouched(&outputs[2], &inputs[2], &want, "rank 2");
        assert!(sender_run.await.unwrap().is_err());
        close_all(&peers).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unarmed_op_waits_out_silence_and_stalls_once_armed() {
    let io_timeout = Duration::from_millis(200);
    bounded("the unarmed op", async {
        let peers = loopback_ring(2, 1, 41, link_cfg(io_timeout)).await.unwrap();
        let input = Arc::new(random_input(DType::F32, 100, 1));
        let s = spec(3, 0, 2, DType::F32, ReduceOp::Sum);
        // Rank 1 never starts op 3: rank 0 hears nothing from it.
        let op = peers[0]
            .1
            .start_all_reduce_shared(s, input)
            .unwrap()
            .with_armed(false);
        let run = tokio::spawn(op.run().unwrap());
        tokio::time::sleep(io_timeout * 3).await;
        assert!(!run.is_finished(), "an unarmed op stalled");
        assert!(peers[0].1.is_ok());
        let armed_at = tokio::time::Instant::now();
        op.arm();
        op.arm();
        match run.await.unwrap() {
            Err(CoreError::PeerConnection(m)) => {
                assert_eq!(m, "no data from peer 2 for 0.2s (stalled or dead)")
            }
            other => panic!("{other:?}"),
        }
        let took = armed_at.elapsed();
        assert!(
            took >= io_timeout && took < io_timeout * 5,
            "stalled {took:?} after arming"
        );
        op.arm();
        close_all(&peers).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pieces_past_the_stash_bound_wait_for_their_op_then_poison_the_links() {
    let io_timeout = Duration::from_millis(300);
    let count = 1000;
    bounded("the bounded stash", async {
        let peers = loopback_ring(2, 2, 51, link_cfg(io_timeout)).await.unwrap();
        let bound = 100;
        peers[1].1.links().unwrap().set_stash_limit(bound);
        let inputs: Vec<Vec<u8>> = (0..2)
            .map(|r| random_input(DType::F32, count, 90 + r as u64))
            .collect();
        let op = |op_id, rank: usize| {
            let s = spec(op_id, rank, 2, DType::F32, ReduceOp::Sum);
            peers[rank]
                .1
                .start_all_reduce_shared(s, Arc::new(inputs[rank].clone()))
                .unwrap()
        };
        // Registered within the I/O timeout: the stashed pieces, then those that
        // waited, land in order.
        let ops = [op(1, 0).with_armed(false), op(1, 1)];
        let early = tokio::spawn(ops[0].run().unwrap());
        until("pieces stashed at rank 1", || stashed(&peers[1].1) > 0).await;
        tokio::time::sleep(io_timeout / 3).await;
        assert!(stashed(&peers[1].1) <= bound);
        let late = tokio::spawn(ops[1].run().unwrap());
        ops[0].arm();
        let stats = [early.await.unwrap().unwrap(), late.await.unwrap().unwrap()];
        check(
            &ops,
            &stats,
            &reference(DType::F32, ReduceOp::Sum, &inputs),
            "bounded",
        );
        assert_eq!(stashed(&peers[1].1), 0);

        // Never registered: the lane that waits gives up after the I/O timeout.
        let orphan = op(2, 0).with_armed(false);
        let run = tokio::spawn(orphan.run().unwrap());
        let t0 = tokio::time::Instant::now();
        until("rank 1's links failed", || !peers[1].1.is_ok()).await;
        assert!(
            t0.elapsed() >= io_timeout,
            "gave up after {:?}",
            t0.elapsed()
        );
        match peers[1].1.links().unwrap().poison_error() {
            CoreError::PeerConnection(m) => assert_eq!(
                m,
                "link from peer 1 failed: peer 1 sent pieces of collective 2, which never \
                 started here"
            ),
            other => panic!("{other:?}"),
        }
        assert_eq!(stashed(&peers[1].1), 0);
        orphan.abort();
        assert!(run.await.unwrap().is_err());
        close_all(&peers).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_op_registered_late_holds_up_no_later_op_on_the_same_lanes() {
    let io_timeout = Duration::from_millis(300);
    bounded("the two ops", async {
        let peers = loopback_ring(2, 2, 61, link_cfg(io_timeout)).await.unwrap();
        let inputs = |op_id: u64, count| -> Vec<Vec<u8>> {
            (0..2)
                .map(|r| random_input(DType::F32, count, op_id * 10 + r))
                .collect()
        };
        let (a_in, b_in) = (inputs(1, 5000), inputs(2, 777));
        let start = |op_id, rank: usize, input: &Vec<u8>| {
            let s = spec(op_id, rank, 2, DType::F32, ReduceOp::Sum);
            peers[rank]
                .1
                .start_all_reduce_shared(s, Arc::new(input.clone()))
                .unwrap()
        };
        // A starts on rank 0 only: its pieces wait at rank 1, ahead of B's on every lane.
        let a = [
            start(1, 0, &a_in[0]).with_armed(false),
            start(1, 1, &a_in[1]),
        ];
        let a0 = tokio::spawn(a[0].run().unwrap());
        until("A stashed at rank 1", || stashed(&peers[1].1) > 0).await;
        let b = [start(2, 0, &b_in[0]), start(2, 1, &b_in[1])];
        let stats: Vec<ReduceStats> = run_all(&b).await.into_iter().map(Result::unwrap).collect();
        check(
            &b,
            &stats,
            &reference(DType::F32, ReduceOp::Sum, &b_in),
            "B",
        );
        assert!(!a0.is_finished());
        // A's pieces outlive B and more than an I/O timeout at rank 1.
        tokio::time::sleep(io_timeout * 2).await;
        assert!(stashed(&peers[1].1) > 0);
        let a1 = tokio::spawn(a[1].run().unwrap());
        a[0].arm();
        let stats = [a0.await.unwrap().unwrap(), a1.await.unwrap().unwrap()];
        check(
            &a,
            &stats,
            &reference(DType::F32, ReduceOp::Sum, &a_in),
            "A",
        );
        assert_eq!(stashed(&peers[1].1), 0);
        close_all(&peers).await;
    })
    .await;
}

// ---------------------------------------------------------------------------------------
// The star (in-process) all-reduce against the real ring
// ---------------------------------------------------------------------------------------

/// `count` elements of `dtype` whose float sums depend on the order: values spread over
/// many binades, with now and then a signed zero, an infinity or a NaN with a payload
/// (Max / Min keep the first NaN they meet). Integers: any bits.
fn mixed_input(dtype: DType, count: usize, seed: u64) -> Vec<u8> {
    let mut rng = SplitMix(seed ^ 0x5EED_0000);
    let mut out = Vec::with_capacity(count * dtype.size());
    let spread: i32 = match dtype {
        DType::F16 => 8,
        DType::BF16 | DType::F32 => 30,
        _ => 200,
    };
    for _ in 0..count {
        let binade = (rng.next() % (2 * spread as u64 + 1)) as i32 - spread;
        let mut x = rng.unit() * 2f64.powi(binade);
        let kind = rng.next() % 24;
        match kind {
            0 => x = 0.0,
            1 => x = -0.0,
            2 => x = f64::INFINITY,
            3 => x = f64::NEG_INFINITY,
            _ => {}
        }
        let nan = kind == 4;
        let payload = rng.next();
        match dtype {
            DType::F16 => {
                let bits = if nan {
                    0x7C01 | (payload as u16 & 0x83FF)
                } else {
                    f16::from_f64(x).to_bits()
                };
                out.extend_from_slice(&bits.to_le_bytes());
            }
            DType::BF16 => {
                let bits = if nan {
                    0x7F81 | (payload as u16 & 0x807F)
                } else {
                    bf16::from_f64(x).to_bits()
                };
                out.extend_from_slice(&bits.to_le_bytes());
            }
            DType::F32 => {
                let bits = if nan {
                    0x7F80_0001 | (payload as u32 & 0x807F_FFFF)
                } else {
                    (x as f32).to_bits()
                };
                out.extend_from_slice(&bits.to_le_bytes());
            }
            DType::F64 => {
                let bits = if nan {
                    0x7FF0_0000_0000_0001 | (payload & 0x800F_FFFF_FFFF_FFFF)
                } else {
                    x.to_bits()
                };
                out.extend_from_slice(&bits.to_le_bytes());
            }
            _ => out.extend_from_slice(&payload.to_le_bytes()[..dtype.size()]),
        }
    }
    out
}

fn star(dtype: DType, op: ReduceOp, inputs: &[Vec<u8>]) -> Vec<u8> {
    let refs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
    super::star_all_reduce(&refs, dtype, op).unwrap()
}

/// Runs one op per rank on `peers` and returns every rank's result bytes.
async fn ring_results(
    peers: &[(Arc<Node>, Ring)],
    op_id: u64,
    dtype: DType,
    op: ReduceOp,
    inputs: &[Vec<u8>],
) -> Vec<Vec<u8>> {
    let k = peers.len();
    let ops: Vec<RingOp> = peers
        .iter()
        .enumerate()
        .map(|(rank, (_, ring))| {
            let s = spec(op_id, rank, k, dtype, op);
            ring.start_all_reduce_shared(s, Arc::new(inputs[rank].clone()))
                .unwrap()
        })
        .collect();
    for (rank, r) in run_all(&ops).await.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("op {op_id}, rank {rank}: {e}"));
    }
    ops.iter().map(|o| o.result().to_vec()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn star_all_reduce_matches_the_real_ring_bit_for_bit() {
    // Counts below the world size (empty chunks), around it, and several pieces per
    // chunk (the pieces are 24 bytes).
    let counts = [1usize, 2, 9, 61];
    bounded("the rings", async {
        for (d, &dtype) in DType::ALL.iter().enumerate() {
            for (o, &op) in ReduceOp::ALL.iter().enumerate() {
                // A world of one: the peers keep their input.
                let x = mixed_input(dtype, 7, (d * 10 + o) as u64);
                assert_eq!(star(dtype, op, std::slice::from_ref(&x)), x);
            }
        }
        for k in [2usize, 3, 5, 7] {
            let lanes = 1 + (k % 3) as u16;
            let peers = loopback_ring(k, lanes, 70 + k as u64, link_cfg(Duration::from_secs(10)))
                .await
                .unwrap();
            // Every case in flight at once on the same links, then each compared.
            let mut cases = Vec::new();
            for &dtype in &DType::ALL {
                for &op in &ReduceOp::ALL {
                    for &count in &counts {
                        let op_id = cases.len() as u64;
                        let inputs: Vec<Vec<u8>> = (0..k)
                            .map(|r| {
                                mixed_input(dtype, count, op_id * 8 + r as u64 + 1000 * k as u64)
                            })
                            .collect();
                        let ops: Vec<RingOp> = peers
                            .iter()
                            .enumerate()
                            .map(|(rank, (_, ring))| {
                                let s = spec(op_id, rank, k, dtype, op);
                                ring.start_all_reduce_shared(s, Arc::new(inputs[rank].clone()))
                                    .unwrap()
                            })
                            .collect();
                        let runs: Vec<_> =
                            ops.iter().map(|o| tokio::spawn(o.run().unwrap())).collect();
                        cases.push((dtype, op, count, inputs, ops, runs));
                    }
                }
            }
            let mut order_mattered = 0;
            for (dtype, op, count, inputs, ops, runs) in cases {
                let what = format!("{k} peers, {} {} x{count}", op.name(), dtype.name());
                for run in runs {
                    run.await.unwrap().unwrap_or_else(|e| panic!("{what}: {e}"));
                }
                let want = star(dtype, op, &inputs);
                for (rank, o) in ops.iter().enumerate() {
                    assert!(
                        o.result() == want,
                        "{what}: rank {rank} differs from the star"
                    );
                }
                // The same inputs folded from rank 0 for every chunk: often other bytes,
                // so the comparison above does see the order.
                if dtype.is_float() && count > k {
                    let mut acc = inputs[0].clone();
                    for x in &inputs[1..] {
                        crate::reduce::reduce_inplace(dtype, op, &mut acc, x).unwrap();
                    }
                    crate::reduce::finalize(dtype, op, &mut acc, k).unwrap();
                    order_mattered += usize::from(acc != want);
                }
            }
            // (Two peers fold each chunk as `a op b` or `b op a`: the same bits, NaNs
            // aside, as the kernels are commutative.)
            assert!(
                k == 2 || order_mattered > 0,
                "{k} peers: no case depended on the order"
            );
            close_all(&peers).await;
        }
    })
    .await;
}

#[test]
fn star_all_reduce_matches_the_real_ring_on_random_inputs() {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // One ring per world size, reused by every case.
    let rings: Vec<Vec<(Arc<Node>, Ring)>> = rt.block_on(async {
        let mut rings = Vec::new();
        for k in 2..=6usize {
            let cfg = link_cfg(Duration::from_secs(10));
            rings.push(loopback_ring(k, 2, 90 + k as u64, cfg).await.unwrap());
        }
        rings
    });
    // Any bit pattern (NaNs, subnormals, infinities), or a value of a moderate binade.
    let f32_bits = prop_oneof![
        any::<u32>(),
        (-1e4f32..1e4f32).prop_map(f32::to_bits),
        (-1e-3f32..1e-3f32).prop_map(f32::to_bits),
    ];
    let f16_bits = prop_oneof![
        any::<u16>(),
        (-60f32..60f32).prop_map(|x| f16::from_f32(x).to_bits()),
    ];
    let case = |elem: BoxedStrategy<Vec<u8>>| {
        (2usize..=6, 0usize..40).prop_flat_map(move |(k, n)| {
            proptest::collection::vec(proptest::collection::vec(elem.clone(), n), k)
                .prop_map(|ranks| ranks.into_iter().map(|v| v.concat()).collect::<Vec<_>>())
        })
    };
    let f32_case = case(f32_bits.prop_map(|b| b.to_le_bytes().to_vec()).boxed());
    let f16_case = case(f16_bits.prop_map(|b| b.to_le_bytes().to_vec()).boxed());
    let op_id = std::cell::Cell::new(0u64);
    for (dtype, op, strategy) in [
        (DType::F32, ReduceOp::Sum, f32_case),
        (DType::F16, ReduceOp::Avg, f16_case),
    ] {
        let mut runner = TestRunner::new(Config {
            cases: 48,
            failure_persistence: None,
            ..Config::default()
        });
        runner
            .run(&strategy, |inputs| {
                op_id.set(op_id.get() + 1);
                let peers = &rings[inputs.len() - 2];
                let got = rt.block_on(bounded(
                    "a ring op",
                    ring_results(peers, op_id.get(), dtype, op, &inputs),
                ));
                let want = star(dtype, op, &inputs);
                for (rank, g) in got.iter().enumerate() {
                    prop_assert!(g == &want, "rank {} differs from the star", rank);
                }
                Ok(())
            })
            .unwrap();
    }
    rt.block_on(async {
        for peers in &rings {
            close_all(peers).await;
        }
    });
}

/// In place, a failed op puts back every byte it wrote, including those of a streamed
/// piece cut off between two blocks, in reduce-scatter and in the first all-gather step
/// (writes that no piece counted as landed covers).
#[test]
fn a_failed_in_place_op_puts_back_pieces_cut_off_mid_way() {
    let (world, rank) = (2usize, 0usize);
    let piece_bytes = 4 * STREAM_BLOCK;
    // Two chunks of two pieces of four blocks each.
    let count = piece_bytes;
    let original = random_input(DType::F32, count, 5);
    let tensor = Arc::new(Output::holding(original.clone()));
    // SAFETY: the keep-alive holds the buffer; only this receiver touches it.
    let mem =
        unsafe { OpMemory::in_place(tensor.ptr(), tensor.len(), Box::new(tensor.clone()), None) };
    let spec = ReduceSpec {
        piece_bytes,
        ..spec(7, rank, world, DType::F32, ReduceOp::Sum)
    };
    let rx = Receiver::new(spec, Arc::new(mem), piece_bytes).unwrap();
    let incoming = random_input(DType::F32, count, 6);
    let land = |step: u32, piece: u32, blocks: usize| {
        let n = rx.wire_len(step as usize, piece as usize);
        assert_eq!(n, piece_bytes);
        let dest = rx.claim(step, piece, n as u32, rx.digest()).unwrap();
        assert!(matches!(dest, Dest::Streamed), "{dest:?}");
        for b in 0..blocks {
            let at = b * STREAM_BLOCK;
            rx.land_part(step, piece, at, &incoming[at..at + STREAM_BLOCK])
                .unwrap();
        }
    };
    land(0, 0, 4); // reduce-scatter, piece 0: whole ...
    rx.landed(0, 0).unwrap();
    land(0, 1, 2); // ... piece 1: cut off after two blocks
                   // First all-gather step, piece 0: our own chunk comes back final and lands straight
                   // over the original, which the sender saved as it sent it; cut off after one block.
    rx.sent_own(0);
    let n = rx.wire_len(1, 0);
    let Dest::Direct(ptr, len) = rx.claim(1, 0, n as u32, rx.digest()).unwrap() else {
        panic!("the first all-gather step lands directly");
    };
    assert_eq!(len, piece_bytes);
    // SAFETY: the op handed this range to us alone (as to a reader).
    unsafe { std::ptr::copy_nonoverlapping(incoming.as_ptr(), ptr, STREAM_BLOCK) };
    assert!(tensor.bytes() != original);
    rx.fail();
    assert!(tensor.bytes() == original, "the tensor was not put back");
}

// --- the mesh all-reduce (recursive doubling) ------------------------------------------

/// What every peer must hold after a mesh all-reduce of `inputs`: the extras
/// (`p..world`, `p` the largest power of two not above it) fold into rank `r - p` after
/// it, then blocks of doubling size combine lower block first; AVG divides once.
fn mesh_reference(dtype: DType, op: ReduceOp, inputs: &[Vec<u8>]) -> Vec<u8> {
    let world = inputs.len();
    let p = 1usize << (usize::BITS - 1 - world.leading_zeros());
    let size = dtype.size();
    let count = inputs[0].len() / size;
    let mut out = vec![0u8; count * size];
    for i in 0..count {
        let r = i * size..(i + 1) * size;
        let mut acc: Vec<Vec<u8>> = (0..p)
            .map(|rank| {
                let x = inputs[rank][r.clone()].to_vec();
                match inputs.get(rank + p) {
                    Some(extra) => combine(dtype, op, &x, &extra[r.clone()]),
                    None => x,
                }
            })
            .collect();
        while acc.len() > 1 {
            acc = acc
                .chunks(2)
                .map(|pair| combine(dtype, op, &pair[0], &pair[1]))
                .collect();
        }
        let mut v = acc.pop().unwrap();
        if op == ReduceOp::Avg {
            v = divide(dtype, &v, world);
        }
        out[r].copy_from_slice(&v);
    }
    out
}

async fn mesh_peers(k: usize, max_bytes: usize, io_timeout: Duration) -> Vec<(Arc<Node>, Ring)> {
    loopback_mesh(k, 2, 9, link_cfg(io_timeout), true, max_bytes)
        .await
        .unwrap()
}

#[test]
fn mesh_partners_pair_up_both_ways_and_take_log_k_rounds() {
    for world in 1..=40usize {
        let p = 1usize << (usize::BITS - 1 - world.leading_zeros());
        for rank in 0..world {
            let partners = mesh_partners(rank, world);
            for &q in &partners {
                assert!(q < world && q != rank, "{rank}/{world}: partner {q}");
                assert!(
                    mesh_partners(q, world).contains(&rank),
                    "{rank}<->{q} of {world}"
                );
            }
            let want = if rank >= p {
                1
            } else {
                p.trailing_zeros() as usize + usize::from(rank + p < world)
            };
            assert_eq!(partners.len(), want, "{rank}/{world}");
        }
        let log = p.trailing_zeros() as usize;
        let rounds = if world == 1 {
            0
        } else {
            log + if p == world { 0 } else { 2 }
        };
        assert_eq!(mesh_rounds(world), rounds, "{world}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mesh_all_reduce_is_exact_and_alike_for_every_dtype_op_and_world() {
    let dtypes = DType::ALL;
    let ops = [
        ReduceOp::Sum,
        ReduceOp::Avg,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
    ];
    bounded("the meshes", async {
        for k in [2usize, 3, 4, 5, 6, 7, 8] {
            let peers = mesh_peers(k, 1 << 20, Duration::from_secs(10)).await;
            let mut started = Vec::new();
            let mut id = 0u64;
            for &dtype in &dtypes {
                for &op in &ops {
                    // Odd counts: one element, fewer than the world, several pieces.
                    let count = [1, 5, 37][(id % 3) as usize];
                    let inputs: Vec<Vec<u8>> = (0..k)
                        .map(|r| random_input(dtype, count, id * 31 + r as u64))
                        .collect();
                    let ops: Vec<RingOp> = peers
                        .iter()
                        .enumerate()
                        .map(|(rank, (_, ring))| {
                            let s = spec(id, rank, k, dtype, op);
                            ring.start_all_reduce_shared(s, Arc::new(inputs[rank].clone()))
                                .unwrap()
                        })
                        .collect();
                    assert!(ops.iter().all(RingOp::is_mesh));
                    let runs: Vec<_> = ops.iter().map(|o| tokio::spawn(o.run().unwrap())).collect();
                    started.push((dtype, op, count, inputs, ops, runs));
                    id += 1;
                }
            }
            for (dtype, op, count, inputs, ops, runs) in started {
                let what = format!("mesh of {k}, {} {} x{count}", op.name(), dtype.name());
                let want = mesh_reference(dtype, op, &inputs);
                for (rank, run) in runs.into_iter().enumerate() {
                    run.await.unwrap().unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert!(ops[rank].result() == want, "{what}: rank {rank} differs");
                }
            }
            close_all(&peers).await;
        }
    })
    .await;
}

/// [`start_into`], on `ring`'s mesh when the mesh takes the op (as
/// `Ring::start_all_reduce` decides).
fn mesh_into(
    ring: &Ring,
    spec: ReduceSpec,
    input: &Arc<Vec<u8>>,
    output: &Arc<Output>,
) -> Result<RingOp, CoreError> {
    let mesh = ring.mesh_for(&spec, input.len());
    Ok(start_into(ring, spec, input, output)?.with_mesh(mesh))
}

/// [`start_in_place`], on `ring`'s mesh when the mesh takes the op.
fn mesh_in_place(ring: &Ring, spec: ReduceSpec, tensor: &Arc<Output>) -> Result<RingOp, CoreError> {
    let mesh = ring.mesh_for(&spec, tensor.len());
    Ok(start_in_place(ring, spec, tensor)?.with_mesh(mesh))
}

fn plain(inputs: &[Arc<Vec<u8>>]) -> Vec<Vec<u8>> {
    inputs.iter().map(|i| i.to_vec()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mesh_ops_out_of_place_and_in_place_land_the_mesh_result_and_roll_back_exactly() {
    // (dtype, op, elements): with 24-byte pieces, 37 f32 are 7 pieces, 101 bf16 9,
    // 50 f64 17, 29 i32 5, 100 u8 5; one element; an empty tensor (one empty piece).
    let cases = [
        (DType::F32, ReduceOp::Sum, 37),
        (DType::BF16, ReduceOp::Avg, 101),
        (DType::F64, ReduceOp::Prod, 50),
        (DType::I32, ReduceOp::Avg, 29),
        (DType::U8, ReduceOp::Max, 100),
        (DType::F16, ReduceOp::Min, 1),
        (DType::F32, ReduceOp::Sum, 0),
    ];
    bounded("the meshes", async {
        for k in [3usize, 4] {
            let peers = mesh_peers(k, 1 << 20, Duration::from_secs(10)).await;
            for (c, &(dtype, op, count)) in cases.iter().enumerate() {
                let what = format!("mesh of {k}, {} {} x{count}", op.name(), dtype.name());
                let seed = |r: usize| (k * 1000 + c * 10 + r) as u64;
                let inputs: Vec<Arc<Vec<u8>>> = (0..k)
                    .map(|r| Arc::new(random_input(dtype, count, seed(r))))
                    .collect();
                let want = mesh_reference(dtype, op, &plain(&inputs));
                let len = count * dtype.size();

                // Out of place: the result lands in the output, the input stays.
                let outputs: Vec<Arc<Output>> =
                    (0..k).map(|_| Arc::new(Output::new(len))).collect();
                let ops: Vec<RingOp> = (0..k)
                    .map(|r| {
                        let s = spec(2 * c as u64, r, k, dtype, op);
                        mesh_into(&peers[r].1, s, &inputs[r], &outputs[r]).unwrap()
                    })
                    .collect();
                assert!(ops.iter().all(RingOp::is_mesh), "{what}");
                for r in run_all(&ops).await {
                    r.unwrap_or_else(|e| panic!("{what}: {e}"));
                }
                for rank in 0..k {
                    assert!(
                        outputs[rank].bytes() == want,
                        "{what}: rank {rank}'s output differs from the mesh reference"
                    );
                    assert!(
                        std::ptr::eq(ops[rank].result().as_ptr(), outputs[rank].ptr()),
                        "{what}: the result is not in the output"
                    );
                    assert!(
                        *inputs[rank] == random_input(dtype, count, seed(rank)),
                        "{what}: rank {rank}'s input was written"
                    );
                    // Committed into the output itself: nothing to copy; a rollback
                    // of an out-of-place op is a no-op.
                    // SAFETY: the op has finished; nothing else touches the output.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(outputs[rank].ptr(), outputs[rank].len())
                    };
                    ops[rank].commit_into(dst).unwrap();
                    ops[rank].rollback();
                    assert!(outputs[rank].bytes() == want, "{what}: rank {rank}");
                }

                // In place: the result lands in the tensor; a rollback puts the original
                // back exactly (once), a commit into the tensor keeps the result.
                let tensors: Vec<Arc<Output>> = inputs
                    .iter()
                    .map(|i| Arc::new(Output::holding(i.to_vec())))
                    .collect();
                let ops: Vec<RingOp> = (0..k)
                    .map(|r| {
                        let s = spec(2 * c as u64 + 1, r, k, dtype, op);
                        mesh_in_place(&peers[r].1, s, &tensors[r]).unwrap()
                    })
                    .collect();
                assert!(ops.iter().all(RingOp::is_mesh), "{what}");
                for r in run_all(&ops).await {
                    r.unwrap_or_else(|e| panic!("{what}: {e}"));
                }
                for rank in 0..k {
                    assert!(
                        tensors[rank].bytes() == want,
                        "{what}: rank {rank}'s tensor differs from the mesh reference"
                    );
                    assert!(
                        std::ptr::eq(ops[rank].result().as_ptr(), tensors[rank].ptr()),
                        "{what}: the result is not in the tensor"
                    );
                    if rank % 2 == 0 {
                        ops[rank].rollback();
                        assert!(
                            tensors[rank].bytes() == *inputs[rank],
                            "{what}: rank {rank}: the rollback did not restore the tensor"
                        );
                        ops[rank].rollback();
                        assert!(
                            tensors[rank].bytes() == *inputs[rank],
                            "{what}: rank {rank}: the second rollback"
                        );
                    } else {
                        // SAFETY: the op has finished; nothing else touches the tensor.
                        let dst = unsafe {
                            std::slice::from_raw_parts_mut(tensors[rank].ptr(), tensors[rank].len())
                        };
                        ops[rank].commit_into(dst).unwrap();
                        ops[rank].rollback();
                        assert!(
                            tensors[rank].bytes() == want,
                            "{what}: rank {rank}: a committed tensor was rolled back"
                        );
                    }
                }
            }
            for (_, ring) in &peers {
                assert!(ring.is_ok());
            }
            close_all(&peers).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mesh_takes_collectives_up_to_its_max_bytes_and_the_ring_the_rest() {
    let (k, max_bytes) = (3usize, 400usize);
    // (f32 elements, on the mesh): 100 f32 are exactly `max_bytes`.
    let cases = [
        (1usize, true),
        (99, true),
        (100, true),
        (101, false),
        (5000, false),
    ];
    bounded("the threshold", async {
        let peers = mesh_peers(k, max_bytes, Duration::from_secs(10)).await;
        for (c, &(count, on_mesh)) in cases.iter().enumerate() {
            let what = format!("{count} f32 ({} bytes)", count * 4);
            let inputs: Vec<Vec<u8>> = (0..k)
                .map(|r| random_input(DType::F32, count, (c * 10 + r) as u64 + 300))
                .collect();
            let ops: Vec<RingOp> = peers
                .iter()
                .enumerate()
                .map(|(rank, (_, ring))| {
                    let s = spec(c as u64, rank, k, DType::F32, ReduceOp::Sum);
                    assert_eq!(ring.mesh_for(&s, count * 4).is_some(), on_mesh, "{what}");
                    ring.start_all_reduce_shared(s, Arc::new(inputs[rank].clone()))
                        .unwrap()
                })
                .collect();
            for op in &ops {
                assert_eq!(op.is_mesh(), on_mesh, "{what}");
            }
            let stats: Vec<ReduceStats> = run_all(&ops)
                .await
                .into_iter()
                .map(|r| r.unwrap_or_else(|e| panic!("{what}: {e}")))
                .collect();
            let on_ring = reference(DType::F32, ReduceOp::Sum, &inputs);
            let meshed = mesh_reference(DType::F32, ReduceOp::Sum, &inputs);
            // Past one element the two reduction orders give other bytes for these
            // inputs: the comparison below does tell the paths apart.
            if count > 1 {
                assert!(on_ring != meshed, "{what}: the orders agree");
            }
            let want = if on_mesh { &meshed } else { &on_ring };
            for (rank, op) in ops.iter().enumerate() {
                assert!(op.result() == want.as_slice(), "{what}: rank {rank}");
            }
            if !on_mesh {
                check(&ops, &stats, want, &what);
            }
        }
        // A quantized collective of the mesh's size runs on the ring (the mesh does not
        // quantize): all peers agree.
        let count = 100;
        let inputs: Vec<Vec<u8>> = (0..k)
            .map(|r| random_input(DType::F32, count, 400 + r as u64))
            .collect();
        let ops: Vec<RingOp> = peers
            .iter()
            .enumerate()
            .map(|(rank, (_, ring))| {
                let s = ReduceSpec {
                    piece_bytes: 400,
                    quant: Some((QuantAlgorithm::MinMax, WireType::U8)),
                    ..spec(99, rank, k, DType::F32, ReduceOp::Sum)
                };
                assert!(ring.mesh_for(&s, count * 4).is_none());
                ring.start_all_reduce_shared(s, Arc::new(inputs[rank].clone()))
                    .unwrap()
            })
            .collect();
        assert!(ops.iter().all(|o| !o.is_mesh()));
        for r in run_all(&ops).await {
            r.unwrap();
        }
        for op in &ops {
            assert!(op.result() == ops[0].result());
        }
        close_all(&peers).await;
    })
    .await;
}

/// When the dropped peer of [`drop_one_mesh_peer`] goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DropAt {
    /// Before the others start their op (once its partners saw their links to it go).
    BeforeStart,
    /// While the others' op waits for it.
    AfterStart,
}

/// A mesh of 5 (ranks 0..4 core, rank 4 the extra of rank 0) runs one op on every
/// peer; then op 2 on every peer but `dropped`, which never starts it, and whose ring and
/// node close `when` the others start. No survivor can complete op 2 (each result needs
/// the dropped peer's input): each must fail with a `PeerConnection` error within a
/// few I/O timeouts, the partners of the dropped peer by their links to it, the others
/// by their stall clock, and none may write its caller's memory.
async fn drop_one_mesh_peer(dropped: usize, when: DropAt, landing: Landing) {
    let k = 5;
    let io_timeout = Duration::from_secs(2);
    let peers = mesh_peers(k, 1 << 20, io_timeout).await;
    let (dtype, op, count) = (DType::F32, ReduceOp::Sum, 301);
    let seed = |r: usize| 500 + r as u64;
    let inputs: Vec<Arc<Vec<u8>>> = (0..k)
        .map(|r| Arc::new(random_input(dtype, count, seed(r))))
        .collect();
    let what = format!("rank {dropped} of {k} dropped {when:?}");

    // The whole mesh works.
    let ops: Vec<RingOp> = (0..k)
        .map(|r| {
            let s = spec(1, r, k, dtype, op);
            peers[r]
                .1
                .start_all_reduce_shared(s, inputs[r].clone())
                .unwrap()
        })
        .collect();
    assert!(ops.iter().all(RingOp::is_mesh));
    for r in run_all(&ops).await {
        r.unwrap_or_else(|e| panic!("{what}: op 1: {e}"));
    }
    let want = mesh_reference(dtype, op, &plain(&inputs));
    assert!(ops.iter().all(|o| o.result() == want), "{what}: op 1");

    // Op 2, bound while every ring link is usable (the dropped peer's ring neighbours
    // lose theirs with it).
    let outputs: Vec<Arc<Output>> = (0..k)
        .map(|r| match landing {
            Landing::InPlace => Arc::new(Output::holding(inputs[r].to_vec())),
            _ => Arc::new(Output::new(count * dtype.size())),
        })
        .collect();
    let survivors: Vec<usize> = (0..k).filter(|&r| r != dropped).collect();
    let ops: Vec<(usize, RingOp)> = survivors
        .iter()
        .map(|&r| {
            let s = spec(2, r, k, dtype, op);
            let o = match landing {
                Landing::Scratch => peers[r].1.start_all_reduce_shared(s, inputs[r].clone()),
                Landing::Output => mesh_into(&peers[r].1, s, &inputs[r], &outputs[r]),
                Landing::InPlace => mesh_in_place(&peers[r].1, s, &outputs[r]),
            };
            (r, o.unwrap())
        })
        .collect();
    assert!(ops.iter().all(|(_, o)| o.is_mesh()));
    let drop_peer = || async {
        let (node, ring) = &peers[dropped];
        ring.close().await;
        node.close().await;
    };
    let partners = mesh_partners(dropped, k);
    let (t0, runs) = match when {
        DropAt::BeforeStart => {
            drop_peer().await;
            let t0 = tokio::time::Instant::now();
            for &r in &partners {
                let mesh = peers[r].1.mesh().unwrap();
                until("the partners see the dropped peer go", || {
                    mesh.is_poisoned()
                })
                .await;
            }
            let runs: Vec<(usize, Run)> = ops
                .iter()
                .map(|(r, o)| (*r, tokio::spawn(o.run().unwrap())))
                .collect();
            (t0, runs)
        }
        DropAt::AfterStart => {
            let runs: Vec<(usize, Run)> = ops
                .iter()
                .map(|(r, o)| (*r, tokio::spawn(o.run().unwrap())))
                .collect();
            // Lets the ops register and send what they can. Not a synchronisation: an
            // op not polled yet meets the BeforeStart case, with the same outcome.
            tokio::time::sleep(Duration::from_millis(100)).await;
            for (r, run) in &runs {
                assert!(!run.is_finished(), "{what}: rank {r} ended before the drop");
            }
            drop_peer().await;
            (tokio::time::Instant::now(), runs)
        }
    };
    let dropped_id = dropped + 1;
    for (rank, run) in runs {
        match run.await.unwrap() {
            Err(CoreError::PeerConnection(msg)) => {
                if partners.contains(&rank) {
                    // Its link to the dropped peer failed (EOF, or a failed send).
                    assert!(
                        msg.contains(&format!("peer {dropped_id} ")),
                        "{what}: rank {rank}: {msg}"
                    );
                } else {
                    // Its partners are alive but never send the step it waits for.
                    assert!(
                        msg.ends_with("(stalled or dead)"),
                        "{what}: rank {rank}: {msg}"
                    );
                }
            }
            other => panic!("{what}: rank {rank}: {other:?}"),
        }
        assert!(
            !peers[rank].1.is_ok(),
            "{what}: rank {rank}: links still usable"
        );
        let original = random_input(dtype, count, seed(rank));
        assert!(
            *inputs[rank] == original,
            "{what}: rank {rank}: input written"
        );
        match landing {
            Landing::Scratch => {}
            Landing::Output => assert!(
                outputs[rank].bytes().iter().all(|&b| b == 0xA5),
                "{what}: rank {rank}: the failed op wrote its output"
            ),
            Landing::InPlace => assert!(
                outputs[rank].bytes() == original,
                "{what}: rank {rank}: the failed in-place op changed its tensor"
            ),
        }
    }
    // Every survivor notices within an I/O timeout of silence (or at once); the bound
    // leaves room for a loaded machine.
    assert!(
        t0.elapsed() < io_timeout * 5,
        "{what}: failures took {:?}",
        t0.elapsed()
    );
    for &r in &survivors {
        peers[r].1.close().await;
        peers[r].0.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mesh_peer_dropped_before_the_others_start_fails_them_with_a_peer_connection_error() {
    bounded("the dropped-peer meshes", async {
        // A core rank with an extra, a core rank without, the extra.
        drop_one_mesh_peer(0, DropAt::BeforeStart, Landing::Output).await;
        drop_one_mesh_peer(1, DropAt::BeforeStart, Landing::InPlace).await;
        drop_one_mesh_peer(4, DropAt::BeforeStart, Landing::Scratch).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mesh_peer_dropped_while_the_others_wait_fails_them_with_a_peer_connection_error() {
    bounded("the dropped-peer meshes", async {
        drop_one_mesh_peer(0, DropAt::AfterStart, Landing::InPlace).await;
        drop_one_mesh_peer(3, DropAt::AfterStart, Landing::Output).await;
        drop_one_mesh_peer(4, DropAt::AfterStart, Landing::InPlace).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unarmed_mesh_op_waits_out_silence_and_succeeds_once_the_late_peer_starts() {
    let io_timeout = Duration::from_millis(300);
    bounded("the late mesh peer", async {
        // The extra of rank 0; a core rank every other one waits for; a core rank
        // whose pair has an extra.
        for (k, late) in [(3usize, 2usize), (4, 3), (5, 1)] {
            let what = format!("mesh of {k}, rank {late} late");
            let peers = mesh_peers(k, 1 << 20, io_timeout).await;
            let (dtype, op, count) = (DType::F32, ReduceOp::Avg, 77);
            let inputs: Vec<Arc<Vec<u8>>> = (0..k)
                .map(|r| Arc::new(random_input(dtype, count, 600 + (k * 10 + r) as u64)))
                .collect();
            let outputs: Vec<Arc<Output>> = (0..k)
                .map(|_| Arc::new(Output::new(count * dtype.size())))
                .collect();
            // Unarmed until the master would confirm that the late peer started.
            let ops: Vec<RingOp> = (0..k)
                .map(|r| {
                    let s = spec(5, r, k, dtype, op);
                    mesh_into(&peers[r].1, s, &inputs[r], &outputs[r])
                        .unwrap()
                        .with_armed(r == late)
                })
                .collect();
            assert!(ops.iter().all(RingOp::is_mesh));
            let mut runs: Vec<Option<Run>> = (0..k)
                .map(|r| (r != late).then(|| tokio::spawn(ops[r].run().unwrap())))
                .collect();
            // Silence for several I/O timeouts: no stall while unarmed.
            tokio::time::sleep(io_timeout * 3).await;
            for (r, run) in runs.iter().enumerate() {
                if let Some(run) = run {
                    assert!(!run.is_finished(), "{what}: rank {r}'s unarmed op ended");
                }
            }
            assert!(peers.iter().all(|(_, ring)| ring.is_ok()), "{what}");
            runs[late] = Some(tokio::spawn(ops[late].run().unwrap()));
            for op in &ops {
                op.arm();
            }
            let want = mesh_reference(dtype, op, &plain(&inputs));
            for (r, run) in runs.into_iter().enumerate() {
                run.unwrap()
                    .await
                    .unwrap()
                    .unwrap_or_else(|e| panic!("{what}: rank {r}: {e}"));
                assert!(outputs[r].bytes() == want, "{what}: rank {r} differs");
            }
            assert!(peers.iter().all(|(_, ring)| ring.is_ok()), "{what}");
            close_all(&peers).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_armed_mesh_op_whose_partner_never_starts_stalls_after_the_io_timeout() {
    let io_timeout = Duration::from_millis(300);
    let stalled = |outcome: Result<ReduceStats, CoreError>, from: u64| match outcome {
        Err(CoreError::PeerConnection(m)) => {
            assert_eq!(
                m,
                format!("no data from peer {from} for 0.3s (stalled or dead)")
            )
        }
        other => panic!("{other:?}"),
    };
    bounded("the stalled mesh ops", async {
        // Armed from the start: rank 1 of 2 never starts.
        let peers = mesh_peers(2, 1 << 20, io_timeout).await;
        let s = spec(3, 0, 2, DType::F32, ReduceOp::Sum);
        let op = peers[0]
            .1
            .start_all_reduce_shared(s, Arc::new(random_input(DType::F32, 100, 1)))
            .unwrap();
        assert!(op.is_mesh());
        let t0 = tokio::time::Instant::now();
        stalled(op.run().unwrap().await, 2);
        let took = t0.elapsed();
        assert!(
            took >= io_timeout && took < io_timeout * 5,
            "stalled after {took:?}"
        );
        assert!(!peers[0].1.is_ok());
        close_all(&peers).await;

        // Unarmed, rank 0 of 3 waits for its extra (rank 2, which never starts) for
        // several I/O timeouts, then stalls an I/O timeout after it is armed.
        let peers = mesh_peers(3, 1 << 20, io_timeout).await;
        let s = spec(4, 0, 3, DType::F32, ReduceOp::Sum);
        let op = peers[0]
            .1
            .start_all_reduce_shared(s, Arc::new(random_input(DType::F32, 100, 2)))
            .unwrap()
            .with_armed(false);
        assert!(op.is_mesh());
        let run = tokio::spawn(op.run().unwrap());
        tokio::time::sleep(io_timeout * 3).await;
        assert!(!run.is_finished(), "an unarmed mesh op stalled");
        assert!(peers[0].1.is_ok());
        let armed_at = tokio::time::Instant::now();
        op.arm();
        stalled(run.await.unwrap(), 3);
        let took = armed_at.elapsed();
        assert!(
            took >= io_timeout && took < io_timeout * 5,
            "stalled {took:?} after arming"
        );
        assert!(!peers[0].1.is_ok());
        close_all(&peers).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mesh_peers_running_another_descriptor_fail_with_invalid_usage() {
    let io_timeout = Duration::from_millis(300);
    let different = |e: &CoreError, from: u64| match e {
        CoreError::InvalidUsage(m) => {
            assert!(
                m.starts_with(&format!("peer {from} runs a different collective as op 7 ")),
                "{m}"
            );
            assert!(m.contains("element count, dtype, reduce op"), "{m}");
        }
        other => panic!("{other:?}"),
    };
    // A peer that hears nothing stalls; one still sending when its partner failed (and
    // its reader let go of the stream) may see that send fail first.
    let stalled = |e: &CoreError| match e {
        CoreError::PeerConnection(m) => assert!(
            m.ends_with("(stalled or dead)") || m.starts_with("sending to peer"),
            "{m}"
        ),
        other => panic!("{other:?}"),
    };
    bounded("the mismatched meshes", async {
        // A mesh of 3: the extra (rank 2) sends its input to rank 0 first thing, so
        // rank 0 always receives its mismatched pieces (stashed or straight off the
        // wire) and fails before it sends anything; ranks 1 and 2 then hear nothing.
        // (dtype and element count of rank 2; the others run 100 f32.)
        for (case, (dtype2, count2)) in [(DType::F32, 101usize), (DType::I32, 100)]
            .into_iter()
            .enumerate()
        {
            let what = format!("rank 2 runs {count2} {}", dtype2.name());
            let k = 3;
            let peers = mesh_peers(k, 1 << 20, io_timeout).await;
            let (dtypes, counts) = ([DType::F32, DType::F32, dtype2], [100, 100, count2]);
            let seed = |r: usize| (700 + case * 10 + r) as u64;
            let inputs: Vec<Arc<Vec<u8>>> = (0..k)
                .map(|r| Arc::new(random_input(dtypes[r], counts[r], seed(r))))
                .collect();
            let outputs: Vec<Arc<Output>> = (0..k)
                .map(|r| Arc::new(Output::new(inputs[r].len())))
                .collect();
            let ops: Vec<RingOp> = (0..k)
                .map(|r| {
                    let s = spec(7, r, k, dtypes[r], ReduceOp::Sum);
                    // Rank 0 unarmed: it cannot stall before the pieces come.
                    mesh_into(&peers[r].1, s, &inputs[r], &outputs[r])
                        .unwrap()
                        .with_armed(r != 0)
                })
                .collect();
            assert!(ops.iter().all(RingOp::is_mesh), "{what}");
            let outcomes = run_all(&ops).await;
            different(outcomes[0].as_ref().unwrap_err(), 3);
            stalled(outcomes[1].as_ref().unwrap_err());
            stalled(outcomes[2].as_ref().unwrap_err());
            for r in 0..k {
                let want = random_input(dtypes[r], counts[r], seed(r));
                assert_untouched(&outputs[r], &inputs[r], &want, &format!("{what}: rank {r}"));
                assert!(!peers[r].1.is_ok(), "{what}: rank {r}");
            }
            close_all(&peers).await;
        }

        // A mesh of 2, f32 against i32 of as many bytes, started together: at least one
        // side lands the other's pieces (whoever registered first sends), and fails
        // with InvalidUsage; one that never hears from its partner stalls.
        let peers = mesh_peers(2, 1 << 20, io_timeout).await;
        let dtypes = [DType::F32, DType::I32];
        let inputs: Vec<Arc<Vec<u8>>> = (0..2)
            .map(|r| Arc::new(random_input(dtypes[r], 60, 800 + r as u64)))
            .collect();
        let outputs: Vec<Arc<Output>> = (0..2).map(|_| Arc::new(Output::new(240))).collect();
        let ops: Vec<RingOp> = (0..2)
            .map(|r| {
                let s = spec(7, r, 2, dtypes[r], ReduceOp::Max);
                mesh_into(&peers[r].1, s, &inputs[r], &outputs[r]).unwrap()
            })
            .collect();
        let outcomes = run_all(&ops).await;
        let mut mismatches = 0;
        for (r, outcome) in outcomes.iter().enumerate() {
            match outcome.as_ref().unwrap_err() {
                e @ CoreError::InvalidUsage(_) => {
                    different(e, 2 - r as u64);
                    mismatches += 1;
                }
                e => stalled(e),
            }
            let want = random_input(dtypes[r], 60, 800 + r as u64);
            assert_untouched(
                &outputs[r],
                &inputs[r],
                &want,
                &format!("2 peers: rank {r}"),
            );
        }
        assert!(mismatches > 0, "no peer saw the other's descriptor");
        close_all(&peers).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborting_a_waiting_mesh_op_fails_it_with_aborted_and_leaves_the_mesh_usable() {
    // A long I/O timeout: only the abort can end the op.
    let io_timeout = Duration::from_secs(10);
    bounded("the aborted mesh op", async {
        let k = 3;
        let peers = mesh_peers(k, 1 << 20, io_timeout).await;
        let (dtype, op, count) = (DType::BF16, ReduceOp::Sum, 90);
        let inputs: Vec<Arc<Vec<u8>>> = (0..k)
            .map(|r| Arc::new(random_input(dtype, count, 900 + r as u64)))
            .collect();
        // Rank 0 alone starts op 1, in place: its first step receives from its extra
        // (rank 2), which never starts, so it sends nothing and no frame can be cut.
        let tensor = Arc::new(Output::holding(inputs[0].to_vec()));
        let aborted = mesh_in_place(&peers[0].1, spec(1, 0, k, dtype, op), &tensor).unwrap();
        assert!(aborted.is_mesh());
        let run = tokio::spawn(aborted.run().unwrap());
        // Lets it reach its wait; an abort before that ends it the same way.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!run.is_finished());
        let t0 = tokio::time::Instant::now();
        aborted.abort();
        match run.await.unwrap() {
            Err(CoreError::Aborted(m)) => assert_eq!(m, "the collective was aborted"),
            other => panic!("{other:?}"),
        }
        assert!(t0.elapsed() < io_timeout / 4, "took {:?}", t0.elapsed());
        assert!(
            tensor.bytes() == *inputs[0],
            "the aborted op changed its tensor"
        );
        aborted.rollback();
        assert!(tensor.bytes() == *inputs[0]);
        // No link was poisoned: the next op on the whole mesh succeeds.
        assert!(peers.iter().all(|(_, ring)| ring.is_ok()));
        let ops: Vec<RingOp> = (0..k)
            .map(|r| {
                let s = spec(2, r, k, dtype, op);
                peers[r]
                    .1
                    .start_all_reduce_shared(s, inputs[r].clone())
                    .unwrap()
            })
            .collect();
        for r in run_all(&ops).await {
            r.unwrap();
        }
        let want = mesh_reference(dtype, op, &plain(&inputs));
        assert!(ops.iter().all(|o| o.result() == want));
        close_all(&peers).await;
    })
    .await;
}

/// Directed steps `rank` sends (and as many it receives) in a mesh all-reduce of `k`.
fn mesh_sends(rank: usize, k: usize) -> usize {
    let p = 1usize << (usize::BITS - 1 - k.leading_zeros());
    if rank >= p {
        1
    } else {
        p.trailing_zeros() as usize + usize::from(rank + p < k)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mesh_ops_count_every_byte_they_send_and_receive() {
    bounded("the mesh stats", async {
        for k in 2..=8usize {
            let peers = mesh_peers(k, 1 << 20, Duration::from_secs(10)).await;
            for (c, &(dtype, count)) in [(DType::F32, 1usize), (DType::F64, 37), (DType::U8, 100)]
                .iter()
                .enumerate()
            {
                let what = format!("mesh of {k}, {count} {}", dtype.name());
                let ops: Vec<RingOp> = (0..k)
                    .map(|r| {
                        let s = spec(c as u64, r, k, dtype, ReduceOp::Sum);
                        let input = Arc::new(random_input(dtype, count, (k * 10 + r) as u64));
                        peers[r].1.start_all_reduce_shared(s, input).unwrap()
                    })
                    .collect();
                assert!(ops.iter().all(RingOp::is_mesh));
                let stats: Vec<ReduceStats> = run_all(&ops)
                    .await
                    .into_iter()
                    .map(|r| r.unwrap_or_else(|e| panic!("{what}: {e}")))
                    .collect();
                let len = count * dtype.size();
                let piece_len = 24 / dtype.size() * dtype.size();
                let pieces = len.div_ceil(piece_len).max(1);
                let per_step = (pieces * HEADER_LEN + len) as u64;
                for (rank, st) in stats.iter().enumerate() {
                    assert!(st.tx_bytes > 0 && st.rx_bytes > 0, "{what}: rank {rank}");
                    let steps = mesh_sends(rank, k) as u64;
                    assert_eq!(st.tx_bytes, steps * per_step, "{what}: rank {rank} tx");
                    assert_eq!(st.rx_bytes, steps * per_step, "{what}: rank {rank} rx");
                }
                let tx: u64 = stats.iter().map(|s| s.tx_bytes).sum();
                let rx: u64 = stats.iter().map(|s| s.rx_bytes).sum();
                assert_eq!(tx, rx, "{what}");
            }
            close_all(&peers).await;
        }
    })
    .await;
}
