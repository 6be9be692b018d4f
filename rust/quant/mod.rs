//! Quantization of all-reduce payloads for the wire: floating-point chunks are sent as one
//! byte per element plus a small header, and de-quantized (and reduced) on arrival.
//!
//! # Interface
//!
//! * [`quantize`]`(alg, wire, dtype, src, dst)`: `src` holds `count` little-endian
//!   elements of `dtype` (`F16`, `BF16`, `F32` or `F64`); `dst` must be exactly
//!   [`quantized_len`]`(count) == PARAMS_LEN + count` bytes and receives the
//!   [`QuantParams`] header followed by one code byte per element.
//! * [`dequantize`]`(wire, dtype, src, dst)`: the inverse; `dst` holds `count` elements of
//!   `dtype`, `src` must be `PARAMS_LEN + count` bytes.
//! * [`dequantize_reduce`]`(wire, dtype, op, src, x, acc)`: `acc = dequantized (op) x`,
//!   bit for bit what [`dequantize`] into a temporary followed by
//!   [`crate::reduce::reduce`]`(dtype, op, acc, temporary, x)` gives, without the
//!   temporary. [`dequantize_reduce_inplace`] is the same with
//!   [`crate::reduce::reduce_inplace`]: `acc = acc (op) dequantized`. As in the reduce
//!   module, [`ReduceOp::Avg`] adds here and is divided later by `finalize`.
//! * [`QuantParams::from_bytes`] / [`QuantParams::to_bytes`] read and write the header;
//!   [`QuantParams::scale`] and [`QuantParams::zero_point`] expose the derived grid.
//!
//! All slices are raw little-endian bytes and may have any alignment. Accumulation never
//! happens in 8 bits: codes are turned back into the chunk's own dtype first.
//!
//! # Wire format
//!
//! A quantized chunk is `PARAMS_LEN` (24) header bytes, then `count` code bytes. The
//! header, all fields little-endian:
//!
//! | offset | size | field | meaning |
//! |-------:|-----:|-------|---------|
//! | 0  | 1 | `algorithm` | [`QuantAlgorithm`] discriminant: 1 `MinMax`, 2 `ZeroPointScale` (0 is rejected) |
//! | 1  | 1 | `wire`      | [`WireType`] discriminant: 8 `U8`, 4 `I8`, 12 `F8E4M3`, 13 `F8E5M2` |
//! | 2  | 1 | `dtype`     | [`DType`] of the original data: 0 `F16`, 1 `BF16`, 2 `F32`, 3 `F64` |
//! | 3  | 1 | `flags`     | bit 0 `NONFINITE`: the chunk held NaN or ±infinity (see below); other bits 0 |
//! | 4  | 2 | `exp_shift` | `i16` `e`: the encoder worked on `x * 2^-e` (see "Range scaling"); 0, 8 or -128 |
//! | 6  | 2 | reserved    | 0 |
//! | 8  | 8 | `min`       | `f64`: smallest finite element (`+0.0` for a zero; `0.0` if there is none) |
//! | 16 | 8 | `max`       | `f64`: largest finite element (`0.0` if there is none) |
//!
//! `min` and `max` are values of the original dtype, stored exactly. Everything else
//! (scale, zero point, the code table) is derived from the header by the same IEEE `f64`
//! operations on both ends. A receiver rejects a header that the encoder could not have
//! produced (unknown bytes, non-finite or unordered `min`/`max`, values not
//! representable in the dtype, a wrong `exp_shift`) with [`CoreError::Protocol`].
//!
//! # Integer wire types (`U8`: codes 0..=255, `I8`: codes -128..=127)
//!
//! Let `[qmin, qmax]` be the code range (the top three codes are reserved when the chunk
//! is flagged `NONFINITE`, see below) and `L = qmax - qmin` (255, or 252 when flagged).
//! All arithmetic is `f64` (exact widening of `f16`/`bf16`/`f32`), `round` is round half
//! to even, `clamp(v, a, b)` limits `v` to `[a, b]`.
//!
//! * **`MinMax`**: `lo = min`, `hi = max`, `scale = (hi - lo) / L`,
//!   `code = qmin + round(clamp((x - lo) * (L / (hi - lo)), 0, L))`;
//!   de-quantized value `lo + (code - qmin) * scale`. The codes `qmin` and `qmax` decode
//!   to exactly `min` and `max`.
//! * **`ZeroPointScale`**: the range is first widened to contain zero,
//!   `lo = min(min, 0)`, `hi = max(max, 0)` (without this a chunk of only positive
//!   values would have no usable zero point and an unbounded error);
//!   `scale = (hi - lo) / L`, `zero_point = qmin + round(-lo / scale)` (equal to
//!   `round(qmin - lo / scale)` as `qmin` is even; it always lies in `[qmin, qmax]`),
//!   `code = qmin + round(clamp(x * (L / (hi - lo)) + (zero_point - qmin), 0, L))`;
//!   de-quantized value `(code - zero_point) * scale`. Zero is exact (it encodes to
//!   `zero_point` and decodes to `+0.0`). When the zero point sits at `qmin` (a chunk
//!   with no negative values) the code `qmax` decodes to exactly `max`; when it sits at
//!   `qmax`, `qmin` decodes to exactly `min`.
//! * Rounding happens in code units counted from `qmin`, so `U8` and `I8` are the same
//!   quantizer: for every element the `I8` code is the `U8` code XOR `0x80`, and both
//!   decode to the same value.
//! * For both, de-quantized values are clamped to `[lo, hi]` (only rounding at the ends
//!   can reach outside), then rounded once, to nearest even, to the dtype.
//!   When `hi == lo` (constant, all-zero or empty chunks) `scale` is 0, every element
//!   encodes to one code and no division by zero happens.
//!
//! # 8-bit float wire types (`F8E4M3` = OCP E4M3FN, `F8E5M2`)
//!
//! Both algorithms use the same symmetric scaling (a float format has no zero point:
//! zero, with its sign, is always exact); only the header's algorithm byte differs.
//! With `m = max(|min|, |max|)` and `FMAX` the largest finite value used (448 for E4M3,
//! 416 = `0x7D` for E4M3 when flagged, 57344 for E5M2):
//! `code = fp8(x * (FMAX / m))`, rounding to nearest even and saturating at `±FMAX`;
//! de-quantized value `value(code) * (m / FMAX)`, clamped to `[-m, m]` and rounded to the
//! dtype. The codes `±FMAX` decode to exactly `±m`. `m == 0` encodes every element to
//! (signed) zero.
//!
//! # Error bounds
//!
//! For every finite element `x` with de-quantized value `x'`, writing `S` for
//! [`QuantParams::scale`], `R = max(|min|, |max|)` and `ulp(x')` for the spacing of the
//! dtype at `|x'|`:
//!
//! * `U8` / `I8`, both algorithms: `|x' - x| <= S * (1/2 + 2^-40) + 2^-48 * R + ulp(x') / 2`.
//!   The `2^-40` / `2^-48` terms cover the `f64` arithmetic; they are far below the final
//!   rounding except for `f64` data.
//! * 8-bit floats: `|x' - x| <= 2^-(p+1) * |x| + 2^-(b+p) * S + 2^-48 * R + ulp(x') / 2`
//!   with `p` the stored mantissa bits and `b` the exponent bias: `2^-4 |x| + 2^-10 S` for
//!   E4M3, `2^-3 |x| + 2^-17 S` for E5M2. The second term is the format's subnormal range
//!   (elements smaller than `2^(1-b) * S`); there the error is absolute, not relative.
//!
//! # NaN and infinities
//!
//! A chunk with any NaN or ±infinity is flagged `NONFINITE`. Its `min` / `max` (and so the
//! grid) are taken over the finite elements only, and three codes are reserved so every
//! element keeps its class: NaN decodes to the dtype's canonical quiet NaN (`0x7E00`,
//! `0x7FC0`, `0x7FC00000`, `0x7FF8000000000000`, the same as the reduce module; sign and
//! payload are not kept), +infinity to +infinity, -infinity to -infinity.
//!
//! | wire | NaN | +Inf | -Inf | finite codes |
//! |------|-----|------|------|--------------|
//! | `U8`     | 255    | 254    | 253    | 0..=252 |
//! | `I8`     | 127    | 126    | 125    | -128..=124 |
//! | `F8E4M3` | `0x7F` | `0x7E` | `0xFE` | up to ±416 (`0x7D`) |
//! | `F8E5M2` | `0x7E` | `0x7C` | `0xFC` | up to ±57344, as unflagged |
//!
//! Unflagged chunks use every code for finite values. A chunk with no finite element at
//! all gets `min = max = 0`.
//!
//! # Edge cases
//!
//! * Empty chunk: just the header (`min = max = 0`, no flags).
//! * Constant chunk (including all-zero): every algorithm and wire type gives back the
//!   constant exactly (in particular no division by zero). Zeros lose their sign with
//!   `U8` / `I8` (`-0.0` comes back as `+0.0`); 8-bit floats keep it.
//! * Huge ranges: the arithmetic is `f64`, so `f16`/`bf16`/`f32` data up to their
//!   largest finite values (e.g. `-3.4e38..3.4e38`) quantize without overflow.
//! * Subnormal `f16`/`bf16`/`f32` values are normal numbers in `f64`; nothing special.
//! * Range scaling (`f64` data only): if `R >= 2^1000` the encoder works on `x * 2^-8`
//!   (`exp_shift = 8`) so that `max - min` cannot overflow; if `0 < R < 2^-900` it works on
//!   `x * 2^128` (`exp_shift = -128`) so that the grid step is a normal number. The decoder
//!   multiplies by `2^exp_shift` again (exact, or one rounding into `f64`'s subnormals).
//!   The bounds above hold in both cases.
//!
//! # Determinism
//!
//! Quantizing and de-quantizing are pure functions of the input bytes: the same bytes
//! come out on every machine, for any alignment of the slices, with or without the AVX2
//! code path (no fused multiply-add, round-half-even done with explicit IEEE additions,
//! NaNs canonical). De-quantization goes through a 256-entry table built per call, so a
//! code always decodes to the same value. As in the reduce module this assumes the
//! default floating-point environment (round to nearest, no flush-to-zero).
//!
//! # Errors
//!
//! [`CoreError::InvalidArgument`] for a non-float dtype, [`QuantAlgorithm::None`] passed
//! to [`quantize`], or slice lengths that do not match; [`CoreError::Protocol`] for a
//! header that is malformed or disagrees with the `wire` / `dtype` the receiver expects.
//! On error no output byte is written.

