//! The loops of the quantizer: a statistics pass (finite min / max, any NaN or infinity),
//! an encoding pass (one code byte per element) and a table-driven decoding pass.
//!
//! Inputs are raw little-endian bytes. When they are aligned for the element type (and
//! the host is little-endian) the loops run directly on typed slices; otherwise blocks are
//! copied into an aligned stack buffer first. Half-precision inputs are widened to `f32`
//! inside the loops with branch-free integer code (exact, and it vectorises), so every
//! dtype is one fused pass. Every element is encoded by the same scalar function whatever
//! the path, and the statistics are order independent, so alignment never changes a bit
//! of the output.
//!
//! The encoder and statistics loops are compiled twice: portable (the crate's baseline
//! target, SSE2 on x86-64) and, on x86-64, with AVX2 enabled, picked at run time. Both
//! use only IEEE add / subtract / multiply / compare-select, integer operations and
//! exact int-to-float conversions (never fused multiply-add: Rust does not contract), so
//! they produce identical bits; the tests run both.

use std::mem::size_of;
use std::ops::{Add, Sub};

use half::{bf16, f16};

use super::minifloat::{Fp8, ROUND_MAGIC};
use crate::pod::{view, Pod};

/// Elements per staged block.
const BLOCK: usize = 256;

// ---------------------------------------------------------------------------------------
// Typed views of byte slices (the `Pod` views themselves live in `crate::pod`)
// ---------------------------------------------------------------------------------------

/// An aligned stack buffer for one block of the widest element type.
type Stage = crate::pod::Stage<{ BLOCK * 8 }>;

/// Hand the `T` elements in `src` to `f` in order, as one typed slice when possible or
/// else as staged blocks; `f` also gets the index of the block's first element.
fn typed_blocks<T: Pod>(src: &[u8], mut f: impl FnMut(usize, &[T])) {
    if let Some(all) = view::<T>(src) {
        f(0, all);
        return;
    }
    let mut stage = Stage::new();
    for (i, chunk) in src.chunks(BLOCK * size_of::<T>()).enumerate() {
        f(i * BLOCK, stage.load::<T>(chunk));
    }
}

/// Element types as stored in the input; the loops compute on [`Input::Wide`].
pub(super) trait Input: Pod {
    type Wide: Elem;
    /// Exact conversion to the computation type.
    fn widen(self) -> Self::Wide;
}

impl Input for f32 {
    type Wide = f32;
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl Input for f64 {
    type Wide = f64;
    #[inline(always)]
    fn widen(self) -> f64 {
        self
    }
}

impl Input for bf16 {
    type Wide = f32;
    /// bfloat16 is the top half of an `f32`.
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
}

impl Input for f16 {
    type Wide = f32;
    #[inline(always)]
    fn widen(self) -> f32 {
        f16_bits_to_f32(self.to_bits())
    }
}

/// IEEE half to `f32`, exactly, without branches (three candidates and selects) so that
/// loops over it vectorise. NaNs stay NaN (payload shifted along, not quieted), which is
/// all the quantizer needs.
#[inline(always)]
pub(super) fn f16_bits_to_f32(h: u16) -> f32 {
    let h = u32::from(h);
    let sign = (h & 0x8000) << 16;
    let em = h & 0x7FFF;
    // Normal numbers: exponent and mantissa move up 13 bits, the bias goes from 15 to 127.
    let normal = (em << 13) + ((127 - 15) << 23);
    // Zero and subnormals: the 10-bit integer mantissa times 2^-24 (exact, no subnormal
    // arithmetic in f32).
    let sub = (em as i32 as f32 * (1.0 / 16_777_216.0)).to_bits();
    // Infinities and NaN: all exponent bits set.
    let special = (em << 13) | 0x7F80_0000;
    let bits = if em < 0x0400 {
        sub
    } else if em >= 0x7C00 {
        special
    } else {
        normal
    };
    f32::from_bits(bits | sign)
}

/// Element type of the statistics and encoding loops.
pub(super) trait Elem: Pod + PartialOrd + Add<Output = Self> + Sub<Output = Self> {
    const ZERO: Self;
    const INFINITY: Self;
    const NEG_INFINITY: Self;
    fn to_f64(self) -> f64;
}

impl Elem for f32 {
    const ZERO: Self = 0.0;
    const INFINITY: Self = f32::INFINITY;
    const NEG_INFINITY: Self = f32::NEG_INFINITY;
    #[inline(always)]
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
}

impl Elem for f64 {
    const ZERO: Self = 0.0;
    const INFINITY: Self = f64::INFINITY;
    const NEG_INFINITY: Self = f64::NEG_INFINITY;
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self
    }
}

