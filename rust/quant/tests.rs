//! Tests of the quantizer: the 8-bit float formats exhaustively, the header, the
//! documented error bounds (property tests over every algorithm x wire type x dtype), the
//! edge cases of the module docs, the fused reduce, determinism and argument checking.

use half::{bf16, f16};
use proptest::prelude::*;

use super::minifloat::{f64_to_bf16_bits, f64_to_f16_bits, pow2, Fp8};
use super::*;
// A byte buffer whose data starts `offset` bytes past a 64-byte boundary.
use crate::pod::OffsetBuf as Buf;

// ---- helpers ---------------------------------------------------------------------------

const FLOATS: [DType; 4] = [DType::F16, DType::BF16, DType::F32, DType::F64];
const ALGS: [QuantAlgorithm; 2] = [QuantAlgorithm::MinMax, QuantAlgorithm::ZeroPointScale];

/// Little-endian bytes of `vals` rounded (to nearest even) into `dtype`.
fn enc(dtype: DType, vals: &[f64]) -> Vec<u8> {
    vals.iter()
        .flat_map(|&v| match dtype {
            DType::F16 => f64_to_f16_bits(v).to_le_bytes().to_vec(),
            DType::BF16 => f64_to_bf16_bits(v).to_le_bytes().to_vec(),
            DType::F32 => (v as f32).to_le_bytes().to_vec(),
            _ => v.to_le_bytes().to_vec(),
        })
        .collect()
}

/// The elements of `bytes` as `f64` (exact).
fn dec(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks(dtype.size())
        .map(|c| match dtype {
            DType::F16 => f16::from_le_bytes(c.try_into().unwrap()).to_f64(),
            DType::BF16 => bf16::from_le_bytes(c.try_into().unwrap()).to_f64(),
            DType::F32 => f64::from(f32::from_le_bytes(c.try_into().unwrap())),
            _ => f64::from_le_bytes(c.try_into().unwrap()),
        })
        .collect()
}

/// Largest finite value of a float dtype.
fn dtype_max(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 65504.0,
        DType::BF16 => bf16::MAX.to_f64(),
        DType::F32 => f64::from(f32::MAX),
        _ => f64::MAX,
    }
}

/// Spacing of `dtype` around `|v|` (the larger of the gaps on either side), `v` finite and
/// a value of the dtype.
fn ulp(dtype: DType, v: f64) -> f64 {
    let a = v.abs();
    let (up, down) = match dtype {
        DType::F16 => {
            let b = f16::from_f64(a).to_bits();
            (
                f16::from_bits(b + 1).to_f64(),
                f16::from_bits(b.saturating_sub(1)).to_f64(),
            )
        }
        DType::BF16 => {
            let b = bf16::from_f64(a).to_bits();
            (
                bf16::from_bits(b + 1).to_f64(),
                bf16::from_bits(b.saturating_sub(1)).to_f64(),
            )
        }
        DType::F32 => {
            let b = (a as f32).to_bits();
            (
                f64::from(f32::from_bits(b + 1)),
                f64::from(f32::from_bits(b.saturating_sub(1))),
            )
        }
        _ => {
            let b = a.to_bits();
            (f64::from_bits(b + 1), f64::from_bits(b.saturating_sub(1)))
        }
    };
    let up = if up.is_finite() { up - a } else { 0.0 };
    up.max(a - down)
}

fn quant(alg: QuantAlgorithm, wire: WireType, dtype: DType, src: &[u8], simd: bool) -> Vec<u8> {
    let mut q = vec![0u8; quantized_len(src.len() / dtype.size())];
    quantize_with(alg, wire, dtype, src, &mut q, simd).unwrap();
    q
}

fn dequant(wire: WireType, dtype: DType, q: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; (q.len() - PARAMS_LEN) * dtype.size()];
    dequantize(wire, dtype, q, &mut out).unwrap();
    out
}

/// Quantize with both code paths (which must agree), then de-quantize.
fn roundtrip(
    alg: QuantAlgorithm,
    wire: WireType,
    dtype: DType,
    src: &[u8],
) -> (QuantParams, Vec<u8>, Vec<u8>) {
    let q = quant(alg, wire, dtype, src, false);
    assert_eq!(
        q,
        quant(alg, wire, dtype, src, kernels::simd_available()),
        "SIMD and portable code paths disagree"
    );
    let p = QuantParams::from_bytes(&q).unwrap();
    let out = dequant(wire, dtype, &q);
    (p, q, out)
}

/// Whether the finite element `x`, de-quantized as `y`, is within the documented bound.
/// Everything is compared in the encoder's scaled domain (`* 2^-exp_shift`, exact for
/// the subnormal `f64` chunks where it matters), so that the bound itself does not
/// underflow; returns the error and the bound there.
fn within_bound(p: &QuantParams, x: f64, y: f64) -> (bool, f64, f64) {
    let g = p.grid();
    let pre = g.pre;
    let s = match g.kind {
        GridKind::Int { scale, .. } => scale,
        GridKind::Float { step, .. } => step,
    };
    let r = p.min.abs().max(p.max.abs()) * pre;
    let err = (y * pre - x * pre).abs();
    let tiny = pow2(-48) * r + ulp(p.dtype, y) * pre / 2.0;
    let b = match p.wire.fp8() {
        None => s * (0.5 + pow2(-40)) + tiny,
        Some(f) => {
            let (man, bias) = (f.man() as i32, f.bias());
            pow2(-(man + 1)) * (x * pre).abs() + pow2(-(bias + man)) * s + tiny
        }
    };
    (err <= b, err, b)
}