mod kernels;
mod minifloat;
#[cfg(test)]
mod tests;

use half::{bf16, f16};

use crate::error::{CoreError, CoreResult};
use crate::reduce::{reduce, reduce_inplace, DType, ReduceOp};

use kernels::{Affine, Float8, FloatType};
use minifloat::{f64_to_bf16_bits, f64_to_f16_bits, pow2, Fp8};

// ---------------------------------------------------------------------------------------
// Public enums and constants
// ---------------------------------------------------------------------------------------

/// Quantization algorithm. The discriminants match the Python `QuantizationAlgorithm`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum QuantAlgorithm {
    /// No quantization (the data travels in its own dtype); not accepted by [`quantize`].
    None = 0,
    MinMax = 1,
    ZeroPointScale = 2,
}

impl QuantAlgorithm {
    /// Every algorithm, in discriminant order.
    pub const ALL: [QuantAlgorithm; 3] = [
        QuantAlgorithm::None,
        QuantAlgorithm::MinMax,
        QuantAlgorithm::ZeroPointScale,
    ];

    /// The algorithm with code `v`, if there is one.
    pub fn from_u8(v: u8) -> Option<QuantAlgorithm> {
        QuantAlgorithm::ALL.get(usize::from(v)).copied()
    }

    /// Upper-case name as in Python, e.g. `"MIN_MAX"`.
    pub fn name(self) -> &'static str {
        match self {
            QuantAlgorithm::None => "NONE",
            QuantAlgorithm::MinMax => "MIN_MAX",
            QuantAlgorithm::ZeroPointScale => "ZERO_POINT_SCALE",
        }
    }
}