/// Whether the AVX2 versions of the loops may run on this CPU (`std` caches the answer).
pub(super) fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

// ---------------------------------------------------------------------------------------
// Statistics
// ---------------------------------------------------------------------------------------

/// What the encoder needs to know about a chunk.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Stats {
    /// Smallest and largest finite value; both `0.0` when there is none. A zero is always
    /// reported as `+0.0` (which zero the lanes happened to keep is not deterministic
    /// otherwise).
    pub min: f64,
    pub max: f64,
    /// Whether any element is NaN or infinite.
    pub nonfinite: bool,
}

/// Independent accumulators, so the loop vectorises without reassociating anything.
const LANES: usize = 16;

struct Lanes<F: Elem> {
    lo: [F; LANES],
    hi: [F; LANES],
    /// Sum of `x - x`: stays zero unless some `x` is NaN or infinite, then becomes NaN.
    bad: [F; LANES],
}

impl<F: Elem> Lanes<F> {
    fn new() -> Self {
        Lanes {
            lo: [F::INFINITY; LANES],
            hi: [F::NEG_INFINITY; LANES],
            bad: [F::ZERO; LANES],
        }
    }

    /// Fold one element into lane `j`. With `FINITE_ONLY`, NaN and infinities are skipped.
    #[inline(always)]
    fn step<const FINITE_ONLY: bool>(&mut self, j: usize, x: F) {
        // `x - x` on purpose: 0 for finite `x`, NaN otherwise.
        #[allow(clippy::eq_op)]
        let z = x - x;
        let (l, h) = if FINITE_ONLY {
            let finite = z == F::ZERO;
            (
                if finite { x } else { F::INFINITY },
                if finite { x } else { F::NEG_INFINITY },
            )
        } else {
            (x, x)
        };
        // A NaN never wins these comparisons.
        self.lo[j] = if l < self.lo[j] { l } else { self.lo[j] };
        self.hi[j] = if h > self.hi[j] { h } else { self.hi[j] };
        self.bad[j] = self.bad[j] + z;
    }

    #[inline(always)]
    fn feed<I: Input<Wide = F>, const FINITE_ONLY: bool>(&mut self, xs: &[I]) {
        let mut chunks = xs.chunks_exact(LANES);
        for c in &mut chunks {
            for (j, &x) in c.iter().enumerate() {
                self.step::<FINITE_ONLY>(j, x.widen());
            }
        }
        for (j, &x) in chunks.remainder().iter().enumerate() {
            self.step::<FINITE_ONLY>(j, x.widen());
        }
    }

    fn finish(&self) -> Stats {
        let mut lo = f64::INFINITY;
        let mut hi = f64::NEG_INFINITY;
        let mut nonfinite = false;
        for j in 0..LANES {
            let (l, h, b) = (
                self.lo[j].to_f64(),
                self.hi[j].to_f64(),
                self.bad[j].to_f64(),
            );
            lo = if l < lo { l } else { lo };
            hi = if h > hi { h } else { hi };
            nonfinite |= b.is_nan();
        }
        if lo > hi {
            // No finite element (or none at all).
            return Stats {
                min: 0.0,
                max: 0.0,
                nonfinite,
            };
        }
        // `-0.0 + 0.0 == +0.0`: report zeros unsigned.
        Stats {
            min: lo + 0.0,
            max: hi + 0.0,
            nonfinite,
        }
    }
}

