//! Single-threaded throughput of the reduction kernels in `_core::reduce`, next to a plain
//! memcpy measured in the same run.
//!
//! Usage: `cargo run --release --bin reduce_bench -- [options]`
//!
//! * `--mib N`: bytes per buffer in MiB (default 64);
//! * `--reps N`: timed runs per measurement, the median is reported (default 7; one
//!   untimed warm-up run comes first);
//! * `--offset BYTES`: shift all three buffers that many bytes off 8-byte alignment, to
//!   measure the kernels' staged path for unaligned input (default 0);
//! * `--dtype NAME`, `--op NAME` (repeatable): restrict the table (default: all).
//!
//! Two rates are printed, in GB/s (10^9 bytes per second):
//! * payload: bytes of one buffer / time, i.e. how fast a chunk of all-reduce data is
//!   reduced;
//! * traffic: bytes the operation reads plus writes / time (memcpy 2x the buffer,
//!   `reduce` and `reduce_inplace` 3x, `finalize` 2x), to compare with memcpy as a
//!   fraction of memory bandwidth.

#[path = "bench_support.rs"]
mod bench_support;

use bench_support::{gbps, time_median};
use std::hint::black_box;

use _core::reduce::{finalize, reduce, reduce_inplace, DType, ReduceOp};

struct Args {
    mib: usize,
    reps: usize,
    offset: usize,
    dtypes: Vec<DType>,
    ops: Vec<ReduceOp>,
}

const USAGE: &str =
    "usage: reduce_bench [--mib N] [--reps N] [--offset BYTES] [--dtype NAME]... [--op NAME]...";

fn parse_args() -> Args {
    let mut args = Args {
        mib: 64,
        reps: 7,
        offset: 0,
        dtypes: Vec::new(),
        ops: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || -> String {
            it.next()
                .unwrap_or_else(|| panic!("{flag} needs a value\n{USAGE}"))
        };
        let number = |v: String| -> usize {
            v.parse()
                .unwrap_or_else(|_| panic!("{flag} needs a number, got {v:?}"))
        };
        match flag.as_str() {
            "--mib" => args.mib = number(value()).max(1),
            "--reps" => args.reps = number(value()).max(1),
            "--offset" => args.offset = number(value()),
            "--dtype" => {
                let v = value();
                let d = DType::from_name(&v).unwrap_or_else(|| panic!("unknown dtype {v:?}"));
                args.dtypes.push(d);
            }
            "--op" => {
                let v = value();
                let o = ReduceOp::from_name(&v).unwrap_or_else(|| panic!("unknown op {v:?}"));
                args.ops.push(o);
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => panic!("unknown argument {other:?}\n{USAGE}"),
        }
    }
    if args.dtypes.is_empty() {
        args.dtypes = DType::ALL.to_vec();
    }
    if args.ops.is_empty() {
        args.ops = ReduceOp::ALL.to_vec();
    }
    args
}

/// Fill `buf` with values of `dtype` that keep every op in the normal range: floats in
/// [0.75, 1.25) (products of a few of them stay far from subnormals), integers arbitrary.
fn fill(dtype: DType, buf: &mut [u8], seed: u64) {
    bench_support::fill(dtype, buf, seed, |r| {
        0.75 + (r >> 40) as f64 / (1u64 << 24) as f64 * 0.5
    });
}

fn memcpy_row(label: &str, dst: &mut [u8], src: &[u8], reps: usize) -> f64 {
    let n = src.len();
    let t = time_median(reps, || {
        dst.copy_from_slice(black_box(src));
        black_box(&mut *dst);
    });
    let payload = gbps(n, t);
    println!(
        "{label:<16} payload {payload:7.2}  traffic {:7.2}   ({:.2} ms per copy)",
        gbps(2 * n, t),
        t.as_secs_f64() * 1e3
    );
    payload
}

/// `len` bytes starting `offset` bytes past an 8-byte boundary, backed by `storage`.
fn buffer(storage: &mut Vec<u64>, len: usize, offset: usize) -> &mut [u8] {
    *storage = vec![0u64; (len + offset).div_ceil(8)];
    // SAFETY: any u64 storage is valid as bytes; the borrow of `storage` is carried over.
    let all = unsafe {
        std::slice::from_raw_parts_mut(storage.as_mut_ptr().cast::<u8>(), storage.len() * 8)
    };
    &mut all[offset..offset + len]
}

fn main() {
    let args = parse_args();
    let n = args.mib << 20;
    let reps = args.reps;

    let (mut sa, mut sb, mut sd) = (Vec::new(), Vec::new(), Vec::new());
    let a = buffer(&mut sa, n, args.offset);
    let b = buffer(&mut sb, n, args.offset);
    let dst = buffer(&mut sd, n, args.offset);

    println!(
        "reduce_bench: {} MiB per buffer, buffers {} bytes off 8-byte alignment, single \
         thread, median of {reps} runs",
        args.mib, args.offset
    );
    println!(
        "GB/s = 1e9 B/s; payload = buffer bytes / time; traffic = bytes read + written / time"
    );
    println!();

    fill(DType::U8, a, 1);
    let memcpy_start = memcpy_row("memcpy (start)", dst, a, reps);
    println!();

    println!(
        "{:<9} {:<5} | {:>22} | {:>22}",
        "dtype", "op", "reduce payload/traffic", "inplace payload/traffic"
    );
    println!("{}", "-".repeat(66));
    let mut finalize_rows = Vec::new();
    for &dtype in &args.dtypes {
        fill(dtype, a, 1);
        fill(dtype, b, 2);
        for &op in &args.ops {
            let t3 = time_median(reps, || {
                reduce(
                    dtype,
                    op,
                    black_box(&mut *dst),
                    black_box(&*a),
                    black_box(&*b),
                )
                .unwrap();
            });
            // The accumulator keeps accumulating across runs; the inputs are chosen so
            // this stays in the normal range for the handful of runs done here.
            dst.copy_from_slice(a);
            let t2 = time_median(reps, || {
                reduce_inplace(dtype, op, black_box(&mut *dst), black_box(&*b)).unwrap();
            });
            println!(
                "{:<9} {:<5} | {:9.2} / {:9.2} | {:9.2} / {:9.2}",
                dtype.name(),
                op.name(),
                gbps(n, t3),
                gbps(3 * n, t3),
                gbps(n, t2),
                gbps(3 * n, t2),
            );
        }
        dst.copy_from_slice(a);
        let tf = time_median(reps, || {
            finalize(dtype, ReduceOp::Avg, black_box(&mut *dst), 3).unwrap();
        });
        finalize_rows.push((dtype, tf));
        println!("{}", "-".repeat(66));
    }

    println!("\nfinalize(avg, world=3), in place: payload / traffic");
    for (dtype, t) in finalize_rows {
        println!(
            "{:<9} {:9.2} / {:9.2}",
            dtype.name(),
            gbps(n, t),
            gbps(2 * n, t)
        );
    }

    println!();
    fill(DType::U8, a, 3);
    let memcpy_end = memcpy_row("memcpy (end)", dst, a, reps);
    println!("\nmemcpy payload GB/s in this run: start {memcpy_start:.2}, end {memcpy_end:.2}");
}