/// Type of the code bytes on the wire. The discriminants match the Python `DataType`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum WireType {
    U8 = 8,
    I8 = 4,
    F8E4M3 = 12,
    F8E5M2 = 13,
}

impl WireType {
    /// Every wire type.
    pub const ALL: [WireType; 4] = [
        WireType::U8,
        WireType::I8,
        WireType::F8E4M3,
        WireType::F8E5M2,
    ];

    /// The wire type with code `v`, if there is one.
    pub fn from_u8(v: u8) -> Option<WireType> {
        WireType::ALL.iter().copied().find(|w| *w as u8 == v)
    }

    /// numpy / torch style name, e.g. `"float8_e4m3fn"`.
    pub fn name(self) -> &'static str {
        match self {
            WireType::U8 => "uint8",
            WireType::I8 => "int8",
            WireType::F8E4M3 => "float8_e4m3fn",
            WireType::F8E5M2 => "float8_e5m2",
        }
    }

    fn fp8(self) -> Option<Fp8> {
        match self {
            WireType::F8E4M3 => Some(Fp8::E4M3),
            WireType::F8E5M2 => Some(Fp8::E5M2),
            WireType::U8 | WireType::I8 => None,
        }
    }
}

/// Size of the [`QuantParams`] header in front of the codes.
pub const PARAMS_LEN: usize = 24;