/// Check every element of a round trip against the docs: finite elements within the
/// bound and inside [min, max]; NaN to the canonical NaN; infinities kept.
fn check_roundtrip(p: &QuantParams, src: &[u8], out: &[u8], ctx: &str) {
    let xs = dec(p.dtype, src);
    let ys = dec(p.dtype, out);
    for (i, (&x, &y)) in xs.iter().zip(&ys).enumerate() {
        if x.is_nan() {
            assert!(y.is_nan(), "{ctx}: element {i}: NaN came back as {y}");
            let bytes = &out[i * p.dtype.size()..(i + 1) * p.dtype.size()];
            let canonical = super::to_dtype_bytes(p.dtype, f64::NAN);
            assert_eq!(
                bytes,
                &canonical[..p.dtype.size()],
                "{ctx}: NaN not canonical"
            );
        } else if x.is_infinite() {
            assert_eq!(x, y, "{ctx}: element {i}: infinity came back as {y}");
        } else {
            let (ok, err, b) = within_bound(p, x, y);
            assert!(
                ok,
                "{ctx}: element {i}: {x:e} came back as {y:e}, error {err:e} > bound {b:e} \
                 (scaled by 2^-exp_shift; {p:?}, scale {:e})",
                p.scale()
            );
            let (lo, hi) = match (p.wire.fp8(), p.algorithm) {
                (None, QuantAlgorithm::MinMax) => (p.min, p.max),
                (None, _) => (p.min.min(0.0), p.max.max(0.0)),
                _ => {
                    let m = p.min.abs().max(p.max.abs());
                    (-m, m)
                }
            };
            assert!(lo <= y && y <= hi, "{ctx}: {y:e} outside [{lo:e}, {hi:e}]");
        }
    }
}

/// Deterministic pseudo-random numbers for the generators below (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }
}

/// `n` values for `dtype`: a random centre and width `2^k`, some exact zeros, some values
/// near the subnormal range of the dtype; all finite in the dtype.
fn sample(dtype: DType, n: usize, k: i32, shape: u8, seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed | 1);
    let w = pow2(k);
    let centre = match shape % 4 {
        0 => 0.0,
        1 => w * rng.unit(),
        2 => w * 1000.0 * rng.unit(),
        _ => w * 3.0,
    };
    let max = dtype_max(dtype);
    let vals: Vec<f64> = (0..n)
        .map(|_| {
            let r = rng.next();
            let v = match r % 16 {
                0 => 0.0,
                1 => -0.0,
                2 => rng.unit() * pow2(-20) * w,
                _ => centre + w * rng.unit(),
            };
            v.clamp(-max, max)
        })
        .collect();
    enc(dtype, &vals)
}

// ---- 8-bit floats ----------------------------------------------------------------------

/// Straightforward E4M3FN decoder: sign, 4-bit exponent (bias 7), 3-bit mantissa.
fn e4m3_reference(code: u8) -> f64 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = i32::from((code >> 3) & 0xF);
    let m = f64::from(code & 7);
    if code & 0x7F == 0x7F {
        return f64::NAN;
    }
    let v = if e == 0 {
        m / 8.0 * 2f64.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f64.powi(e - 7)
    };
    sign * v
}

#[test]
fn fp8_decode_all_codes() {
    for code in 0..=255u8 {
        // E5M2 is the top byte of an IEEE half.
        let want = f16::from_bits(u16::from(code) << 8).to_f64();
        let got = Fp8::E5M2.decode(code);
        assert!(
            got == want && got.is_sign_negative() == want.is_sign_negative()
                || got.is_nan() && want.is_nan(),
            "E5M2 {code:#04x}: {got} != {want}"
        );
        let want = e4m3_reference(code);
        let got = Fp8::E4M3.decode(code);
        assert!(
            got == want && got.is_sign_negative() == want.is_sign_negative()
                || got.is_nan() && want.is_nan(),
            "E4M3 {code:#04x}: {got} != {want}"
        );
    }
    // Landmarks.
    let e4 = |c| Fp8::E4M3.decode(c);
    let e5 = |c| Fp8::E5M2.decode(c);
    assert_eq!(
        [e4(0x7E), e4(0xFE), e4(0x38), e4(0x08), e4(0x01)],
        [448.0, -448.0, 1.0, pow2(-6), pow2(-9)]
    );
    assert!(e4(0x7F).is_nan() && e4(0xFF).is_nan());
    assert!(e4(0x80) == 0.0 && e4(0x80).is_sign_negative());
    assert_eq!(
        [e5(0x7B), e5(0x3C), e5(0x04), e5(0x01), e5(0x7C), e5(0xFC)],
        [
            57344.0,
            1.0,
            pow2(-14),
            pow2(-16),
            f64::INFINITY,
            f64::NEG_INFINITY
        ]
    );
    assert!((0x7D..=0x7F).all(|c| e5(c).is_nan() && e5(c | 0x80).is_nan()));
    // Positive finite codes are strictly increasing.
    for f in [Fp8::E4M3, Fp8::E5M2] {
        for c in 0..f.max_mag() {
            assert!(f.decode(c) < f.decode(c + 1), "{f:?} {c:#04x}");
        }
    }
}