/// `Lanes::feed` compiled with AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn feed_avx2<I: Input, const FINITE_ONLY: bool>(lanes: &mut Lanes<I::Wide>, xs: &[I]) {
    lanes.feed::<I, FINITE_ONLY>(xs)
}

#[inline(always)]
fn feed<I: Input, const FINITE_ONLY: bool>(simd: bool, lanes: &mut Lanes<I::Wide>, xs: &[I]) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is only true when the CPU supports AVX2.
        unsafe { feed_avx2::<I, FINITE_ONLY>(lanes, xs) };
        return;
    }
    let _ = simd;
    lanes.feed::<I, FINITE_ONLY>(xs)
}

/// One pass over `src`; `min` / `max` are only meaningful when `nonfinite` is false.
fn stats_pass<I: Input, const FINITE_ONLY: bool>(src: &[u8], simd: bool) -> Stats {
    let mut lanes = Lanes::<I::Wide>::new();
    typed_blocks::<I>(src, |_, b| feed::<I, FINITE_ONLY>(simd, &mut lanes, b));
    lanes.finish()
}

fn stats_of<I: Input>(src: &[u8], simd: bool) -> Stats {
    let s = stats_pass::<I, false>(src, simd);
    if !s.nonfinite {
        return s;
    }
    // Only when the chunk holds NaN or infinities: a second pass that skips them.
    let f = stats_pass::<I, true>(src, simd);
    Stats {
        nonfinite: true,
        ..f
    }
}

/// Finite min / max and the non-finite flag of `src` (little-endian `dtype` elements).
/// One pass; a second one only when the chunk holds NaN or infinities.
pub(super) fn stats(dtype: FloatType, src: &[u8], simd: bool) -> Stats {
    match dtype {
        FloatType::F16 => stats_of::<f16>(src, simd),
        FloatType::BF16 => stats_of::<bf16>(src, simd),
        FloatType::F32 => stats_of::<f32>(src, simd),
        FloatType::F64 => stats_of::<f64>(src, simd),
    }
}

/// The floating-point dtypes the quantizer accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum FloatType {
    F16,
    BF16,
    F32,
    F64,
}

// ---------------------------------------------------------------------------------------
// Encoding
// ---------------------------------------------------------------------------------------

/// Per-element encoder. `code` must be branch-free for finite input so the loops
/// vectorise; it is only called with finite `x` unless the chunk is flagged non-finite,
/// in which case `code_nonfinite` overrides its result for NaN and infinities.
pub(super) trait Encoder: Copy {
    fn code(&self, x: f64) -> u8;
    /// Codes for NaN, +Inf and -Inf.
    fn specials(&self) -> [u8; 3];

    #[inline(always)]
    fn code_nonfinite(&self, x: f64) -> u8 {
        let [nan, pinf, ninf] = self.specials();
        let c = self.code(x);
        let c = if x.is_nan() { nan } else { c };
        let c = if x == f64::INFINITY { pinf } else { c };
        if x == f64::NEG_INFINITY {
            ninf
        } else {
            c
        }
    }
}

/// The integer wire types: `code = offset + round_half_even(clamp((x * pre - sub) * mul +
/// add, 0, top))`, the low byte of that integer (two's complement for `I8`). Rounding
/// happens in code units relative to `qmin` and `offset = qmin` is added afterwards as an
/// integer, so `U8` and `I8` pick the same level for every element.
#[derive(Clone, Copy, Debug)]
pub(super) struct Affine {
    pub pre: f64,
    pub sub: f64,
    pub mul: f64,
    pub add: f64,
    pub top: f64,
    pub offset: u8,
    pub specials: [u8; 3],
}

impl Encoder for Affine {
    #[inline(always)]
    fn code(&self, x: f64) -> u8 {
        let t = (x * self.pre - self.sub) * self.mul + self.add;
        let t = if t < 0.0 { 0.0 } else { t };
        let t = if t > self.top { self.top } else { t };
        // `t` is within [0, 255]: the magic addition rounds it to an integer that sits in
        // the low bits of the sum.
        ((t + ROUND_MAGIC).to_bits() as u8).wrapping_add(self.offset)
    }