/// Total bytes of a quantized chunk of `count` elements: the header plus one byte each.
pub fn quantized_len(count: usize) -> usize {
    PARAMS_LEN + count
}

/// `flags` bit: the chunk held NaN or infinities and reserved codes are in use.
const FLAG_NONFINITE: u8 = 1;

// ---------------------------------------------------------------------------------------
// Parameters
// ---------------------------------------------------------------------------------------

/// The per-chunk header, serialised as the first [`PARAMS_LEN`] bytes of a quantized
/// chunk (layout in the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QuantParams {
    pub algorithm: QuantAlgorithm,
    pub wire: WireType,
    /// Dtype of the original (and de-quantized) data.
    pub dtype: DType,
    /// The chunk held NaN or infinities; reserved codes are in use.
    pub nonfinite: bool,
    /// The encoder worked on `x * 2^-exp_shift` (0 except for extreme `f64` chunks).
    pub exp_shift: i16,
    /// Smallest / largest finite element (both 0 if there is none).
    pub min: f64,
    pub max: f64,
}

/// The grid both ends derive from the header, in the scaled domain (values `* 2^-e`).
struct Grid {
    /// `2^-e` and `2^e`.
    pre: f64,
    post: f64,
    kind: GridKind,
}

enum GridKind {
    Int {
        /// Code range for finite values (reserved codes excluded).
        qmin: i32,
        qmax: i32,
        /// Range covered, `lo <= hi` (widened to contain zero for `ZeroPointScale`).
        lo: f64,
        hi: f64,
        /// Step between codes and `L / (hi - lo)` (both 0 for an empty range).
        scale: f64,
        inv: f64,
        /// `qmin` for `MinMax`.
        zero_point: i32,
        minmax: bool,
    },
    Float {
        fmt: Fp8,
        /// Magnitude pattern of the largest code used for finite values.
        max_mag: u8,
        /// `max(|lo|, |hi|)`, `FMAX / m` (0 when `m == 0`) and `m / FMAX`.
        m: f64,
        mul: f64,
        step: f64,
    },
}

/// `exp_shift` for a chunk with these finite extremes (see "Range scaling").
fn exp_shift_for(min: f64, max: f64) -> i16 {
    let r = min.abs().max(max.abs());
    if r >= pow2(1000) {
        8
    } else if r > 0.0 && r < pow2(-900) {
        -128
    } else {
        0
    }
}

/// `v` limited to `[lo, hi]` (a `v` equal to a bound is kept as is, signed zeros too).
fn clamp(v: f64, lo: f64, hi: f64) -> f64 {
    if v < lo {
        lo
    } else if v > hi {
        hi
    } else {
        v
    }
}

impl QuantParams {
    /// The header as it goes on the wire.
    pub fn to_bytes(&self) -> [u8; PARAMS_LEN] {
        let mut b = [0u8; PARAMS_LEN];
        b[0] = self.algorithm as u8;
        b[1] = self.wire as u8;
        b[2] = self.dtype as u8;
        b[3] = if self.nonfinite { FLAG_NONFINITE } else { 0 };
        b[4..6].copy_from_slice(&self.exp_shift.to_le_bytes());
        b[8..16].copy_from_slice(&self.min.to_le_bytes());
        b[16..24].copy_from_slice(&self.max.to_le_bytes());
        b
    }

    /// Parse and validate a header (the first [`PARAMS_LEN`] bytes of `bytes`).
    /// [`CoreError::Protocol`] if it is short or is not a header [`quantize`] could have
    /// written.
    pub fn from_bytes(bytes: &[u8]) -> CoreResult<QuantParams> {
        let bad = |what: String| CoreError::Protocol(format!("quantized chunk header: {what}"));
        if bytes.len() < PARAMS_LEN {
            return Err(bad(format!(
                "{} bytes, need at least {PARAMS_LEN}",
                bytes.len()
            )));
        }
        let algorithm = match QuantAlgorithm::from_u8(bytes[0]) {
            Some(a) if a != QuantAlgorithm::None => a,
            _ => return Err(bad(format!("bad algorithm {}", bytes[0]))),
        };
        let wire = WireType::from_u8(bytes[1])
            .ok_or_else(|| bad(format!("bad wire type {}", bytes[1])))?;
        let dtype = match DType::from_u8(bytes[2]) {
            Some(d) if d.is_float() => d,
            _ => return Err(bad(format!("bad dtype {}", bytes[2]))),
        };
        if bytes[3] & !FLAG_NONFINITE != 0 || bytes[6] != 0 || bytes[7] != 0 {
            return Err(bad("unknown flags or reserved bits set".to_string()));
        }
        let exp_shift = i16::from_le_bytes([bytes[4], bytes[5]]);
        let min = f64::from_le_bytes(bytes[8..16].try_into().unwrap());
        let max = f64::from_le_bytes(bytes[16..24].try_into().unwrap());
        if !(min.is_finite() && max.is_finite() && min <= max) {
            return Err(bad(format!("bad range [{min:e}, {max:e}]")));
        }
        if !representable(dtype, min) || !representable(dtype, max) {
            return Err(bad(format!(
                "range [{min:e}, {max:e}] is not made of {} values",
                dtype.name()
            )));
        }
        if exp_shift != exp_shift_for(min, max) {
            return Err(bad(format!("bad exponent shift {exp_shift}")));
        }
        Ok(QuantParams {
            algorithm,
            wire,
            dtype,
            nonfinite: bytes[3] & FLAG_NONFINITE != 0,
            exp_shift,
            min,
            max,
        })
    }