/// Nearest code to `y` among the finite codes up to magnitude value `fmax`, ties to the
/// even code, saturating: a brute-force search.
fn fp8_reference_encode(f: Fp8, y: f64, fmax: f64) -> u8 {
    let sign = if y.is_sign_negative() { 0x80 } else { 0 };
    let a = y.abs();
    let top = (0..=f.max_mag()).find(|&c| f.decode(c) == fmax).unwrap();
    if a >= fmax {
        return sign | top;
    }
    let lo = (0..top).rev().find(|&c| f.decode(c) <= a).unwrap();
    let (dl, dh) = (a - f.decode(lo), f.decode(lo + 1) - a);
    let c = if dl < dh || dl == dh && lo % 2 == 0 {
        lo
    } else {
        lo + 1
    };
    sign | c
}

#[test]
fn fp8_encode_every_f16_to_nearest_even() {
    for (f, fmax) in [(Fp8::E4M3, 448.0), (Fp8::E4M3, 416.0), (Fp8::E5M2, 57344.0)] {
        for bits in 0..=u16::MAX {
            let h = f16::from_bits(bits);
            if h.is_nan() {
                continue;
            }
            let y = h.to_f64();
            let got = f.encode(y, fmax);
            let want = fp8_reference_encode(f, y, fmax);
            assert_eq!(
                got, want,
                "{f:?} fmax {fmax}: encode({y:e}) = {got:#04x}, want {want:#04x}"
            );
        }
        // Every finite code round-trips.
        for c in 0..=255u8 {
            let v = f.decode(c);
            if v.is_finite() && v.abs() <= fmax {
                assert_eq!(f.encode(v, fmax), c, "{f:?} code {c:#04x}");
            }
        }
    }
}

#[test]
fn fp8_ties_and_saturation() {
    // Midway between 1.0 (0x38) and 1.125 (0x39): to the even code 0x38; midway between
    // 1.125 and 1.25 (0x3A): to 0x3A. A hair above a tie goes up.
    assert_eq!(Fp8::E4M3.encode(1.0625, 448.0), 0x38);
    assert_eq!(Fp8::E4M3.encode(1.1875, 448.0), 0x3A);
    assert_eq!(Fp8::E4M3.encode(1.0625 + pow2(-40), 448.0), 0x39);
    assert_eq!(Fp8::E4M3.encode(-(1.0625 + pow2(-40)), 448.0), 0xB9);
    // Subnormal tie: 1.5 * 2^-9 -> 2 * 2^-9 (even); 0.5 * 2^-9 -> 0.
    assert_eq!(Fp8::E4M3.encode(1.5 * pow2(-9), 448.0), 0x02);
    assert_eq!(Fp8::E4M3.encode(0.5 * pow2(-9), 448.0), 0x00);
    assert_eq!(Fp8::E4M3.encode(0.5 * pow2(-9) + pow2(-60), 448.0), 0x01);
    // Saturation instead of NaN / infinity.
    assert_eq!(Fp8::E4M3.encode(1e30, 448.0), 0x7E);
    assert_eq!(Fp8::E4M3.encode(f64::NEG_INFINITY, 448.0), 0xFE);
    assert_eq!(Fp8::E4M3.encode(440.0, 416.0), 0x7D);
    assert_eq!(Fp8::E5M2.encode(61440.0, 57344.0), 0x7B);
    assert_eq!(Fp8::E5M2.encode(f64::INFINITY, 57344.0), 0x7B);
    assert_eq!(Fp8::E5M2.encode(-0.0, 57344.0), 0x80);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn prop_fp8_encode_matches_reference(mant in 0u64..(1 << 52), exp in -30i32..20, neg: bool) {
        // Full 52-bit mantissas, so sticky bits far below any format's precision count.
        let y = f64::from_bits(((1023 + exp) as u64) << 52 | mant);
        let y = if neg { -y } else { y };
        for (f, fmax) in [(Fp8::E4M3, 448.0), (Fp8::E4M3, 416.0), (Fp8::E5M2, 57344.0)] {
            prop_assert_eq!(f.encode(y, fmax), fp8_reference_encode(f, y, fmax));
        }
    }
}

// ---- f64 -> f16 / bf16 rounding (used for the decode tables) ---------------------------

#[test]
fn half_rounding_matches_half_from_f32() {
    // `half`'s f32 -> f16 / bf16 conversions are correctly rounded; ours from the exact f64
    // must agree. Every 16-bit pattern round-trips, plus a sweep over f32 patterns.
    for bits in 0..=u16::MAX {
        let h = f16::from_bits(bits);
        if !h.is_nan() {
            assert_eq!(f64_to_f16_bits(h.to_f64()), bits);
        }
        let b = bf16::from_bits(bits);
        if !b.is_nan() {
            assert_eq!(f64_to_bf16_bits(b.to_f64()), bits);
        }
    }
    let mut bits = 0u32;
    while let Some(next) = bits.checked_add(4099) {
        bits = next;
        let x = f32::from_bits(bits);
        if x.is_nan() {
            assert_eq!(f64_to_f16_bits(f64::from(x)), 0x7E00);
            assert_eq!(f64_to_bf16_bits(f64::from(x)), 0x7FC0);
            continue;
        }
        assert_eq!(
            f64_to_f16_bits(f64::from(x)),
            f16::from_f32(x).to_bits(),
            "f16 {x:e}"
        );
        assert_eq!(
            f64_to_bf16_bits(f64::from(x)),
            bf16::from_f32(x).to_bits(),
            "bf16 {x:e}"
        );
    }
    // A tie plus a bit far below f32 precision rounds up (a truncating shortcut would not).
    let tie = 1.0 + pow2(-11);
    assert_eq!(f64_to_f16_bits(tie), 0x3C00);
    assert_eq!(f64_to_f16_bits(tie + pow2(-45)), 0x3C01);
    assert_eq!(f64_to_bf16_bits(1.0 + pow2(-8) + pow2(-45)), 0x3F81);
    assert_eq!(f64_to_f16_bits(1e6), 0x7C00);
    assert_eq!(f64_to_f16_bits(-1e6), 0xFC00);
}

