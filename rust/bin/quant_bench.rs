//! Single-threaded throughput of the quantization kernels in `_core::quant`, next to a
//! plain memcpy of the same size measured in the same run.
//!
//! Usage: `cargo run --release --bin quant_bench -- [options]`
//!
//! * `--mib N`: size of the unquantized buffer in MiB (default 64);
//! * `--reps N`: timed runs per measurement, the median is reported (default 5; one
//!   untimed warm-up run comes first);
//! * `--dtype NAME` (repeatable): input dtypes (default `float32`).
//!
//! Rates are GB/s (10^9 bytes per second) of *unquantized* data: the bytes of the `dtype`
//! buffer divided by the time, for quantize (reads it, writes 1 byte per element) as
//! for dequantize (reads 1 byte per element, writes it). memcpy copies a buffer of the same
//! size. `x memcpy` is the ratio to the memcpy measured at the start of the run.

#[path = "bench_support.rs"]
mod bench_support;

use bench_support::{gbps, time_median};
use std::hint::black_box;

use _core::quant::{
    dequantize, dequantize_reduce, quantize, quantized_len, QuantAlgorithm, WireType,
};
use _core::reduce::{DType, ReduceOp};

const USAGE: &str = "usage: quant_bench [--mib N] [--reps N] [--dtype NAME]...";

struct Args {
    mib: usize,
    reps: usize,
    dtypes: Vec<DType>,
}

fn parse_args() -> Args {
    let mut args = Args {
        mib: 64,
        reps: 5,
        dtypes: Vec::new(),
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
            "--dtype" => {
                let v = value();
                let d = DType::from_name(&v).unwrap_or_else(|| panic!("unknown dtype {v:?}"));
                args.dtypes.push(d);
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => panic!("unknown argument {other:?}\n{USAGE}"),
        }
    }
    if args.dtypes.is_empty() {
        args.dtypes = vec![DType::F32];
    }
    args
}

/// Gradient-like data: roughly normal values (sum of uniforms) of scale 1e-2.
fn fill(dtype: DType, buf: &mut [u8], seed: u64) {
    bench_support::fill(dtype, buf, seed, |r| {
        let u = |s: u32| ((r >> s) & 0xFFFF) as f64 / 65536.0;
        (u(0) + u(16) + u(32) + u(48) - 2.0) * 1e-2
    });
}

fn memcpy_gbps(dst: &mut [u8], src: &[u8], reps: usize) -> f64 {
    let t = time_median(reps, || {
        dst.copy_from_slice(black_box(src));
        black_box(&mut *dst);
    });
    gbps(src.len(), t)
}

fn main() {
    let args = parse_args();
    let n = args.mib << 20;
    let reps = args.reps;

    let mut src = vec![0u8; n];
    let mut out = vec![0u8; n];
    let mut acc = vec![0u8; n];
    let mut x = vec![0u8; n];

    println!(
        "quant_bench: {} MiB of unquantized data, single thread, median of {reps} runs",
        args.mib
    );
    println!(
        "GB/s = 1e9 bytes of unquantized data per second (input of quantize, output of dequantize)"
    );
    println!();

    fill(DType::U8, &mut src, 7);
    let memcpy_start = memcpy_gbps(&mut out, &src, reps);
    println!("memcpy {} MiB: {memcpy_start:.2} GB/s", args.mib);
    println!();
    println!(
        "{:<9} {:<8} {:<16} | {:>9} {:>8} | {:>9} {:>8} | {:>11}",
        "dtype", "wire", "algorithm", "quantize", "x memcpy", "dequant", "x memcpy", "deq+reduce"
    );
    println!("{}", "-".repeat(96));
    for &dtype in &args.dtypes {
        let count = n / dtype.size();
        fill(dtype, &mut src, 1);
        fill(dtype, &mut x, 2);
        let mut q = vec![0u8; quantized_len(count)];
        for wire in WireType::ALL {
            for alg in [QuantAlgorithm::MinMax, QuantAlgorithm::ZeroPointScale] {
                let tq = time_median(reps, || {
                    quantize(alg, wire, dtype, black_box(&src), black_box(&mut q)).unwrap();
                });
                let td = time_median(reps, || {
                    dequantize(wire, dtype, black_box(&q), black_box(&mut out)).unwrap();
                });
                let tr = time_median(reps, || {
                    dequantize_reduce(
                        wire,
                        dtype,
                        ReduceOp::Sum,
                        black_box(&q),
                        black_box(&x),
                        black_box(&mut acc),
                    )
                    .unwrap();
                });
                let (gq, gd) = (gbps(n, tq), gbps(n, td));
                println!(
                    "{:<9} {:<8} {:<16} | {:9.2} {:8.2} | {:9.2} {:8.2} | {:11.2}",
                    dtype.name(),
                    wire.name().trim_start_matches("float8_"),
                    alg.name(),
                    gq,
                    gq / memcpy_start,
                    gd,
                    gd / memcpy_start,
                    gbps(n, tr),
                );
            }
        }
        println!("{}", "-".repeat(96));
    }
    let memcpy_end = memcpy_gbps(&mut out, &src, reps);
    println!();
    println!("memcpy GB/s in this run: start {memcpy_start:.2}, end {memcpy_end:.2}");
}
