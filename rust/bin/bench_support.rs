//! Helpers shared by the kernel benchmarks (`#[path]`-included by each of them).

#![allow(dead_code)] // each benchmark uses a subset

use std::time::{Duration, Instant};

use _core::reduce::DType;
use half::{bf16, f16};

/// Median wall time of `reps` runs of `f`, after one untimed warm-up run.
pub fn time_median(reps: usize, mut f: impl FnMut()) -> Duration {
    f();
    let mut times: Vec<Duration> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    times.sort();
    times[times.len() / 2]
}

/// `bytes` per `t`, in GB/s (10^9 bytes per second).
pub fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

/// Fills `buf` with elements of `dtype` from a xorshift64* stream seeded with `seed`:
/// float types get `value(r)` for each random `r`, integer types the raw bits.
pub fn fill(dtype: DType, buf: &mut [u8], seed: u64, value: impl Fn(u64) -> f64) {
    let mut state = seed;
    let mut next = move || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_F491_4F6C_DD1D)
    };
    for e in buf.chunks_exact_mut(dtype.size()) {
        let r = next();
        let x = value(r);
        match dtype {
            DType::F16 => e.copy_from_slice(&f16::from_f64(x).to_le_bytes()),
            DType::BF16 => e.copy_from_slice(&bf16::from_f64(x).to_le_bytes()),
            DType::F32 => e.copy_from_slice(&(x as f32).to_le_bytes()),
            DType::F64 => e.copy_from_slice(&x.to_le_bytes()),
            _ => e.copy_from_slice(&r.to_le_bytes()[..e.len()]),
        }
    }
}