    /// For `U8` / `I8`: the step between adjacent codes. For the 8-bit floats: the factor
    /// `m / FMAX` that code values are multiplied by. In units of the data; 0 for an
    /// all-zero (or constant, with `MinMax`) chunk.
    pub fn scale(&self) -> f64 {
        let g = self.grid();
        match g.kind {
            GridKind::Int { scale, .. } => scale * g.post,
            GridKind::Float { step, .. } => step * g.post,
        }
    }

    /// For `ZeroPointScale` with `U8` / `I8`: the code that stands for zero.
    pub fn zero_point(&self) -> Option<i32> {
        match self.grid().kind {
            GridKind::Int {
                zero_point,
                minmax: false,
                ..
            } => Some(zero_point),
            _ => None,
        }
    }

    fn from_stats(
        algorithm: QuantAlgorithm,
        wire: WireType,
        dtype: DType,
        s: kernels::Stats,
    ) -> Self {
        QuantParams {
            algorithm,
            wire,
            dtype,
            nonfinite: s.nonfinite,
            exp_shift: exp_shift_for(s.min, s.max),
            min: s.min,
            max: s.max,
        }
    }

    /// Derive the grid (module docs). Both ends run exactly this code.
    fn grid(&self) -> Grid {
        let e = i32::from(self.exp_shift);
        let (pre, post) = (pow2(-e), pow2(e));
        let (lo, hi) = (self.min * pre, self.max * pre);
        let kind = match self.wire.fp8() {
            None => {
                let (qmin, qtop) = if self.wire == WireType::U8 {
                    (0, 255)
                } else {
                    (-128, 127)
                };
                let qmax = if self.nonfinite { qtop - 3 } else { qtop };
                let levels = f64::from(qmax - qmin);
                let minmax = self.algorithm == QuantAlgorithm::MinMax;
                let (lo, hi) = if minmax {
                    (lo, hi)
                } else {
                    (
                        if lo < 0.0 { lo } else { 0.0 },
                        if hi > 0.0 { hi } else { 0.0 },
                    )
                };
                let span = hi - lo;
                let (scale, inv) = if span > 0.0 {
                    (span / levels, levels / span)
                } else {
                    (0.0, 0.0)
                };
                // `qmin` is even, so this is `round(qmin - lo / scale)`; computing the
                // rounding relative to `qmin` makes it identical for U8 and I8.
                let zero_point = if minmax || scale == 0.0 {
                    qmin
                } else {
                    qmin + clamp((-lo / scale).round_ties_even(), 0.0, levels) as i32
                };
                GridKind::Int {
                    qmin,
                    qmax,
                    lo,
                    hi,
                    scale,
                    inv,
                    zero_point,
                    minmax,
                }
            }
            Some(fmt) => {
                let max_mag = if fmt == Fp8::E4M3 && self.nonfinite {
                    fmt.max_mag() - 1
                } else {
                    fmt.max_mag()
                };
                let fmax = fmt.decode(max_mag);
                let m = lo.abs().max(hi.abs());
                let mul = if m > 0.0 { fmax / m } else { 0.0 };
                GridKind::Float {
                    fmt,
                    max_mag,
                    m,
                    mul,
                    step: m / fmax,
                }
            }
        };
        Grid { pre, post, kind }
    }