#[test]
fn f16_widening_is_exact_for_every_pattern() {
    for bits in 0..=u16::MAX {
        let want = f16::from_bits(bits).to_f32();
        let got = kernels::f16_bits_to_f32(bits);
        if want.is_nan() {
            assert!(got.is_nan() && got.is_sign_negative() == want.is_sign_negative());
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "f16 {bits:#06x}");
        }
    }
}

// ---- header ----------------------------------------------------------------------------

#[test]
fn header_layout() {
    let src = enc(DType::F32, &[1.0, -2.0, 3.0]);
    let (p, q, _) = roundtrip(QuantAlgorithm::MinMax, WireType::U8, DType::F32, &src);
    assert_eq!(q.len(), PARAMS_LEN + 3);
    assert_eq!(&q[..8], &[1, 8, 2, 0, 0, 0, 0, 0]);
    assert_eq!(&q[8..16], &(-2.0f64).to_le_bytes());
    assert_eq!(&q[16..24], &3.0f64.to_le_bytes());
    assert_eq!(p.to_bytes(), q[..PARAMS_LEN]);
    assert_eq!(
        p,
        QuantParams {
            algorithm: QuantAlgorithm::MinMax,
            wire: WireType::U8,
            dtype: DType::F32,
            nonfinite: false,
            exp_shift: 0,
            min: -2.0,
            max: 3.0,
        }
    );
    assert_eq!(&q[PARAMS_LEN..], &[153, 0, 255]);

    let src = enc(DType::BF16, &[f64::NAN, 0.5]);
    let (p, q, _) = roundtrip(
        QuantAlgorithm::ZeroPointScale,
        WireType::F8E5M2,
        DType::BF16,
        &src,
    );
    assert_eq!(&q[..8], &[2, 13, 1, 1, 0, 0, 0, 0]);
    assert!(p.nonfinite && p.min == 0.5 && p.max == 0.5);
    assert_eq!(QuantParams::from_bytes(&p.to_bytes()).unwrap(), p);
}

#[test]
fn header_rejects_what_quantize_cannot_write() {
    let src = enc(DType::F32, &[1.0, -2.0, 3.0]);
    let good = quant(
        QuantAlgorithm::MinMax,
        WireType::I8,
        DType::F32,
        &src,
        false,
    );
    let patch = |i: usize, bytes: &[u8]| {
        let mut q = good.clone();
        q[i..i + bytes.len()].copy_from_slice(bytes);
        q
    };
    let f64_at = |i: usize, v: f64| patch(i, &v.to_le_bytes());
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("short", good[..PARAMS_LEN - 1].to_vec()),
        ("algorithm NONE", patch(0, &[0])),
        ("algorithm 3", patch(0, &[3])),
        ("wire 5", patch(1, &[5])),
        ("dtype int8", patch(2, &[4])),
        ("dtype 14", patch(2, &[14])),
        ("flag bit 1", patch(3, &[2])),
        ("reserved", patch(7, &[1])),
        ("exp shift", patch(4, &[8, 0])),
        ("NaN min", f64_at(8, f64::NAN)),
        ("infinite max", f64_at(16, f64::INFINITY)),
        ("min > max", f64_at(8, 4.0)),
        ("min not a float32", f64_at(8, -0.1)),
        ("max too big for float32", f64_at(16, 1e300)),
    ];
    for (what, q) in cases {
        match QuantParams::from_bytes(&q) {
            Err(CoreError::Protocol(_)) => {}
            other => panic!("{what}: {other:?}"),
        }
        let mut out = vec![7u8; 12];
        if q.len() == good.len() {
            assert!(matches!(
                dequantize(WireType::I8, DType::F32, &q, &mut out),
                Err(CoreError::Protocol(_))
            ));
            assert_eq!(out, [7u8; 12], "{what}: output written on error");
        }
    }
    // float64 headers must carry the exponent shift their range calls for.
    let huge = enc(DType::F64, &[f64::MAX, 1.0]);
    let q = quant(
        QuantAlgorithm::MinMax,
        WireType::U8,
        DType::F64,
        &huge,
        false,
    );
    assert_eq!(i16::from_le_bytes([q[4], q[5]]), 8);
    assert!(QuantParams::from_bytes(&q).is_ok());
    let mut bad = q.clone();
    bad[4] = 0;
    assert!(matches!(
        QuantParams::from_bytes(&bad),
        Err(CoreError::Protocol(_))
    ));
}

// ---- semantics pinned by hand ----------------------------------------------------------

