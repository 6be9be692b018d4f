//! Throughput of `_core::hash::content_hash` on one big buffer, on one thread and on all
//! cores, next to a plain memcpy of the same buffer measured in the same run.
//!
//! Usage: `cargo run --release --bin hash_bench -- [--mib N] [--reps N]`
//!
//! * `--mib N`: buffer size in MiB (default 1024);
//! * `--reps N`: timed runs per row, the median is reported (default 5; one untimed
//!   warm-up run comes first).
//!
//! Rates are bytes of the buffer / time in GB/s (10^9 bytes per second). Note that the
//! hash only reads the buffer while memcpy reads it and writes a second one, so memcpy
//! moves twice the bytes through memory for the same payload.

#[path = "bench_support.rs"]
mod bench_support;

use bench_support::time_median;
use std::hint::black_box;
use std::time::Duration;

use _core::hash::{content_hash, content_hash_threads};

const USAGE: &str = "usage: hash_bench [--mib N] [--reps N]";

fn parse_args() -> (usize, usize) {
    let (mut mib, mut reps) = (1024usize, 5usize);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value: usize = it
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{flag} needs a number\n{USAGE}"));
        match flag.as_str() {
            "--mib" => mib = value.max(1),
            "--reps" => reps = value.max(1),
            _ => panic!("unknown option {flag:?}\n{USAGE}"),
        }
    }
    (mib, reps)
}

/// memcpy of `src` into `dst` split into `threads` contiguous pieces.
fn parallel_copy(dst: &mut [u8], src: &[u8], threads: usize) {
    let piece = src.len().div_ceil(threads.max(1));
    std::thread::scope(|s| {
        for (d, c) in dst.chunks_mut(piece).zip(src.chunks(piece)) {
            s.spawn(move || d.copy_from_slice(c));
        }
    });
}

fn main() {
    let (mib, reps) = parse_args();
    let len = mib << 20;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());

    // Non-trivial contents; both buffers are written once so no page is faulted in
    // during a timed run.
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let src: Vec<u8> = (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let mut dst = vec![1u8; len];

    println!("hash_bench: {mib} MiB buffer, median of {reps} runs, {cores} cores available");
    let reference = content_hash_threads(&src, 1);
    println!("content_hash = {reference:032x}");
    println!();

    let gbs = |t: Duration| len as f64 / t.as_secs_f64() / 1e9;
    let mut rows: Vec<(String, Duration)> = Vec::new();

    rows.push((
        "memcpy, 1 thread".into(),
        time_median(reps, || {
            dst.copy_from_slice(black_box(&src));
            black_box(&mut dst);
        }),
    ));
    if cores > 1 {
        rows.push((
            format!("memcpy, {cores} threads"),
            time_median(reps, || {
                parallel_copy(&mut dst, black_box(&src), cores);
                black_box(&mut dst);
            }),
        ));
    }
    rows.push((
        "content_hash_threads(.., 1)".into(),
        time_median(reps, || {
            assert_eq!(content_hash_threads(black_box(&src), 1), reference);
        }),
    ));
    rows.push((
        format!("content_hash (auto, {cores} threads)"),
        time_median(reps, || {
            assert_eq!(content_hash(black_box(&src)), reference);
        }),
    ));

    let width = rows.iter().map(|(name, _)| name.len()).max().unwrap_or(0);
    println!("{:<width$}  {:>10}  {:>8}", "what", "time ms", "GB/s");
    for (name, t) in &rows {
        println!(
            "{name:<width$}  {:>10.2}  {:>8.2}",
            t.as_secs_f64() * 1e3,
            gbs(*t)
        );
    }
}