    #[inline(always)]
    fn specials(&self) -> [u8; 3] {
        self.specials
    }
}

/// The 8-bit float wire types: `code = fp8_saturating((x * pre) * mul)`. The format is a
/// type parameter so its constants fold into the loop.
#[derive(Clone, Copy, Debug)]
pub(super) struct Float8<const E5M2: bool> {
    pub pre: f64,
    pub mul: f64,
    /// Largest finite value used (the value of the largest code).
    pub fmax: f64,
    pub specials: [u8; 3],
}

impl<const E5M2: bool> Encoder for Float8<E5M2> {
    #[inline(always)]
    fn code(&self, x: f64) -> u8 {
        let fmt = if E5M2 { Fp8::E5M2 } else { Fp8::E4M3 };
        fmt.encode(x * self.pre * self.mul, self.fmax)
    }

    #[inline(always)]
    fn specials(&self) -> [u8; 3] {
        self.specials
    }
}

#[inline(always)]
fn encode_loop<I: Input, E: Encoder, const NONFINITE: bool>(xs: &[I], out: &mut [u8], e: &E) {
    let out = &mut out[..xs.len()];
    for (o, &x) in out.iter_mut().zip(xs) {
        let x = x.widen().to_f64();
        *o = if NONFINITE {
            e.code_nonfinite(x)
        } else {
            e.code(x)
        };
    }
}

/// `encode_loop` compiled with AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn encode_avx2<I: Input, E: Encoder, const NONFINITE: bool>(xs: &[I], out: &mut [u8], e: &E) {
    encode_loop::<I, E, NONFINITE>(xs, out, e)
}

#[inline(always)]
fn encode_block<I: Input, E: Encoder, const NONFINITE: bool>(
    simd: bool,
    xs: &[I],
    out: &mut [u8],
    e: &E,
) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is only true when the CPU supports AVX2.
        unsafe { encode_avx2::<I, E, NONFINITE>(xs, out, e) };
        return;
    }
    let _ = simd;
    encode_loop::<I, E, NONFINITE>(xs, out, e)
}

fn encode_as<I: Input, E: Encoder, const NONFINITE: bool>(
    src: &[u8],
    codes: &mut [u8],
    e: &E,
    simd: bool,
) {
    typed_blocks::<I>(src, |i, b| {
        encode_block::<I, E, NONFINITE>(simd, b, &mut codes[i..], e)
    })
}

fn encode_typed<E: Encoder, const NONFINITE: bool>(
    dtype: FloatType,
    src: &[u8],
    codes: &mut [u8],
    e: &E,
    simd: bool,
) {
    match dtype {
        FloatType::F16 => encode_as::<f16, E, NONFINITE>(src, codes, e, simd),
        FloatType::BF16 => encode_as::<bf16, E, NONFINITE>(src, codes, e, simd),
        FloatType::F32 => encode_as::<f32, E, NONFINITE>(src, codes, e, simd),
        FloatType::F64 => encode_as::<f64, E, NONFINITE>(src, codes, e, simd),
    }
}

/// Encode every element of `src` into `codes` (one byte each, same count).
pub(super) fn encode<E: Encoder>(
    dtype: FloatType,
    src: &[u8],
    codes: &mut [u8],
    e: &E,
    nonfinite: bool,
    simd: bool,
) {
    if nonfinite {
        encode_typed::<E, true>(dtype, src, codes, e, simd)
    } else {
        encode_typed::<E, false>(dtype, src, codes, e, simd)
    }
}

// ---------------------------------------------------------------------------------------
// Decoding
// ---------------------------------------------------------------------------------------

/// `dst[i] = table[codes[i]]`, each entry `N` little-endian bytes. Any alignment.
pub(super) fn decode<const N: usize>(codes: &[u8], table: &[[u8; N]; 256], dst: &mut [u8]) {
    for (o, &c) in dst.chunks_exact_mut(N).zip(codes) {
        o.copy_from_slice(&table[usize::from(c)]);
    }
}