#[test]
fn integer_grids_by_hand() {
    // 0..=255 with MinMax: scale 1, codes are the values (U8) or the values - 128 (I8).
    let vals: Vec<f64> = (0..=255).map(f64::from).collect();
    let src = enc(DType::F32, &vals);
    let (p, q, out) = roundtrip(QuantAlgorithm::MinMax, WireType::U8, DType::F32, &src);
    assert_eq!(p.scale(), 1.0);
    assert_eq!(p.zero_point(), None);
    assert_eq!(&q[PARAMS_LEN..], (0..=255u8).collect::<Vec<_>>());
    assert_eq!(out, src);
    let (_, q, out) = roundtrip(QuantAlgorithm::MinMax, WireType::I8, DType::F32, &src);
    assert_eq!(
        &q[PARAMS_LEN..],
        (0..=255u8).map(|c| c ^ 0x80).collect::<Vec<_>>()
    );
    assert_eq!(out, src);

    // [-1, 1] with ZeroPointScale: scale 2/255, zero point round(127.5) = 128 (to even).
    let src = enc(DType::F64, &[-1.0, 0.0, 1.0, 0.5]);
    let (p, q, out) = roundtrip(
        QuantAlgorithm::ZeroPointScale,
        WireType::U8,
        DType::F64,
        &src,
    );
    assert_eq!(p.scale(), 2.0 / 255.0);
    assert_eq!(p.zero_point(), Some(128));
    // -1 * 127.5 + 128 = 0.5 rounds to the even 0; 1 * 127.5 + 128 is clamped to 255.
    assert_eq!(&q[PARAMS_LEN..], &[0, 128, 255, 192]);
    let out = dec(DType::F64, &out);
    assert_eq!(out[..3], [-1.0, 0.0, 127.0 * (2.0 / 255.0)]);
    let (p, q, _) = roundtrip(
        QuantAlgorithm::ZeroPointScale,
        WireType::I8,
        DType::F64,
        &src,
    );
    assert_eq!(p.zero_point(), Some(0));
    assert_eq!(&q[PARAMS_LEN..], &[0x80, 0, 127, 64]);

    // Positive-only data with ZeroPointScale: range widened to [0, max], zero point qmin,
    // the top code is exactly max.
    let src = enc(DType::F32, &[3.0, 5.0, 4.0]);
    let (p, q, out) = roundtrip(
        QuantAlgorithm::ZeroPointScale,
        WireType::U8,
        DType::F32,
        &src,
    );
    assert_eq!(p.zero_point(), Some(0));
    assert_eq!(p.scale(), 5.0 / 255.0);
    assert_eq!(&q[PARAMS_LEN..], &[153, 255, 204]);
    assert_eq!(dec(DType::F32, &out)[1], 5.0);
    // Negative-only: zero point qmax, the bottom code is exactly min.
    let src = enc(DType::F32, &[-3.0, -5.0]);
    let (p, q, out) = roundtrip(
        QuantAlgorithm::ZeroPointScale,
        WireType::I8,
        DType::F32,
        &src,
    );
    assert_eq!(p.zero_point(), Some(127));
    assert_eq!(q[PARAMS_LEN + 1], 0x80);
    assert_eq!(dec(DType::F32, &out)[1], -5.0);
}

#[test]
fn float8_grids_by_hand() {
    // max |x| = 448 maps to itself: the codes are plain E4M3 encodings.
    let src = enc(
        DType::F32,
        &[448.0, -448.0, 1.0, 0.0, -0.0, 1.0625, 3.0 * pow2(-9)],
    );
    for alg in ALGS {
        let (p, q, out) = roundtrip(alg, WireType::F8E4M3, DType::F32, &src);
        assert_eq!(p.scale(), 1.0);
        assert_eq!(
            &q[PARAMS_LEN..],
            &[0x7E, 0xFE, 0x38, 0x00, 0x80, 0x38, 0x03]
        );
        let out = dec(DType::F32, &out);
        assert_eq!(out, [448.0, -448.0, 1.0, 0.0, -0.0, 1.0, 3.0 * pow2(-9)]);
        assert!(out[4].is_sign_negative());
    }
    // E5M2: max |x| = 2 maps to 57344 = 2^15 * 1.75: scale 2/57344.
    let src = enc(DType::F64, &[2.0, -1.0, 0.25]);
    let (p, q, out) = roundtrip(QuantAlgorithm::MinMax, WireType::F8E5M2, DType::F64, &src);
    assert_eq!(p.scale(), 2.0 / 57344.0);
    assert_eq!(q[PARAMS_LEN], 0x7B);
    assert_eq!(dec(DType::F64, &out)[0], 2.0);
}

#[test]
fn i8_and_u8_decode_to_the_same_values() {
    for dtype in FLOATS {
        for alg in ALGS {
            let src = sample(dtype, 777, 3, 1, 99);
            let (_, qu, ou) = roundtrip(alg, WireType::U8, dtype, &src);
            let (_, qi, oi) = roundtrip(alg, WireType::I8, dtype, &src);
            assert_eq!(ou, oi, "{alg:?} {dtype:?}");
            let flipped: Vec<u8> = qu[PARAMS_LEN..].iter().map(|c| c ^ 0x80).collect();
            assert_eq!(&qi[PARAMS_LEN..], &flipped[..], "{alg:?} {dtype:?}");
        }
    }
}

// ---- error bounds ----------------------------------------------------------------------

