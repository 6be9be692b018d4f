//! Narrow binary floating-point formats: the two 8-bit wire formats, plus the rounding of
//! `f64` to IEEE half and bfloat16 used when de-quantization tables are built.
//!
//! Everything here is integer arithmetic on bit patterns or exact IEEE operations, so it
//! gives the same bits on every machine. `half`'s own `from_f64` is not used on purpose:
//! on x86 with F16C it rounds through `f32` first (double rounding) and its portable
//! version drops the low mantissa bits before rounding, so the two disagree on rare ties.

/// `2^k` as an `f64`, for `-1022 <= k <= 1023` (built from the bit pattern, exact).
#[inline(always)]
pub(super) const fn pow2(k: i32) -> f64 {
    f64::from_bits(((1023 + k) as u64) << 52)
}

/// `1.5 * 2^52`. For `|t| <= 2^50`, `t + ROUND_MAGIC` lies in `[2^52, 2^53)` where the spacing
/// of `f64` is 1, so the addition rounds `t` to the nearest integer, ties to even, and the
/// low bits of the sum's bit pattern hold that integer in two's complement.
pub(super) const ROUND_MAGIC: f64 = 6_755_399_441_055_744.0;

/// `|x|` rounded to nearest, ties to even, in a binary format with `man` stored mantissa
/// bits and exponent bias `bias` (subnormals included). `a` is the bit pattern of a
/// non-negative `f64` (sign bit clear); the result is the target's magnitude pattern
/// `biased_exponent << man | mantissa`.
///
/// The result is not saturated: magnitudes past the largest exponent come back as larger
/// patterns, and because a rounding carry runs from the mantissa into the exponent field,
/// the first pattern past the largest finite value is what IEEE-style formats use for
/// infinity. Callers clamp. For a NaN `a` the result is meaningless (callers select it
/// away). `man < 52` and the format's range must lie inside `f64`'s normal range.
///
/// Written without branches (two candidate results and a select) so that loops calling it
/// vectorise.
#[inline(always)]
pub(super) fn round_magnitude(a: u64, man: u32, bias: i32) -> u64 {
    let shift = 52 - man;
    // Normal range of the target: round the f64 pattern at bit `shift` (add just under
    // half an ulp, plus one if the kept lowest bit is odd, then truncate), then rebias
    // the exponent. Garbage below the normal range; selected away below.
    let lsb = (a >> shift) & 1;
    let normal = ((a + (1u64 << (shift - 1)) - 1 + lsb) >> shift)
        .wrapping_sub(((1023 - bias) as u64) << man);
    // Subnormal range: count units of the smallest subnormal, 2^(1 - bias - man). The
    // multiplication by a power of two is exact; the magic addition rounds to an integer.
    // The count is at most 2^man, which is the smallest normal pattern, so a value that
    // rounds up into the normal range gets the right pattern too.
    let units = f64::from_bits(a) * pow2(bias - 1 + man as i32);
    let sub = (units + pow2(52))
        .to_bits()
        .wrapping_sub(pow2(52).to_bits());
    // Bit pattern of the smallest normal number of the target, 2^(1 - bias).
    let min_normal = ((1024 - bias) as u64) << 52;
    if a >= min_normal {
        normal
    } else {
        sub
    }
}

/// The two 8-bit float wire formats (OCP 8-bit floating point).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Fp8 {
    /// `E4M3FN`: 4 exponent bits (bias 7), 3 mantissa bits, no infinities; the only NaN
    /// patterns are `0x7F` and `0xFF`. Largest finite value 448 (`0x7E`), smallest
    /// subnormal 2^-9.
    E4M3,
    /// `E5M2`: 5 exponent bits (bias 15), 2 mantissa bits, IEEE-style: `0x7C` / `0xFC` are
    /// ±infinity, `0x7D..=0x7F` (and negatives) NaN. Largest finite value 57344 (`0x7B`),
    /// smallest subnormal 2^-16. It is the top byte of an IEEE half.
    E5M2,
}

impl Fp8 {
    /// Stored mantissa bits.
    pub(super) const fn man(self) -> u32 {
        match self {
            Fp8::E4M3 => 3,
            Fp8::E5M2 => 2,
        }
    }

    /// Exponent bias.
    pub(super) const fn bias(self) -> i32 {
        match self {
            Fp8::E4M3 => 7,
            Fp8::E5M2 => 15,
        }
    }

    /// Magnitude pattern of the largest finite value.
    pub(super) const fn max_mag(self) -> u8 {
        match self {
            Fp8::E4M3 => 0x7E,
            Fp8::E5M2 => 0x7B,
        }
    }

    /// The value of `code`, exactly, as an `f64` (NaN codes give a NaN).
    pub(super) fn decode(self, code: u8) -> f64 {
        let negative = code & 0x80 != 0;
        let mag = code & 0x7F;
        let man = self.man();
        let exp = i32::from(mag >> man);
        let frac = f64::from(mag & ((1u8 << man) - 1));
        let v = match self {
            Fp8::E4M3 if mag == 0x7F => f64::NAN,
            Fp8::E5M2 if exp == 31 && frac == 0.0 => f64::INFINITY,
            Fp8::E5M2 if exp == 31 => f64::NAN,
            _ if exp == 0 => frac * pow2(1 - self.bias() - man as i32),
            _ => (pow2(man as i32) + frac) * pow2(exp - self.bias() - man as i32),
        };
        if negative {
            -v
        } else {
            v
        }
    }

    /// `y` rounded to nearest even in this format, saturating: magnitudes above `fmax` (a
    /// finite value of the format) give `fmax`, with `y`'s sign. Zero keeps its sign. `y`
    /// must not be NaN (the result would be meaningless).
    #[inline(always)]
    pub(super) fn encode(self, y: f64, fmax: f64) -> u8 {
        let bits = y.to_bits();
        let sign = ((bits >> 56) as u8) & 0x80;
        // Saturate before rounding (a float min, cheaper than comparing the result).
        let a = f64::from_bits(bits & !(1u64 << 63));
        let a = if a > fmax { fmax } else { a };
        sign | round_magnitude(a.to_bits(), self.man(), self.bias()) as u8
    }
}

/// `v` rounded to nearest even as an IEEE half (bit pattern); overflow gives ±infinity,
/// any NaN gives the canonical quiet NaN `0x7E00`.
pub(super) fn f64_to_f16_bits(v: f64) -> u16 {
    if v.is_nan() {
        return 0x7E00;
    }
    let bits = v.to_bits();
    let sign = ((bits >> 48) as u16) & 0x8000;
    let mag = round_magnitude(bits & !(1u64 << 63), 10, 15).min(0x7C00);
    sign | mag as u16
}

/// `v` rounded to nearest even as a bfloat16 (bit pattern); overflow gives ±infinity, any
/// NaN gives the canonical quiet NaN `0x7FC0`.
pub(super) fn f64_to_bf16_bits(v: f64) -> u16 {
    if v.is_nan() {
        return 0x7FC0;
    }
    let bits = v.to_bits();
    let sign = ((bits >> 48) as u16) & 0x8000;
    let mag = round_magnitude(bits & !(1u64 << 63), 7, 127).min(0x7F80);
    sign | mag as u16
}
