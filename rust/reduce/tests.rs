//! Tests of the reduction kernels: every dtype x op against a scalar reference (at any
//! alignment and tail length), integer wrap-around, NaN and signed-zero rules, f16/bf16
//! rounding (exhaustively), length errors, finalize (AVG), and property tests.

use super::*;
// A byte buffer starting `offset` bytes past a 64-byte boundary.
use crate::pod::OffsetBuf as Buf;
use proptest::prelude::*;

// ---- helpers -----------------------------------------------------------------------

use crate::testutil::SplitMix as Rng;

/// Random test data of `n` elements. For floats half the elements are "ordinary"
/// values (small magnitudes, mixed signs, some ties) and the rest raw random bits,
/// which include NaNs, infinities, subnormals and signed zeros.
fn sample(dtype: DType, n: usize, rng: &mut Rng) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * dtype.size());
    for _ in 0..n {
        let raw = rng.next();
        let ordinary = raw & 1 == 0;
        let v = ((raw >> 8) % 2001) as f64 / 100.0 - 10.0; // -10.00 ..= 10.00
        match dtype {
            DType::F16 if ordinary => out.extend(f16::from_f64(v).to_le_bytes()),
            DType::BF16 if ordinary => out.extend(bf16::from_f64(v).to_le_bytes()),
            DType::F32 if ordinary => out.extend((v as f32).to_le_bytes()),
            DType::F64 if ordinary => out.extend(v.to_le_bytes()),
            _ => out.extend(&raw.to_le_bytes()[..dtype.size()]),
        }
    }
    // Sprinkle in special values.
    let specials: &[f64] = &[0.0, -0.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 1.0];
    if dtype.is_float() {
        for (i, &s) in specials.iter().enumerate() {
            if i < n && rng.next().is_multiple_of(3) {
                let at = (rng.next() as usize % n) * dtype.size();
                let enc: Vec<u8> = match dtype {
                    DType::F16 => f16::from_f64(s).to_le_bytes().to_vec(),
                    DType::BF16 => bf16::from_f64(s).to_le_bytes().to_vec(),
                    DType::F32 => (s as f32).to_le_bytes().to_vec(),
                    _ => s.to_le_bytes().to_vec(),
                };
                out[at..at + enc.len()].copy_from_slice(&enc);
            }
        }
    }
    out
}

// ---- scalar reference ----------------------------------------------------------------

/// Straightforward float reference for one element, written independently of the
/// kernels' select-based formulation.
fn ref_float<F>(op: ReduceOp, a: F, b: F) -> F
where
    F: Copy + PartialOrd + std::ops::Add<Output = F> + std::ops::Mul<Output = F> + FloatBits,
{
    match op {
        ReduceOp::Sum | ReduceOp::Avg | ReduceOp::Prod => {
            let r = if op == ReduceOp::Prod { a * b } else { a + b };
            if r.nan_() {
                F::qnan()
            } else {
                r
            }
        }
        ReduceOp::Max | ReduceOp::Min => {
            if a.nan_() {
                return a;
            }
            if b.nan_() {
                return b;
            }
            if a.zero_() && b.zero_() {
                // -0 < +0
                let a_neg = a.neg_();
                let b_neg = b.neg_();
                let pick_a = if op == ReduceOp::Max {
                    !a_neg || b_neg
                } else {
                    a_neg || !b_neg
                };
                return if pick_a { a } else { b };
            }
            let a_wins = if op == ReduceOp::Max { a >= b } else { a <= b };
            if a_wins {
                a
            } else {
                b
            }
        }
    }
}

trait FloatBits {
    fn qnan() -> Self;
    fn nan_(self) -> bool;
    fn zero_(self) -> bool;
    fn neg_(self) -> bool;
}
impl FloatBits for f32 {
    fn qnan() -> Self {
        f32::from_bits(0x7FC0_0000)
    }
    fn nan_(self) -> bool {
        self.is_nan()
    }
    fn zero_(self) -> bool {
        self == 0.0
    }
    fn neg_(self) -> bool {
        self.is_sign_negative()
    }
}
impl FloatBits for f64 {
    fn qnan() -> Self {
        f64::from_bits(0x7FF8_0000_0000_0000)
    }
    fn nan_(self) -> bool {
        self.is_nan()
    }
    fn zero_(self) -> bool {
        self == 0.0
    }
    fn neg_(self) -> bool {
        self.is_sign_negative()
    }
}

macro_rules! ref_int {
    ($op:expr, $a:expr, $b:expr) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => $a.wrapping_add($b),
            ReduceOp::Prod => $a.wrapping_mul($b),
            ReduceOp::Max => std::cmp::max($a, $b),
            ReduceOp::Min => std::cmp::min($a, $b),
        }
    };
}