fn float_strategy() -> impl Strategy<Value = DType> {
    proptest::sample::select(FLOATS.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn prop_roundtrip_within_documented_bounds(
        dtype in float_strategy(),
        alg in proptest::sample::select(ALGS.to_vec()),
        wire in proptest::sample::select(WireType::ALL.to_vec()),
        n in 0usize..1200,
        k in -30i32..30,
        shape: u8,
        seed: u64,
    ) {
        // Keep f16 inside its exponent range.
        let k = if dtype == DType::F16 { k.clamp(-20, 3) } else { k };
        let src = sample(dtype, n, k, shape, seed);
        let (p, _, out) = roundtrip(alg, wire, dtype, &src);
        prop_assert!(!p.nonfinite);
        check_roundtrip(&p, &src, &out, &format!("{alg:?} {wire:?} {dtype:?} k={k}"));
    }

    #[test]
    fn prop_arbitrary_bits_never_produce_nan_from_nowhere(
        dtype in float_strategy(),
        alg in proptest::sample::select(ALGS.to_vec()),
        wire in proptest::sample::select(WireType::ALL.to_vec()),
        bytes in proptest::collection::vec(any::<u8>(), 0..2400),
    ) {
        // Random bit patterns: every exponent, NaNs with payloads, infinities, subnormals.
        let src = &bytes[..bytes.len() / dtype.size() * dtype.size()];
        let (p, _, out) = roundtrip(alg, wire, dtype, src);
        check_roundtrip(&p, src, &out, &format!("{alg:?} {wire:?} {dtype:?}"));
    }
}

// ---- edge cases ------------------------------------------------------------------------

/// Every algorithm x wire type x float dtype.
fn every_combination() -> impl Iterator<Item = (QuantAlgorithm, WireType, DType)> {
    ALGS.into_iter().flat_map(|a| {
        WireType::ALL
            .into_iter()
            .flat_map(move |w| FLOATS.into_iter().map(move |d| (a, w, d)))
    })
}

#[test]
fn empty_chunk() {
    for (alg, wire, dtype) in every_combination() {
        let mut q = vec![0xAAu8; PARAMS_LEN];
        quantize(alg, wire, dtype, &[], &mut q).unwrap();
        let p = QuantParams::from_bytes(&q).unwrap();
        assert!(p.min == 0.0 && p.max == 0.0 && !p.nonfinite && p.exp_shift == 0);
        assert_eq!(p.scale(), 0.0);
        dequantize(wire, dtype, &q, &mut []).unwrap();
        dequantize_reduce(wire, dtype, ReduceOp::Sum, &q, &[], &mut []).unwrap();
    }
}

#[test]
fn constant_chunks_round_trip_exactly() {
    for (alg, wire, dtype) in every_combination() {
        let max = dtype_max(dtype);
        let tiny = match dtype {
            DType::F16 => pow2(-24),
            DType::BF16 => pow2(-133),
            DType::F32 => pow2(-149),
            _ => f64::from_bits(1),
        };
        let constants = [
            1.0,
            -3.5,
            0.1,
            1e-3,
            -7e4,
            max,
            -max,
            tiny,
            -tiny,
            3.0 * tiny,
            0.0,
        ];
        for c in constants {
            let c = dec(dtype, &enc(dtype, &[c.clamp(-max, max)]))[0];
            for n in [1usize, 7, 100] {
                let src = enc(dtype, &vec![c; n]);
                let (p, _, out) = roundtrip(alg, wire, dtype, &src);
                assert_eq!(
                    out, src,
                    "{alg:?} {wire:?} {dtype:?}: constant {c:e} x {n} ({p:?})"
                );
            }
        }
    }
}

#[test]
fn zeros_and_signed_zeros() {
    for (alg, wire, dtype) in every_combination() {
        let src = enc(dtype, &[0.0, -0.0, 0.0, -0.0]);
        let (p, _, out) = roundtrip(alg, wire, dtype, &src);
        assert!(
            p.min.to_bits() == 0 && p.max.to_bits() == 0,
            "zeros are stored as +0.0"
        );
        let out = dec(dtype, &out);
        assert!(out.iter().all(|&v| v == 0.0));
        let signs: Vec<bool> = out.iter().map(|v| v.is_sign_negative()).collect();
        if wire.fp8().is_some() {
            assert_eq!(
                signs,
                [false, true, false, true],
                "8-bit floats keep the sign"
            );
        } else {
            assert_eq!(signs, [false; 4], "integer codes give +0.0");
        }
        // With ZeroPointScale (and always with 8-bit floats) zero stays exactly zero in
        // a chunk with other values.
        let src = enc(dtype, &[-1.7, 0.0, 2.3, 0.0, 0.4]);
        let (_, _, out) = roundtrip(alg, wire, dtype, &src);
        let out = dec(dtype, &out);
        if alg == QuantAlgorithm::ZeroPointScale || wire.fp8().is_some() {
            assert!(
                out[1] == 0.0 && out[3] == 0.0,
                "{alg:?} {wire:?} {dtype:?}: {out:?}"
            );
        }
    }
}

#[test]
fn huge_ranges() {
    for (alg, wire, dtype) in every_combination() {
        let max = dtype_max(dtype);
        let src = enc(dtype, &[-max, max, 0.0, max / 3.0, -max / 7.0, 1.0, -1e-3]);
        let (p, _, out) = roundtrip(alg, wire, dtype, &src);
        assert!(!p.nonfinite);
        assert_eq!(p.exp_shift, if dtype == DType::F64 { 8 } else { 0 });
        assert!(dec(dtype, &out).iter().all(|v| v.is_finite()));
        check_roundtrip(&p, &src, &out, &format!("huge {alg:?} {wire:?} {dtype:?}"));
        // Both extremes come back exactly where the docs say so.
        let out = dec(dtype, &out);
        if alg == QuantAlgorithm::MinMax || wire.fp8().is_some() {
            assert_eq!((out[0], out[1]), (-max, max), "{alg:?} {wire:?} {dtype:?}");
        }
    }
    // f32 values 1e38 apart in f32 (the sum would overflow f32).
    let src = enc(DType::F32, &[-3e38, 3e38, 1e38, -1e38, 0.0]);
    for alg in ALGS {
        let (p, _, out) = roundtrip(alg, WireType::U8, DType::F32, &src);
        check_roundtrip(&p, &src, &out, "f32 1e38");
    }
}

#[test]
fn subnormal_chunks() {
    for (alg, wire, dtype) in every_combination() {
        let tiny = match dtype {
            DType::F16 => pow2(-24),
            DType::BF16 => pow2(-133),
            DType::F32 => pow2(-149),
            _ => f64::from_bits(1),
        };
        // Pure subnormals, and subnormals next to a normal value.
        let vals: Vec<f64> = (0..300).map(|i| f64::from(i % 37 - 18) * tiny).collect();
        let src = enc(dtype, &vals);
        let (p, _, out) = roundtrip(alg, wire, dtype, &src);
        assert_eq!(p.exp_shift, if dtype == DType::F64 { -128 } else { 0 });
        check_roundtrip(
            &p,
            &src,
            &out,
            &format!("subnormal {alg:?} {wire:?} {dtype:?}"),
        );
        let mut vals = vals;
        vals.push(1.0);
        let src = enc(dtype, &vals);
        let (p, _, out) = roundtrip(alg, wire, dtype, &src);
        check_roundtrip(&p, &src, &out, &format!("mixed {alg:?} {wire:?} {dtype:?}"));
    }
}

#[test]
fn nan_and_infinities_keep_their_class() {
    let vals = [
        1.0,
        f64::NAN,
        f64::INFINITY,
        -2.0,
        f64::NEG_INFINITY,
        0.5,
        -f64::NAN,
    ];
    for (alg, wire, dtype) in every_combination() {
        let src = enc(dtype, &vals);
        let (p, q, out) = roundtrip(alg, wire, dtype, &src);
        assert!(p.nonfinite);
        assert_eq!((p.min, p.max), (-2.0, 1.0), "range over finite values only");
        check_roundtrip(
            &p,
            &src,
            &out,
            &format!("nonfinite {alg:?} {wire:?} {dtype:?}"),
        );
        let codes = &q[PARAMS_LEN..];
        let (nan, pinf, ninf) = match wire {
            WireType::U8 => (255, 254, 253),
            WireType::I8 => (127, 126, 125),
            WireType::F8E4M3 => (0x7F, 0x7E, 0xFE),
            WireType::F8E5M2 => (0x7E, 0x7C, 0xFC),
        };
        assert_eq!(
            (codes[1], codes[2], codes[4], codes[6]),
            (nan, pinf, ninf, nan)
        );
        // Finite codes stay clear of the reserved ones.
        for &i in &[0usize, 3, 5] {
            let c = codes[i];
            match wire {
                WireType::U8 => assert!(c <= 252),
                WireType::I8 => assert!((c as i8) <= 124),
                WireType::F8E4M3 => assert!(c & 0x7F <= 0x7D),
                WireType::F8E5M2 => assert!(c & 0x7F <= 0x7B),
            }
        }
    }
    // Only non-finite values: range 0, every element keeps its class.
    for (alg, wire, dtype) in every_combination() {
        let src = enc(dtype, &[f64::NAN, f64::INFINITY, f64::NEG_INFINITY]);
        let (p, _, out) = roundtrip(alg, wire, dtype, &src);
        assert!(p.nonfinite && p.min == 0.0 && p.max == 0.0);
        check_roundtrip(&p, &src, &out, "all non-finite");
    }
    // NaN payloads and signalling NaNs come back as the canonical NaN.
    let src: Vec<u8> = [0x7C01u16, 0xFE55, 0x3C00]
        .iter()
        .flat_map(|b| b.to_le_bytes())
        .collect();
    let (_, _, out) = roundtrip(QuantAlgorithm::MinMax, WireType::U8, DType::F16, &src);
    assert_eq!(out, [0x00, 0x7E, 0x00, 0x7E, 0x00, 0x3C]);
}

#[test]
fn flagged_chunks_use_252_levels() {
    let src = enc(DType::F32, &[0.0, 252.0, f64::NAN]);
    let (p, q, out) = roundtrip(QuantAlgorithm::MinMax, WireType::U8, DType::F32, &src);
    assert_eq!(p.scale(), 1.0);
    assert_eq!(&q[PARAMS_LEN..], &[0, 252, 255]);
    assert_eq!(&dec(DType::F32, &out)[..2], &[0.0, 252.0]);
    // E4M3: max |x| maps to 416 (0x7D) so that 0x7E can stand for +infinity.
    let src = enc(DType::F32, &[416.0, f64::INFINITY]);
    let (p, q, _) = roundtrip(QuantAlgorithm::MinMax, WireType::F8E4M3, DType::F32, &src);
    assert_eq!(p.scale(), 1.0);
    assert_eq!(&q[PARAMS_LEN..], &[0x7D, 0x7E]);
}

// ---- fused de-quantize + reduce ----------------------------------------------------------

#[test]
fn dequantize_reduce_equals_dequantize_then_reduce() {
    let mut rng = Rng(12345);
    for (alg, wire, dtype) in every_combination() {
        // Crosses the fused step boundary; includes NaN / infinities in both operands.
        let n = 3001;
        let mut vals: Vec<f64> = (0..n).map(|_| rng.unit() * 10.0).collect();
        vals[5] = f64::NAN;
        vals[17] = f64::INFINITY;
        vals[2000] = f64::NEG_INFINITY;
        let q = quant(
            alg,
            wire,
            dtype,
            &enc(dtype, &vals),
            kernels::simd_available(),
        );
        let t = dequant(wire, dtype, &q);
        // `x` is arbitrary bits (every float class), but keep some overlap of values.
        let mut x: Vec<u8> = (0..n * dtype.size()).map(|_| rng.next() as u8).collect();
        x[..dtype.size() * 100].copy_from_slice(&t[..dtype.size() * 100]);
        for op in ReduceOp::ALL {
            for off in [0usize, 3] {
                let mut want = vec![0u8; t.len()];
                reduce(dtype, op, &mut want, &t, &x).unwrap();
                let xb = Buf::new(&x, off);
                let mut acc = Buf::new(&vec![0u8; t.len()], off);
                dequantize_reduce(wire, dtype, op, &q, xb.bytes(), acc.bytes_mut()).unwrap();
                assert_eq!(acc.bytes(), &want[..], "{alg:?} {wire:?} {dtype:?} {op:?}");

                let mut want = x.clone();
                reduce_inplace(dtype, op, &mut want, &t).unwrap();
                let mut acc = Buf::new(&x, off);
                dequantize_reduce_inplace(wire, dtype, op, &q, acc.bytes_mut()).unwrap();
                assert_eq!(
                    acc.bytes(),
                    &want[..],
                    "inplace {alg:?} {wire:?} {dtype:?} {op:?}"
                );
            }
        }
    }
}

// ---- determinism -----------------------------------------------------------------------

#[test]
fn deterministic_and_alignment_independent() {
    for (alg, wire, dtype) in every_combination() {
        let mut src = sample(dtype, 1000 + 3, 2, 2, 7);
        // Some non-finite values too, so the second statistics pass runs.
        src[dtype.size() * 10..dtype.size() * 11].copy_from_slice(&enc(dtype, &[f64::NAN]));
        let want = quant(alg, wire, dtype, &src, false);
        let out_want = dequant(wire, dtype, &want);
        for simd in [false, kernels::simd_available()] {
            for off in 0..8 {
                let s = Buf::new(&src, off);
                let mut q = Buf::new(&vec![0u8; want.len()], (off * 3) % 8);
                quantize_with(alg, wire, dtype, s.bytes(), q.bytes_mut(), simd).unwrap();
                assert_eq!(
                    q.bytes(),
                    &want[..],
                    "{alg:?} {wire:?} {dtype:?} offset {off}"
                );
                let mut out = Buf::new(&vec![0u8; out_want.len()], off);
                dequantize(wire, dtype, q.bytes(), out.bytes_mut()).unwrap();
                assert_eq!(out.bytes(), &out_want[..]);
            }
        }
        assert_eq!(quant(alg, wire, dtype, &src, false), want);
    }
}

// ---- argument checking -------------------------------------------------------------------

#[test]
fn bad_arguments_are_rejected_without_writing() {
    let invalid = |r: CoreResult<()>| matches!(r, Err(CoreError::InvalidArgument(_)));
    let src = enc(DType::F32, &[1.0, 2.0, 3.0]);
    let mut q = vec![9u8; quantized_len(3)];
    let mm = QuantAlgorithm::MinMax;
    for dtype in DType::ALL.into_iter().filter(|d| !d.is_float()) {
        let s = vec![0u8; 3 * dtype.size()];
        assert!(invalid(quantize(mm, WireType::U8, dtype, &s, &mut q)));
        let mut out = vec![0u8; 3 * dtype.size()];
        assert!(invalid(dequantize(WireType::U8, dtype, &q, &mut out)));
    }
    assert!(invalid(quantize(
        QuantAlgorithm::None,
        WireType::U8,
        DType::F32,
        &src,
        &mut q
    )));
    assert!(invalid(quantize(
        mm,
        WireType::U8,
        DType::F32,
        &src[..11],
        &mut q
    )));
    assert!(invalid(quantize(
        mm,
        WireType::U8,
        DType::F32,
        &src,
        &mut q[..26]
    )));
    assert!(invalid(quantize(
        mm,
        WireType::U8,
        DType::F32,
        &src,
        &mut [0u8; 28]
    )));
    assert_eq!(q, vec![9u8; quantized_len(3)]);

    quantize(mm, WireType::U8, DType::F32, &src, &mut q).unwrap();
    let mut out = vec![5u8; 12];
    assert!(invalid(dequantize(
        WireType::U8,
        DType::F32,
        &q[..26],
        &mut out
    )));
    assert!(invalid(dequantize(
        WireType::U8,
        DType::F32,
        &q,
        &mut out[..11]
    )));
    assert!(invalid(dequantize(
        WireType::U8,
        DType::F32,
        &q,
        &mut out[..8]
    )));
    assert!(invalid(dequantize_reduce(
        WireType::U8,
        DType::F32,
        ReduceOp::Sum,
        &q,
        &[0u8; 8],
        &mut out
    )));
    // The header disagrees with what the receiver expects.
    for (w, d) in [(WireType::I8, DType::F32), (WireType::U8, DType::BF16)] {
        let mut o = vec![5u8; 3 * d.size()];
        assert!(matches!(
            dequantize(w, d, &q, &mut o),
            Err(CoreError::Protocol(_))
        ));
        assert!(matches!(
            dequantize_reduce_inplace(w, d, ReduceOp::Max, &q, &mut o),
            Err(CoreError::Protocol(_))
        ));
        assert!(o.iter().all(|&b| b == 5));
    }
    assert_eq!(out, [5u8; 12]);
}

#[test]
fn enum_codes() {
    assert_eq!(
        QuantAlgorithm::from_u8(2),
        Some(QuantAlgorithm::ZeroPointScale)
    );
    assert_eq!(QuantAlgorithm::from_u8(3), None);
    for w in WireType::ALL {
        assert_eq!(WireType::from_u8(w as u8), Some(w));
    }
    assert_eq!(
        WireType::ALL.map(|w| w as u8),
        [8, 4, 12, 13],
        "match the Python DataType values"
    );
    assert_eq!(WireType::from_u8(0), None);
    assert_eq!(quantized_len(0), PARAMS_LEN);
    assert_eq!(quantized_len(1000), 1024);
}