    /// The value every code decodes to, in `f64`, before rounding to the dtype.
    fn table_values(&self) -> [f64; 256] {
        let g = self.grid();
        let mut out = [0.0f64; 256];
        for (c, v) in out.iter_mut().enumerate() {
            let code = c as u8;
            *v = match g.kind {
                GridKind::Int {
                    qmin,
                    qmax,
                    lo,
                    hi,
                    scale,
                    zero_point,
                    minmax,
                    ..
                } => {
                    let q = if self.wire == WireType::U8 {
                        i32::from(code)
                    } else {
                        i32::from(code as i8)
                    };
                    match q - qmax {
                        // Reserved codes (only when flagged NONFINITE).
                        1 => f64::NEG_INFINITY,
                        2 => f64::INFINITY,
                        3 => f64::NAN,
                        _ if minmax && q == qmin => self.min,
                        _ if minmax && q == qmax => self.max,
                        _ if !minmax && zero_point == qmin && q == qmax => {
                            if self.max > 0.0 {
                                self.max
                            } else {
                                0.0
                            }
                        }
                        _ if !minmax && zero_point == qmax && q == qmin => {
                            if self.min < 0.0 {
                                self.min
                            } else {
                                0.0
                            }
                        }
                        _ => {
                            let v = if minmax {
                                lo + f64::from(q - qmin) * scale
                            } else {
                                f64::from(q - zero_point) * scale
                            };
                            clamp(v, lo, hi) * g.post
                        }
                    }
                }
                GridKind::Float {
                    fmt,
                    max_mag,
                    m,
                    step,
                    ..
                } => {
                    let negative = code & 0x80 != 0;
                    let mag = code & 0x7F;
                    let sign = |v: f64| if negative { -v } else { v };
                    let r = self.min.abs().max(self.max.abs());
                    let x = fmt.decode(code);
                    if x.is_nan() {
                        f64::NAN
                    } else if mag == max_mag + 1 && fmt == Fp8::E4M3 {
                        // Reserved in flagged E4M3 chunks.
                        sign(f64::INFINITY)
                    } else if x.is_infinite() {
                        x
                    } else if mag == max_mag {
                        sign(r)
                    } else {
                        clamp(x * step, -m, m) * g.post
                    }
                }
            };
        }
        out
    }

    /// The decode table: each code's value rounded to the dtype, as little-endian bytes.
    /// `N` must be the dtype's size.
    fn table<const N: usize>(&self) -> [[u8; N]; 256] {
        debug_assert_eq!(N, self.dtype.size());
        let vals = self.table_values();
        let mut out = [[0u8; N]; 256];
        for (o, &v) in out.iter_mut().zip(&vals) {
            let bytes = to_dtype_bytes(self.dtype, v);
            o.copy_from_slice(&bytes[..N]);
        }
        out
    }

    fn affine(&self) -> Option<Affine> {
        let g = self.grid();
        match g.kind {
            GridKind::Int {
                qmin,
                qmax,
                lo,
                inv,
                zero_point,
                minmax,
                ..
            } => {
                let top = qmax + if self.nonfinite { 3 } else { 0 };
                Some(Affine {
                    pre: g.pre,
                    sub: if minmax { lo } else { 0.0 },
                    mul: inv,
                    add: f64::from(zero_point - qmin),
                    top: f64::from(qmax - qmin),
                    offset: qmin as u8,
                    specials: [top as u8, (top - 1) as u8, (top - 2) as u8],
                })
            }
            GridKind::Float { .. } => None,
        }
    }

    fn float8<const E5M2: bool>(&self) -> Option<Float8<E5M2>> {
        let g = self.grid();
        match g.kind {
            GridKind::Float {
                fmt, max_mag, mul, ..
            } if (fmt == Fp8::E5M2) == E5M2 => Some(Float8 {
                pre: g.pre,
                mul,
                fmax: fmt.decode(max_mag),
                specials: if E5M2 {
                    [0x7E, 0x7C, 0xFC]
                } else {
                    [0x7F, 0x7E, 0xFE]
                },
            }),
            _ => None,
        }
    }
}

/// Whether `v` is exactly a value of the float dtype.
fn representable(dtype: DType, v: f64) -> bool {
    match dtype {
        DType::F16 => f16::from_bits(f64_to_f16_bits(v)).to_f64() == v,
        DType::BF16 => bf16::from_bits(f64_to_bf16_bits(v)).to_f64() == v,
        DType::F32 => f64::from(v as f32) == v,
        _ => true,
    }
}