/// Element-by-element reference for `reduce`.
fn reference(dtype: DType, op: ReduceOp, a: &[u8], b: &[u8]) -> Vec<u8> {
    let sz = dtype.size();
    let mut out = Vec::with_capacity(a.len());
    for (x, y) in a.chunks_exact(sz).zip(b.chunks_exact(sz)) {
        macro_rules! int {
            ($t:ty) => {{
                let x = <$t>::from_le_bytes(x.try_into().unwrap());
                let y = <$t>::from_le_bytes(y.try_into().unwrap());
                out.extend(ref_int!(op, x, y).to_le_bytes());
            }};
        }
        match dtype {
            DType::F16 => {
                let x = f16::from_le_bytes(x.try_into().unwrap()).to_f32();
                let y = f16::from_le_bytes(y.try_into().unwrap()).to_f32();
                out.extend(f16::from_f32(ref_float(op, x, y)).to_le_bytes());
            }
            DType::BF16 => {
                let x = bf16::from_le_bytes(x.try_into().unwrap()).to_f32();
                let y = bf16::from_le_bytes(y.try_into().unwrap()).to_f32();
                out.extend(bf16::from_f32(ref_float(op, x, y)).to_le_bytes());
            }
            DType::F32 => {
                let x = f32::from_le_bytes(x.try_into().unwrap());
                let y = f32::from_le_bytes(y.try_into().unwrap());
                out.extend(ref_float(op, x, y).to_le_bytes());
            }
            DType::F64 => {
                let x = f64::from_le_bytes(x.try_into().unwrap());
                let y = f64::from_le_bytes(y.try_into().unwrap());
                out.extend(ref_float(op, x, y).to_le_bytes());
            }
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
    out
}

/// Run both `reduce` and `reduce_inplace` with the given byte offsets and return both
/// results.
fn run_both(
    dtype: DType,
    op: ReduceOp,
    a: &[u8],
    b: &[u8],
    offs: (usize, usize, usize),
) -> (Vec<u8>, Vec<u8>) {
    let ba = Buf::new(a, offs.1);
    let bb = Buf::new(b, offs.2);
    let mut dst = Buf::zeroed(a.len(), offs.0);
    reduce(dtype, op, dst.bytes_mut(), ba.bytes(), bb.bytes()).unwrap();
    let mut acc = Buf::new(a, offs.0);
    reduce_inplace(dtype, op, acc.bytes_mut(), bb.bytes()).unwrap();
    (dst.bytes().to_vec(), acc.bytes().to_vec())
}

/// Lengths (in elements) that hit empty input, tails, and block boundaries of both the
/// staged path (256 bytes) and the portable 16-bit path (256 elements).
const LENS: &[usize] = &[
    0, 1, 3, 7, 8, 33, 511, 512, 513, 1024, 2047, 2048, 2049, 4100, 9000,
];

fn hex_diff(dtype: DType, got: &[u8], want: &[u8]) -> String {
    let sz = dtype.size();
    for (i, (g, w)) in got.chunks(sz).zip(want.chunks(sz)).enumerate() {
        if g != w {
            return format!("first difference at element {i}: got {g:02x?}, want {w:02x?}");
        }
    }
    "lengths differ".into()
}

// ---- enums -----------------------------------------------------------------------

#[test]
fn dtype_codes_names_and_sizes() {
    let expected = [
        (DType::F16, 0, "float16", 2, true),
        (DType::BF16, 1, "bfloat16", 2, true),
        (DType::F32, 2, "float32", 4, true),
        (DType::F64, 3, "float64", 8, true),
        (DType::I8, 4, "int8", 1, false),
        (DType::I16, 5, "int16", 2, false),
        (DType::I32, 6, "int32", 4, false),
        (DType::I64, 7, "int64", 8, false),
        (DType::U8, 8, "uint8", 1, false),
        (DType::U16, 9, "uint16", 2, false),
        (DType::U32, 10, "uint32", 4, false),
        (DType::U64, 11, "uint64", 8, false),
    ];
    for (d, code, name, size, float) in expected {
        assert_eq!(d as u8, code);
        assert_eq!(DType::from_u8(code), Some(d));
        assert_eq!(d.name(), name);
        assert_eq!(DType::from_name(name), Some(d));
        assert_eq!(DType::from_name(&name.to_uppercase()), Some(d));
        assert_eq!(d.size(), size);
        assert_eq!(d.is_float(), float);
    }
    assert_eq!(DType::from_u8(12), None);
    assert_eq!(DType::from_u8(255), None);
    assert_eq!(DType::from_name("float"), None);
    assert_eq!(DType::from_name(""), None);
    assert_eq!(DType::from_name("int128"), None);
}

#[test]
fn reduce_op_codes_and_names() {
    let expected = [
        (ReduceOp::Sum, 0, "sum"),
        (ReduceOp::Avg, 1, "avg"),
        (ReduceOp::Prod, 2, "prod"),
        (ReduceOp::Max, 3, "max"),
        (ReduceOp::Min, 4, "min"),
    ];
    for (o, code, name) in expected {
        assert_eq!(o as u8, code);
        assert_eq!(ReduceOp::from_u8(code), Some(o));
        assert_eq!(o.name(), name);
        assert_eq!(ReduceOp::from_name(name), Some(o));
        assert_eq!(ReduceOp::from_name(&name.to_uppercase()), Some(o));
    }
    assert_eq!(ReduceOp::from_name("Avg"), Some(ReduceOp::Avg));
    assert_eq!(ReduceOp::from_u8(5), None);
    assert_eq!(ReduceOp::from_name("mean"), None);
    assert_eq!(ReduceOp::from_name(" sum"), None);
}

// ---- every dtype x op against the reference ------------------------------------------

#[test]
fn every_dtype_and_op_matches_reference() {
    let mut rng = Rng(1);
    for dtype in DType::ALL {
        for op in ReduceOp::ALL {
            for &n in LENS {
                let a = sample(dtype, n, &mut rng);
                let b = sample(dtype, n, &mut rng);
                let want = reference(dtype, op, &a, &b);
                let (got, got_inplace) = run_both(dtype, op, &a, &b, (0, 0, 0));
                assert!(
                    got == want,
                    "{} {} n={n} reduce: {}",
                    dtype.name(),
                    op.name(),
                    hex_diff(dtype, &got, &want)
                );
                assert!(
                    got_inplace == want,
                    "{} {} n={n} reduce_inplace: {}",
                    dtype.name(),
                    op.name(),
                    hex_diff(dtype, &got_inplace, &want)
                );
            }
        }
    }
}

#[test]
fn unaligned_inputs_match_aligned() {
    let mut rng = Rng(2);
    // Every combination of which operand is shifted by one byte (or a few).
    let offsets = [
        (1, 0, 0),
        (0, 1, 0),
        (0, 0, 1),
        (1, 1, 1),
        (3, 5, 7),
        (2, 2, 2),
        (4, 0, 4),
    ];
    for dtype in DType::ALL {
        for op in ReduceOp::ALL {
            for &n in &[1usize, 5, 1000, 2049, 4100] {
                let a = sample(dtype, n, &mut rng);
                let b = sample(dtype, n, &mut rng);
                let aligned = run_both(dtype, op, &a, &b, (0, 0, 0));
                assert_eq!(aligned.0, aligned.1);
                for offs in offsets {
                    let shifted = run_both(dtype, op, &a, &b, offs);
                    assert!(
                        shifted.0 == aligned.0 && shifted.1 == aligned.0,
                        "{} {} n={n} offsets {offs:?}",
                        dtype.name(),
                        op.name()
                    );
                }
            }
        }
    }
}

#[test]
fn unaligned_finalize_matches_aligned() {
    let mut rng = Rng(3);
    for dtype in DType::ALL {
        for &n in &[1usize, 7, 2049, 4100] {
            let data = sample(dtype, n, &mut rng);
            let mut aligned = Buf::new(&data, 0);
            finalize(dtype, ReduceOp::Avg, aligned.bytes_mut(), 3).unwrap();
            for off in [1, 2, 3, 5] {
                let mut shifted = Buf::new(&data, off);
                finalize(dtype, ReduceOp::Avg, shifted.bytes_mut(), 3).unwrap();
                assert_eq!(
                    shifted.bytes(),
                    aligned.bytes(),
                    "{} n={n} off={off}",
                    dtype.name()
                );
            }
        }
    }
}

// ---- integers ----------------------------------------------------------------------

fn reduce_vals<T: Copy>(
    dtype: DType,
    op: ReduceOp,
    a: &[T],
    b: &[T],
    enc: fn(T) -> Vec<u8>,
    dec: fn(&[u8]) -> T,
) -> Vec<T> {
    let ab: Vec<u8> = a.iter().flat_map(|&x| enc(x)).collect();
    let bb: Vec<u8> = b.iter().flat_map(|&x| enc(x)).collect();
    let mut out = vec![0u8; ab.len()];
    reduce(dtype, op, &mut out, &ab, &bb).unwrap();
    out.chunks(dtype.size()).map(dec).collect()
}

macro_rules! vals {
    ($t:ty, $dtype:expr, $op:expr, $a:expr, $b:expr) => {
        reduce_vals::<$t>(
            $dtype,
            $op,
            &$a,
            &$b,
            |x| x.to_le_bytes().to_vec(),
            |s| <$t>::from_le_bytes(s.try_into().unwrap()),
        )
    };
}

#[test]
fn integer_sum_and_prod_wrap() {
    use ReduceOp::*;
    assert_eq!(
        vals!(i8, DType::I8, Sum, [127i8, -128, -1], [1i8, -1, 1]),
        [-128, 127, 0]
    );
    assert_eq!(vals!(u8, DType::U8, Sum, [255u8, 200], [1u8, 100]), [0, 44]);
    assert_eq!(
        vals!(i8, DType::I8, Prod, [64i8, -128, 16], [2i8, -1, 16]),
        [-128, -128, 0]
    );
    assert_eq!(vals!(u8, DType::U8, Prod, [16u8, 255], [16u8, 255]), [0, 1]);
    assert_eq!(vals!(i16, DType::I16, Sum, [i16::MAX], [1i16]), [i16::MIN]);
    assert_eq!(vals!(u16, DType::U16, Prod, [256u16], [256u16]), [0]);
    assert_eq!(
        vals!(i32, DType::I32, Sum, [i32::MAX, i32::MIN], [i32::MAX, -1]),
        [-2, i32::MAX]
    );
    assert_eq!(vals!(i32, DType::I32, Prod, [65536i32], [65536i32]), [0]);
    assert_eq!(
        vals!(u32, DType::U32, Sum, [u32::MAX], [u32::MAX]),
        [u32::MAX - 1]
    );
    assert_eq!(vals!(i64, DType::I64, Sum, [i64::MIN], [-1i64]), [i64::MAX]);
    assert_eq!(
        vals!(i64, DType::I64, Prod, [i64::MIN], [-1i64]),
        [i64::MIN]
    );
    assert_eq!(vals!(u64, DType::U64, Sum, [u64::MAX], [2u64]), [1]);
    assert_eq!(
        vals!(u64, DType::U64, Prod, [1u64 << 32], [1u64 << 32]),
        [0]
    );
    // Avg accumulates the wrapped sum.
    assert_eq!(vals!(i8, DType::I8, Avg, [100i8], [100i8]), [-56]);
}

#[test]
fn integer_max_min_exact() {
    use ReduceOp::*;
    assert_eq!(
        vals!(i8, DType::I8, Max, [-128i8, 127, -1], [127i8, -128, 0]),
        [127, 127, 0]
    );
    assert_eq!(
        vals!(i8, DType::I8, Min, [-128i8, 127, -1], [127i8, -128, 0]),
        [-128, -128, -1]
    );
    assert_eq!(
        vals!(u8, DType::U8, Max, [0u8, 255], [255u8, 0]),
        [255, 255]
    );
    assert_eq!(
        vals!(i64, DType::I64, Min, [i64::MIN, 5], [i64::MAX, -5]),
        [i64::MIN, -5]
    );
    assert_eq!(
        vals!(
            u64,
            DType::U64,
            Max,
            [u64::MAX, 1 << 63],
            [u64::MAX - 1, (1 << 63) - 1]
        ),
        [u64::MAX, 1 << 63]
    );
    // Values that differ only beyond 2^53 (a float-based max would get this wrong).
    assert_eq!(
        vals!(i64, DType::I64, Max, [(1i64 << 60) + 1], [1i64 << 60]),
        [(1i64 << 60) + 1]
    );
}

// ---- floats: NaN and signed zero ------------------------------------------------------

/// Run op on scalar pairs in every float dtype (through f64 values) and return f64s.
fn float_pairs(dtype: DType, op: ReduceOp, pairs: &[(f64, f64)]) -> Vec<f64> {
    let enc = |v: f64| -> Vec<u8> {
        match dtype {
            DType::F16 => f16::from_f64(v).to_le_bytes().to_vec(),
            DType::BF16 => bf16::from_f64(v).to_le_bytes().to_vec(),
            DType::F32 => (v as f32).to_le_bytes().to_vec(),
            DType::F64 => v.to_le_bytes().to_vec(),
            _ => unreachable!(),
        }
    };
    let dec = |s: &[u8]| -> f64 {
        match dtype {
            DType::F16 => f16::from_le_bytes(s.try_into().unwrap()).to_f64(),
            DType::BF16 => bf16::from_le_bytes(s.try_into().unwrap()).to_f64(),
            DType::F32 => f32::from_le_bytes(s.try_into().unwrap()) as f64,
            DType::F64 => f64::from_le_bytes(s.try_into().unwrap()),
            _ => unreachable!(),
        }
    };
    let a: Vec<u8> = pairs.iter().flat_map(|p| enc(p.0)).collect();
    let b: Vec<u8> = pairs.iter().flat_map(|p| enc(p.1)).collect();
    let mut out = vec![0u8; a.len()];
    reduce(dtype, op, &mut out, &a, &b).unwrap();
    let mut acc = a.clone();
    reduce_inplace(dtype, op, &mut acc, &b).unwrap();
    assert_eq!(out, acc);
    out.chunks(dtype.size()).map(dec).collect()
}

const FLOATS: [DType; 4] = [DType::F16, DType::BF16, DType::F32, DType::F64];

#[test]
fn max_min_propagate_nan() {
    let nan = f64::NAN;
    let inf = f64::INFINITY;
    let pairs = [
        (nan, 1.0),
        (1.0, nan),
        (nan, nan),
        (nan, inf),
        (-inf, nan),
        (nan, -0.0),
        (0.0, nan),
    ];
    for dtype in FLOATS {
        for op in [ReduceOp::Max, ReduceOp::Min] {
            // Long enough that the vector loop, not only a scalar tail, sees the NaNs.
            let many: Vec<(f64, f64)> = pairs
                .iter()
                .cycle()
                .take(pairs.len() * 40)
                .copied()
                .collect();
            for (i, r) in float_pairs(dtype, op, &many).into_iter().enumerate() {
                assert!(
                    r.is_nan(),
                    "{} {} pair {:?} gave {r}",
                    dtype.name(),
                    op.name(),
                    many[i]
                );
            }
        }
    }
}

#[test]
fn max_min_nan_payload_comes_from_first_nan() {
    // Two distinct quiet NaNs: when both operands are NaN, the first one wins.
    let n1 = f32::from_bits(0x7FC0_0001);
    let n2 = f32::from_bits(0xFFC0_0002);
    for op in [ReduceOp::Max, ReduceOp::Min] {
        let a: Vec<u8> = [n1, 1.0, n2].iter().flat_map(|v| v.to_le_bytes()).collect();
        let b: Vec<u8> = [n2, n2, 3.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut out = vec![0u8; 12];
        reduce(DType::F32, op, &mut out, &a, &b).unwrap();
        let bits: Vec<u32> = out
            .chunks(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(bits, [0x7FC0_0001, 0xFFC0_0002, 0xFFC0_0002]);
    }
}

#[test]
fn max_min_ordinary_and_infinite_values() {
    let inf = f64::INFINITY;
    let pairs = [
        (1.0, 2.0),
        (2.0, 1.0),
        (-3.5, -3.25),
        (inf, 5.0),
        (-inf, -5.0),
        (7.0, 7.0),
    ];
    for dtype in FLOATS {
        assert_eq!(
            float_pairs(dtype, ReduceOp::Max, &pairs),
            [2.0, 2.0, -3.25, inf, -5.0, 7.0]
        );
        assert_eq!(
            float_pairs(dtype, ReduceOp::Min, &pairs),
            [1.0, 1.0, -3.5, 5.0, -inf, 7.0]
        );
    }
}

#[test]
fn signed_zero_order_is_deterministic_and_commutative() {
    let pairs = [(-0.0, 0.0), (0.0, -0.0), (-0.0, -0.0), (0.0, 0.0)];
    for dtype in FLOATS {
        let max = float_pairs(dtype, ReduceOp::Max, &pairs);
        let min = float_pairs(dtype, ReduceOp::Min, &pairs);
        let signs = |v: &[f64]| v.iter().map(|x| x.is_sign_negative()).collect::<Vec<_>>();
        assert!(max.iter().all(|&x| x == 0.0) && min.iter().all(|&x| x == 0.0));
        assert_eq!(signs(&max), [false, false, true, false], "{}", dtype.name());
        assert_eq!(signs(&min), [true, true, true, false], "{}", dtype.name());
    }
}

#[test]
fn float_sum_prod_ieee() {
    let inf = f64::INFINITY;
    for dtype in FLOATS {
        let s = float_pairs(
            dtype,
            ReduceOp::Sum,
            &[(1.5, 2.25), (inf, 1.0), (-0.0, -0.0), (-0.0, 0.0)],
        );
        assert_eq!(s[..2], [3.75, inf]);
        assert!(s[2] == 0.0 && s[2].is_sign_negative());
        assert!(s[3] == 0.0 && !s[3].is_sign_negative());
        let nan = float_pairs(dtype, ReduceOp::Sum, &[(inf, -inf)]);
        assert!(nan[0].is_nan());
        let p = float_pairs(
            dtype,
            ReduceOp::Prod,
            &[(1.5, -2.0), (0.0, -1.0), (inf, 0.0)],
        );
        assert_eq!(p[0], -3.0);
        assert!(p[1] == 0.0 && p[1].is_sign_negative());
        assert!(p[2].is_nan());
    }
    // f32 is computed in f32, not f64: 1 + 2^-24 rounds back to 1.
    let s = float_pairs(DType::F32, ReduceOp::Sum, &[(1.0, 2f64.powi(-24))]);
    assert_eq!(s[0], 1.0);
    let s = float_pairs(DType::F64, ReduceOp::Sum, &[(1.0, 2f64.powi(-24))]);
    assert_eq!(s[0], 1.0 + 2f64.powi(-24));
}

// ---- f16 / bf16 rounding -------------------------------------------------------------

/// Every 16-bit pattern as `a`, against a spread of `b`s, must equal computing in f32
/// and rounding with `half`.
fn exhaustive_half(dtype: DType, to_f32: fn(u16) -> f32, from_f32: fn(f32) -> u16, bs: &[u16]) {
    let a: Vec<u8> = (0..=u16::MAX).flat_map(|x| x.to_le_bytes()).collect();
    for &bv in bs {
        let b: Vec<u8> = std::iter::repeat_n(bv.to_le_bytes(), 65536)
            .flatten()
            .collect();
        for op in ReduceOp::ALL {
            let mut out = vec![0u8; a.len()];
            reduce(dtype, op, &mut out, &a, &b).unwrap();
            for (i, c) in out.chunks(2).enumerate() {
                let got = u16::from_le_bytes([c[0], c[1]]);
                let want = from_f32(ref_float(op, to_f32(i as u16), to_f32(bv)));
                assert_eq!(
                    got,
                    want,
                    "{} {} a={i:#06x} b={bv:#06x}",
                    dtype.name(),
                    op.name()
                );
            }
        }
    }
}

const HALF_BS: [u16; 12] = [
    0x0000, 0x8000, 0x0001, 0x8001, 0x3C00, 0xBC00, 0x3C01, 0x7BFF, 0x7C00, 0xFE00, 0x1234, 0x5555,
];

#[test]
fn f16_matches_f32_then_round_exhaustive() {
    exhaustive_half(
        DType::F16,
        |x| f16::from_bits(x).to_f32(),
        |v| f16::from_f32(v).to_bits(),
        &HALF_BS,
    );
}

#[test]
fn bf16_matches_f32_then_round_exhaustive() {
    exhaustive_half(
        DType::BF16,
        |x| bf16::from_bits(x).to_f32(),
        |v| bf16::from_f32(v).to_bits(),
        &HALF_BS,
    );
}

/// Run one specific 16-bit kernel implementation (portable or x86 AVX2/F16C).
fn half_path(
    dtype: DType,
    op: ReduceOp,
    portable: bool,
    out: &mut [u8],
    a: Option<&[u8]>,
    b: &[u8],
) {
    macro_rules! go {
        ($h:ty, $o:ty) => {
            if portable {
                half_kernel_portable::<$h, $o>(out, a, b)
            } else {
                #[cfg(target_arch = "x86_64")]
                {
                    assert!(x86::available());
                    // SAFETY: checked just above.
                    unsafe { x86::half_kernel::<$h, $o>(out, a, b) }
                }
                #[cfg(not(target_arch = "x86_64"))]
                unreachable!()
            }
        };
    }
    macro_rules! by_op {
        ($h:ty) => {
            match op {
                ReduceOp::Sum | ReduceOp::Avg => go!($h, Sum),
                ReduceOp::Prod => go!($h, Prod),
                ReduceOp::Max => go!($h, Max),
                ReduceOp::Min => go!($h, Min),
            }
        };
    }
    match dtype {
        DType::F16 => by_op!(f16),
        DType::BF16 => by_op!(bf16),
        _ => unreachable!(),
    }
}

/// The implementations of the 16-bit kernel this machine can run: `true` = portable.
fn half_paths() -> Vec<bool> {
    let mut paths = vec![true];
    #[cfg(target_arch = "x86_64")]
    if x86::available() {
        paths.push(false);
    } else {
        eprintln!("note: CPU lacks AVX2/F16C, only the portable 16-bit path is tested");
    }
    paths
}

#[test]
fn half_paths_match_reference_exhaustively() {
    // Every 16-bit pattern as `a` against a spread of `b`s, through each implementation
    // separately (the public entry point only exercises the one this CPU picks), with
    // aligned and unaligned buffers, for both the two- and three-operand forms.
    let a: Vec<u8> = (0..=u16::MAX).flat_map(|x| x.to_le_bytes()).collect();
    for dtype in [DType::F16, DType::BF16] {
        for &bv in &HALF_BS {
            let b: Vec<u8> = std::iter::repeat_n(bv.to_le_bytes(), 65536)
                .flatten()
                .collect();
            for op in ReduceOp::ALL {
                let want = reference(dtype, op, &a, &b);
                for portable in half_paths() {
                    for off in [0usize, 1] {
                        let ba = Buf::new(&a, off);
                        let bb = Buf::new(&b, 1 - off);
                        let mut out = Buf::zeroed(a.len(), off);
                        half_path(
                            dtype,
                            op,
                            portable,
                            out.bytes_mut(),
                            Some(ba.bytes()),
                            bb.bytes(),
                        );
                        assert!(
                            out.bytes() == &want[..],
                            "{} {} portable={portable} off={off} b={bv:#06x}: {}",
                            dtype.name(),
                            op.name(),
                            hex_diff(dtype, out.bytes(), &want)
                        );
                        let mut acc = Buf::new(&a, off);
                        half_path(dtype, op, portable, acc.bytes_mut(), None, bb.bytes());
                        assert!(
                            acc.bytes() == &want[..],
                            "inplace {} {}",
                            dtype.name(),
                            op.name()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn half_paths_handle_every_tail_length() {
    // Lengths 0..=40 and around the block size cover every remainder of the 8-wide loop.
    let mut rng = Rng(5);
    let lens: Vec<usize> = (0..=40)
        .chain([2040, 2047, 2048, 2049, 2055, 4097])
        .collect();
    for dtype in [DType::F16, DType::BF16] {
        for op in ReduceOp::ALL {
            for &n in &lens {
                let a = sample(dtype, n, &mut rng);
                let b = sample(dtype, n, &mut rng);
                let want = reference(dtype, op, &a, &b);
                for portable in half_paths() {
                    let mut out = vec![0u8; a.len()];
                    half_path(dtype, op, portable, &mut out, Some(&a), &b);
                    assert_eq!(
                        out,
                        want,
                        "{} {} n={n} portable={portable}",
                        dtype.name(),
                        op.name()
                    );
                }
            }
        }
    }
}

#[test]
fn half_rounding_ties_to_even() {
    // f16: 1.0 has ulp 2^-10. 1 + 2^-11 is a tie -> even (1.0); (1 + 2^-10) + 2^-11 is a
    // tie -> even (1 + 2^-9).
    let h = |v: f64| f16::from_f64(v).to_f64();
    let r = float_pairs(
        DType::F16,
        ReduceOp::Sum,
        &[
            (1.0, 2f64.powi(-11)),
            (h(1.0 + 2f64.powi(-10)), 2f64.powi(-11)),
        ],
    );
    assert_eq!(r, [1.0, 1.0 + 2f64.powi(-9)]);
    // bf16: ulp of 1.0 is 2^-7.
    let r = float_pairs(
        DType::BF16,
        ReduceOp::Sum,
        &[(1.0, 2f64.powi(-8)), (1.0 + 2f64.powi(-7), 2f64.powi(-8))],
    );
    assert_eq!(r, [1.0, 1.0 + 2f64.powi(-6)]);
    // Overflow to infinity on rounding: f16 max is 65504.
    let r = float_pairs(
        DType::F16,
        ReduceOp::Sum,
        &[(65504.0, 65504.0), (65504.0, 8.0)],
    );
    assert_eq!(r, [f64::INFINITY, 65504.0]);
    // Rounding happens per call: three additions of a half-ulp in f16 stay at 1.0.
    let mut acc = f16::from_f32(1.0).to_le_bytes().to_vec();
    let x = f16::from_f64(2f64.powi(-11)).to_le_bytes();
    for _ in 0..3 {
        reduce_inplace(DType::F16, ReduceOp::Sum, &mut acc, &x).unwrap();
    }
    assert_eq!(f16::from_le_bytes([acc[0], acc[1]]).to_f32(), 1.0);
}

// ---- errors ------------------------------------------------------------------------

fn is_invalid_argument(r: CoreResult<()>) -> bool {
    matches!(r, Err(CoreError::InvalidArgument(_)))
}

#[test]
fn length_errors() {
    let mut d8 = [0u8; 8];
    let mut d6 = [0u8; 6];
    let a8 = [0u8; 8];
    let a4 = [0u8; 4];
    let a6 = [0u8; 6];
    for op in ReduceOp::ALL {
        // Mismatched lengths.
        assert!(is_invalid_argument(reduce(
            DType::F32,
            op,
            &mut d8,
            &a8,
            &a4
        )));
        assert!(is_invalid_argument(reduce(
            DType::F32,
            op,
            &mut d8,
            &a4,
            &a8
        )));
        assert!(is_invalid_argument(reduce(
            DType::U8,
            op,
            &mut d6,
            &a8,
            &a8
        )));
        assert!(is_invalid_argument(reduce_inplace(
            DType::I16,
            op,
            &mut d8,
            &a4
        )));
        // Not a whole number of elements.
        assert!(is_invalid_argument(reduce(
            DType::F32,
            op,
            &mut d6,
            &a6,
            &a6
        )));
        assert!(is_invalid_argument(reduce(
            DType::F64,
            op,
            &mut d6,
            &a6,
            &a6
        )));
        assert!(is_invalid_argument(reduce_inplace(
            DType::I64,
            op,
            &mut d6,
            &a6
        )));
        assert!(is_invalid_argument(finalize(DType::F32, op, &mut d6, 2)));
        // World size zero.
        assert!(is_invalid_argument(finalize(DType::F32, op, &mut d8, 0)));
        // These are fine.
        assert!(reduce(DType::I16, op, &mut d6, &a6, &a6).is_ok());
        assert!(reduce(DType::U8, op, &mut [], &[], &[]).is_ok());
        assert!(finalize(DType::F64, op, &mut d8, 1).is_ok());
    }
    let msg = match reduce(DType::F32, ReduceOp::Sum, &mut d6, &a6, &a6) {
        Err(e) => e.to_string(),
        Ok(()) => unreachable!(),
    };
    assert!(msg.contains("float32") && msg.contains('6'), "{msg}");
    let msg = match reduce(DType::F32, ReduceOp::Sum, &mut d8, &a8, &a4) {
        Err(e) => e.to_string(),
        Ok(()) => unreachable!(),
    };
    assert!(
        msg.contains("mismatch") && msg.contains('8') && msg.contains('4'),
        "{msg}"
    );
}

#[test]
fn errors_leave_output_untouched() {
    let mut dst = [7u8; 8];
    let _ = reduce(DType::I32, ReduceOp::Sum, &mut dst, &[1u8; 8], &[1u8; 4]);
    assert_eq!(dst, [7u8; 8]);
    let _ = finalize(DType::I32, ReduceOp::Avg, &mut dst, 0);
    assert_eq!(dst, [7u8; 8]);
}

// ---- finalize ----------------------------------------------------------------------

fn finalize_vals<T: Copy>(
    dtype: DType,
    op: ReduceOp,
    v: &[T],
    world: usize,
    enc: fn(T) -> Vec<u8>,
    dec: fn(&[u8]) -> T,
) -> Vec<T> {
    let mut buf: Vec<u8> = v.iter().flat_map(|&x| enc(x)).collect();
    finalize(dtype, op, &mut buf, world).unwrap();
    buf.chunks(dtype.size()).map(dec).collect()
}

macro_rules! fin {
    ($t:ty, $dtype:expr, $op:expr, $v:expr, $world:expr) => {
        finalize_vals::<$t>(
            $dtype,
            $op,
            &$v,
            $world,
            |x| x.to_le_bytes().to_vec(),
            |s| <$t>::from_le_bytes(s.try_into().unwrap()),
        )
    };
}

#[test]
fn finalize_avg_floats() {
    use ReduceOp::Avg;
    assert_eq!(
        fin!(f32, DType::F32, Avg, [3.0f32, -1.0, 0.0, 1.0], 2),
        [1.5, -0.5, 0.0, 0.5]
    );
    // True division, not multiplication by the reciprocal.
    let xs: Vec<f32> = (1..2000).map(|i| i as f32 * 0.37).collect();
    assert_eq!(
        fin!(f32, DType::F32, Avg, xs, 3),
        xs.iter().map(|x| x / 3.0).collect::<Vec<_>>()
    );
    let ys: Vec<f64> = (1..2000).map(|i| i as f64 * 0.37).collect();
    assert_eq!(
        fin!(f64, DType::F64, Avg, ys, 7),
        ys.iter().map(|x| x / 7.0).collect::<Vec<_>>()
    );
    let r = fin!(f64, DType::F64, Avg, [f64::INFINITY, f64::NAN, -0.0], 5);
    assert!(r[0] == f64::INFINITY && r[1].is_nan() && r[2] == 0.0 && r[2].is_sign_negative());
    // f16/bf16: divide in f32, round once.
    let hs: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
    for world in [2usize, 3, 7, 1000] {
        let got = fin!(f16, DType::F16, Avg, hs, world);
        for (h, g) in hs.iter().zip(&got) {
            let want = if h.is_nan() {
                f16::from_bits(0x7E00)
            } else {
                f16::from_f32(h.to_f32() / world as f32)
            };
            assert_eq!(g.to_bits(), want.to_bits(), "f16 {h} / {world}");
        }
        let bs: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        let got = fin!(bf16, DType::BF16, Avg, bs, world);
        for (h, g) in bs.iter().zip(&got) {
            let want = if h.is_nan() {
                bf16::from_bits(0x7FC0)
            } else {
                bf16::from_f32(h.to_f32() / world as f32)
            };
            assert_eq!(g.to_bits(), want.to_bits(), "bf16 {h} / {world}");
        }
    }
}

#[test]
fn finalize_avg_integers_truncate_toward_zero() {
    use ReduceOp::Avg;
    assert_eq!(
        fin!(i32, DType::I32, Avg, [7i32, -7, 6, -6, 1, -1, 0], 2),
        [3, -3, 3, -3, 0, 0, 0]
    );
    assert_eq!(
        fin!(i64, DType::I64, Avg, [i64::MIN, i64::MAX, -10], 3),
        [i64::MIN / 3, i64::MAX / 3, -3]
    );
    assert_eq!(fin!(i64, DType::I64, Avg, [i64::MIN], 1), [i64::MIN]);
    assert_eq!(
        fin!(i8, DType::I8, Avg, [-128i8, 127, -5], 2),
        [-64, 63, -2]
    );
    assert_eq!(fin!(u8, DType::U8, Avg, [255u8, 5], 2), [127, 2]);
    assert_eq!(fin!(u32, DType::U32, Avg, [u32::MAX], 4), [u32::MAX / 4]);
    assert_eq!(
        fin!(u64, DType::U64, Avg, [u64::MAX, 10], 3),
        [u64::MAX / 3, 3]
    );
    assert_eq!(
        fin!(i16, DType::I16, Avg, [-32768i16, 32767], 3),
        [-10922, 10922]
    );
    // World larger than the element type's range.
    assert_eq!(
        fin!(i8, DType::I8, Avg, [-128i8, 127, -127], 128),
        [-1, 0, 0]
    );
    assert_eq!(fin!(i8, DType::I8, Avg, [-128i8, 127], 200), [0, 0]);
    assert_eq!(fin!(u8, DType::U8, Avg, [255u8, 0], 256), [0, 0]);
    assert_eq!(fin!(u8, DType::U8, Avg, [255u8], 255), [1]);
    assert_eq!(fin!(i16, DType::I16, Avg, [-32768i16], 32768), [-1]);
    assert_eq!(fin!(i32, DType::I32, Avg, [i32::MIN], usize::MAX), [0]);
    // A wrapped sum is averaged as wrapped: 100 + 100 in int8 is -56, / 2 = -28.
    let mut acc = 100i8.to_le_bytes().to_vec();
    reduce_inplace(DType::I8, Avg, &mut acc, &100i8.to_le_bytes()).unwrap();
    finalize(DType::I8, Avg, &mut acc, 2).unwrap();
    assert_eq!(acc, (-28i8).to_le_bytes());
}

#[test]
fn finalize_other_ops_and_world_one_are_noops() {
    let mut rng = Rng(4);
    for dtype in DType::ALL {
        let data = sample(dtype, 300, &mut rng);
        for op in ReduceOp::ALL {
            for world in [1usize, 2, 5] {
                let mut buf = data.clone();
                finalize(dtype, op, &mut buf, world).unwrap();
                if op != ReduceOp::Avg || world == 1 {
                    assert_eq!(buf, data, "{} {} world={world}", dtype.name(), op.name());
                }
            }
        }
    }
}

#[test]
fn ring_style_sum_then_average() {
    // Four "ranks" reduced in ring order then averaged; f32 exact small integers.
    let ranks: Vec<Vec<f32>> = (0..4)
        .map(|r| (0..5000).map(|i| (i % 17 + r) as f32).collect())
        .collect();
    let enc = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let mut acc = enc(&ranks[0]);
    for r in &ranks[1..] {
        reduce_inplace(DType::F32, ReduceOp::Avg, &mut acc, &enc(r)).unwrap();
    }
    finalize(DType::F32, ReduceOp::Avg, &mut acc, 4).unwrap();
    let got: Vec<f32> = acc
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let want: Vec<f32> = (0..5000).map(|i| (i % 17) as f32 + 1.5).collect();
    assert_eq!(got, want);
}

// ---- property tests ----------------------------------------------------------------

fn dtype_strategy() -> impl Strategy<Value = DType> {
    proptest::sample::select(DType::ALL.to_vec())
}

fn op_strategy() -> impl Strategy<Value = ReduceOp> {
    proptest::sample::select(ReduceOp::ALL.to_vec())
}

/// (dtype, a, b) with a and b of equal length in whole elements; bytes are arbitrary,
/// so floats include NaNs, infinities and subnormals.
fn operands() -> impl Strategy<Value = (DType, Vec<u8>, Vec<u8>)> {
    (dtype_strategy(), 0usize..3000).prop_flat_map(|(d, n)| {
        let len = n * d.size();
        (
            Just(d),
            proptest::collection::vec(any::<u8>(), len),
            proptest::collection::vec(any::<u8>(), len),
        )
    })
}

/// Bytes of an element as a NaN-agnostic comparison key: NaN payloads created by
/// arithmetic are architecture-specific, so commutativity is checked up to "is NaN".
fn canon(dtype: DType, bytes: &[u8]) -> Vec<Option<Vec<u8>>> {
    bytes
        .chunks(dtype.size())
        .map(|c| {
            let nan = match dtype {
                DType::F16 => f16::from_le_bytes(c.try_into().unwrap()).is_nan(),
                DType::BF16 => bf16::from_le_bytes(c.try_into().unwrap()).is_nan(),
                DType::F32 => f32::from_le_bytes(c.try_into().unwrap()).is_nan(),
                DType::F64 => f64::from_le_bytes(c.try_into().unwrap()).is_nan(),
                _ => false,
            };
            if nan {
                None
            } else {
                Some(c.to_vec())
            }
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

    #[test]
    fn prop_matches_reference_at_any_offset(
        (dtype, a, b) in operands(),
        op in op_strategy(),
        offs in (0usize..8, 0usize..8, 0usize..8),
    ) {
        let want = reference(dtype, op, &a, &b);
        let (got, got_inplace) = run_both(dtype, op, &a, &b, offs);
        prop_assert_eq!(&got, &want);
        prop_assert_eq!(&got_inplace, &want);
    }

    #[test]
    fn prop_commutative((dtype, a, b) in operands(), op in op_strategy()) {
        let mut ab = vec![0u8; a.len()];
        let mut ba = vec![0u8; a.len()];
        reduce(dtype, op, &mut ab, &a, &b).unwrap();
        reduce(dtype, op, &mut ba, &b, &a).unwrap();
        prop_assert_eq!(canon(dtype, &ab), canon(dtype, &ba));
    }

    #[test]
    fn prop_f32_roundtrip(xs in proptest::collection::vec(-1e6f32..1e6, 0..2000), world in 1usize..64) {
        // Summing `world` copies of x then averaging: equals (x * world) / world computed
        // the same way in f32 with sequential adds.
        let bytes: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
        let mut acc = bytes.clone();
        for _ in 1..world {
            reduce_inplace(DType::F32, ReduceOp::Avg, &mut acc, &bytes).unwrap();
        }
        finalize(DType::F32, ReduceOp::Avg, &mut acc, world).unwrap();
        for (i, c) in acc.chunks(4).enumerate() {
            let mut s = xs[i];
            for _ in 1..world { s += xs[i]; }
            let want = s / world as f32;
            prop_assert_eq!(f32::from_le_bytes(c.try_into().unwrap()).to_bits(), want.to_bits());
        }
    }

    #[test]
    fn prop_integer_avg_of_identical_values_is_identity(
        xs in proptest::collection::vec(-1000i32..1000, 0..500),
        world in 1usize..50,
    ) {
        // No overflow in this range, so the average of `world` copies is exact.
        let bytes: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
        let mut acc = bytes.clone();
        for _ in 1..world {
            reduce_inplace(DType::I32, ReduceOp::Avg, &mut acc, &bytes).unwrap();
        }
        finalize(DType::I32, ReduceOp::Avg, &mut acc, world).unwrap();
        prop_assert_eq!(acc, bytes);
    }

    #[test]
    fn prop_max_min_idempotent_and_bounded((dtype, a, b) in operands()) {
        // max(a, a) == a and min(a, a) == a, bit for bit except that 16-bit signalling
        // NaNs come back quieted.
        let sixteen = matches!(dtype, DType::F16 | DType::BF16);
        let mut out = vec![0u8; a.len()];
        for op in [ReduceOp::Max, ReduceOp::Min] {
            reduce(dtype, op, &mut out, &a, &a).unwrap();
            if sixteen {
                prop_assert_eq!(canon(dtype, &out), canon(dtype, &a));
            } else {
                prop_assert_eq!(&out, &a);
            }
        }
        // max(a, b) and min(a, b) are elementwise one of a or b: no new values.
        for op in [ReduceOp::Max, ReduceOp::Min] {
            reduce(dtype, op, &mut out, &a, &b).unwrap();
            let (o, x, y) = (canon(dtype, &out), canon(dtype, &a), canon(dtype, &b));
            for i in 0..o.len() {
                prop_assert!(o[i] == x[i] || o[i] == y[i]);
            }
        }
    }

    #[test]
    fn prop_half_sum_matches_f32_rounding(
        xs in proptest::collection::vec(any::<u16>(), 0..3000),
        ys in proptest::collection::vec(any::<u16>(), 0..3000),
        off in 0usize..4,
    ) {
        let n = xs.len().min(ys.len());
        let a: Vec<u8> = xs[..n].iter().flat_map(|x| x.to_le_bytes()).collect();
        let b: Vec<u8> = ys[..n].iter().flat_map(|x| x.to_le_bytes()).collect();
        let ba = Buf::new(&a, off);
        let bb = Buf::new(&b, 0);
        let mut out = Buf::zeroed(a.len(), off);
        reduce(DType::BF16, ReduceOp::Sum, out.bytes_mut(), ba.bytes(), bb.bytes()).unwrap();
        for (i, c) in out.bytes().chunks(2).enumerate() {
            let sum = bf16::from_bits(xs[i]).to_f32() + bf16::from_bits(ys[i]).to_f32();
            let want = if sum.is_nan() { bf16::from_bits(0x7FC0) } else { bf16::from_f32(sum) };
            prop_assert_eq!(u16::from_le_bytes([c[0], c[1]]), want.to_bits());
        }
        reduce(DType::F16, ReduceOp::Sum, out.bytes_mut(), ba.bytes(), bb.bytes()).unwrap();
        for (i, c) in out.bytes().chunks(2).enumerate() {
            let sum = f16::from_bits(xs[i]).to_f32() + f16::from_bits(ys[i]).to_f32();
            let want = if sum.is_nan() { f16::from_bits(0x7E00) } else { f16::from_f32(sum) };
            prop_assert_eq!(u16::from_le_bytes([c[0], c[1]]), want.to_bits());
        }
    }
}