/// `v` rounded to nearest even in the dtype, NaN canonical, as little-endian bytes (the
/// first `dtype.size()` are meaningful).
fn to_dtype_bytes(dtype: DType, v: f64) -> [u8; 8] {
    let mut b = [0u8; 8];
    match dtype {
        DType::F16 => b[..2].copy_from_slice(&f64_to_f16_bits(v).to_le_bytes()),
        DType::BF16 => b[..2].copy_from_slice(&f64_to_bf16_bits(v).to_le_bytes()),
        DType::F32 => {
            let bits = if v.is_nan() {
                0x7FC0_0000
            } else {
                (v as f32).to_bits()
            };
            b[..4].copy_from_slice(&bits.to_le_bytes());
        }
        _ => {
            let bits = if v.is_nan() {
                0x7FF8_0000_0000_0000
            } else {
                v.to_bits()
            };
            b.copy_from_slice(&bits.to_le_bytes());
        }
    }
    b
}

// ---------------------------------------------------------------------------------------
// Entry points
// ---------------------------------------------------------------------------------------

fn float_type(func: &str, dtype: DType) -> CoreResult<FloatType> {
    match dtype {
        DType::F16 => Ok(FloatType::F16),
        DType::BF16 => Ok(FloatType::BF16),
        DType::F32 => Ok(FloatType::F32),
        DType::F64 => Ok(FloatType::F64),
        _ => Err(CoreError::InvalidArgument(format!(
            "{func}: only float16, bfloat16, float32 and float64 can be quantized, not {}",
            dtype.name()
        ))),
    }
}

/// Number of elements in `len` bytes of `dtype`.
fn element_count(func: &str, what: &str, dtype: DType, len: usize) -> CoreResult<usize> {
    if !len.is_multiple_of(dtype.size()) {
        return Err(CoreError::InvalidArgument(format!(
            "{func}: {what} is {len} bytes, which is not a whole number of {} elements",
            dtype.name()
        )));
    }
    Ok(len / dtype.size())
}

fn check_quantized_len(func: &str, what: &str, len: usize, count: usize) -> CoreResult<()> {
    if len != quantized_len(count) {
        return Err(CoreError::InvalidArgument(format!(
            "{func}: {what} is {len} bytes but {count} elements quantize to {} bytes \
             ({PARAMS_LEN} header + 1 per element)",
            quantized_len(count)
        )));
    }
    Ok(())
}

/// Quantize the `count` little-endian `dtype` elements of `src` into `dst`, which must be
/// [`quantized_len`]`(count)` bytes: the [`QuantParams`] header, then one code per
/// element. Semantics, bounds and errors in the module docs.
pub fn quantize(
    alg: QuantAlgorithm,
    wire: WireType,
    dtype: DType,
    src: &[u8],
    dst: &mut [u8],
) -> CoreResult<()> {
    quantize_with(alg, wire, dtype, src, dst, kernels::simd_available())
}

/// [`quantize`] with the choice of code path made by the caller (the tests run both).
fn quantize_with(
    alg: QuantAlgorithm,
    wire: WireType,
    dtype: DType,
    src: &[u8],
    dst: &mut [u8],
    simd: bool,
) -> CoreResult<()> {
    const F: &str = "quantize";
    let simd = simd && kernels::simd_available();
    if alg == QuantAlgorithm::None {
        return Err(CoreError::InvalidArgument(format!(
            "{F}: algorithm NONE does not quantize"
        )));
    }
    let ft = float_type(F, dtype)?;
    let count = element_count(F, "src", dtype, src.len())?;
    check_quantized_len(F, "dst", dst.len(), count)?;

    let stats = kernels::stats(ft, src, simd);
    let params = QuantParams::from_stats(alg, wire, dtype, stats);
    let (head, codes) = dst.split_at_mut(PARAMS_LEN);
    head.copy_from_slice(&params.to_bytes());
    let nf = params.nonfinite;
    match wire {
        WireType::U8 | WireType::I8 => {
            let e = params.affine().expect("integer wire type");
            kernels::encode(ft, src, codes, &e, nf, simd)
        }
        WireType::F8E4M3 => {
            let e = params.float8::<false>().expect("E4M3 wire type");
            kernels::encode(ft, src, codes, &e, nf, simd)
        }
        WireType::F8E5M2 => {
            let e = params.float8::<true>().expect("E5M2 wire type");
            kernels::encode(ft, src, codes, &e, nf, simd)
        }
    }
    Ok(())
}

/// Validate a de-quantization call; returns the header and the code bytes.
fn open<'a>(
    func: &str,
    wire: WireType,
    dtype: DType,
    src: &'a [u8],
    out_len: usize,
) -> CoreResult<(QuantParams, &'a [u8])> {
    float_type(func, dtype)?;
    let count = element_count(func, "output", dtype, out_len)?;
    check_quantized_len(func, "src", src.len(), count)?;
    let p = QuantParams::from_bytes(src)?;
    if p.wire != wire || p.dtype != dtype {
        return Err(CoreError::Protocol(format!(
            "{func}: chunk holds {} codes of {} data, expected {} codes of {}",
            p.wire.name(),
            p.dtype.name(),
            wire.name(),
            dtype.name()
        )));
    }
    Ok((p, &src[PARAMS_LEN..]))
}

/// De-quantize a chunk written by [`quantize`]: `dst` receives its `count` elements as
/// little-endian `dtype` bytes; `src` must be [`quantized_len`]`(count)` bytes and its
/// header must name `wire` and `dtype`.
pub fn dequantize(wire: WireType, dtype: DType, src: &[u8], dst: &mut [u8]) -> CoreResult<()> {
    let (p, codes) = open("dequantize", wire, dtype, src, dst.len())?;
    match dtype.size() {
        2 => kernels::decode::<2>(codes, &p.table::<2>(), dst),
        4 => kernels::decode::<4>(codes, &p.table::<4>(), dst),
        _ => kernels::decode::<8>(codes, &p.table::<8>(), dst),
    }
    Ok(())
}

/// Bytes of de-quantized data per step of the fused kernels (fits L1 with its inputs).
const FUSED_STEP: usize = 4096;

#[repr(C, align(64))]
struct FusedStage([u8; FUSED_STEP]);

/// `acc[i] = dequantized[i] (op) x[i]`, bit for bit equal to [`dequantize`] into a
/// temporary `t` followed by [`crate::reduce::reduce`]`(dtype, op, acc, t, x)`.
/// `x` and `acc` hold `count` elements; `src` is [`quantized_len`]`(count)` bytes.
pub fn dequantize_reduce(
    wire: WireType,
    dtype: DType,
    op: ReduceOp,
    src: &[u8],
    x: &[u8],
    acc: &mut [u8],
) -> CoreResult<()> {
    const F: &str = "dequantize_reduce";
    if x.len() != acc.len() {
        return Err(CoreError::InvalidArgument(format!(
            "{F}: length mismatch, acc is {} bytes but x is {} bytes",
            acc.len(),
            x.len()
        )));
    }
    let (p, codes) = open(F, wire, dtype, src, acc.len())?;
    fused(&p, codes, acc, |acc, t, r| reduce(dtype, op, acc, t, &x[r]))
}

/// `acc[i] = acc[i] (op) dequantized[i]`, bit for bit equal to [`dequantize`] into a
/// temporary `t` followed by [`crate::reduce::reduce_inplace`]`(dtype, op, acc, t)`.
pub fn dequantize_reduce_inplace(
    wire: WireType,
    dtype: DType,
    op: ReduceOp,
    src: &[u8],
    acc: &mut [u8],
) -> CoreResult<()> {
    let (p, codes) = open("dequantize_reduce_inplace", wire, dtype, src, acc.len())?;
    fused(&p, codes, acc, |acc, t, _| {
        reduce_inplace(dtype, op, acc, t)
    })
}

/// Decode `codes` a step at a time into an aligned stack buffer and hand each step to `f`
/// with the matching part of `acc` and its byte range.
fn fused(
    p: &QuantParams,
    codes: &[u8],
    acc: &mut [u8],
    f: impl FnMut(&mut [u8], &[u8], std::ops::Range<usize>) -> CoreResult<()>,
) -> CoreResult<()> {
    match p.dtype.size() {
        2 => fused_n::<2>(&p.table::<2>(), codes, acc, f),
        4 => fused_n::<4>(&p.table::<4>(), codes, acc, f),
        _ => fused_n::<8>(&p.table::<8>(), codes, acc, f),
    }
}

fn fused_n<const N: usize>(
    table: &[[u8; N]; 256],
    codes: &[u8],
    acc: &mut [u8],
    mut f: impl FnMut(&mut [u8], &[u8], std::ops::Range<usize>) -> CoreResult<()>,
) -> CoreResult<()> {
    let mut stage = FusedStage([0; FUSED_STEP]);
    let per = FUSED_STEP / N;
    for (k, c) in codes.chunks(per).enumerate() {
        let r = k * FUSED_STEP..k * FUSED_STEP + c.len() * N;
        let t = &mut stage.0[..c.len() * N];
        kernels::decode::<N>(c, table, t);
        f(&mut acc[r.clone()], t, r)?;
    }
    Ok(())
}
