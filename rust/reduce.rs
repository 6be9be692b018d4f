//! Element-wise reduction kernels for the ring all-reduce.
//!
//! Every buffer handed to this module is a raw little-endian byte slice holding a whole
//! number of elements of one [`DType`]. The ring code calls [`reduce`] or
//! [`reduce_inplace`] once per received chunk and, for [`ReduceOp::Avg`], [`finalize`]
//! once on every fully reduced chunk.
//!
//! # Semantics (these are the library's documented semantics)
//!
//! * **Integers** (`int8` .. `uint64`): `Sum` and `Prod` wrap around in two's complement,
//!   exactly like numpy's fixed-width arithmetic; `Max` and `Min` are exact.
//!   `Avg` accumulates the wrapped sum and [`finalize`] divides it by the world size,
//!   truncating toward zero (so `-7 / 2 == -3`). The average of values whose sum
//!   overflowed is therefore the average of the wrapped sum, as in numpy.
//! * **`float32` / `float64`**: IEEE-754 arithmetic in the element's own precision, round
//!   to nearest even. Plain adds and multiplies only (never a fused multiply-add), so the
//!   result does not depend on the CPU's instruction set.
//! * **`float16` / `bfloat16`**: each call widens both operands to `float32` (exact),
//!   computes in `float32`, and rounds the result back to 16 bits with round to nearest
//!   even. The rounding happens once per call, i.e. once per hop of the ring.
//! * **`Avg`** is computed as `Sum` by [`reduce`] / [`reduce_inplace`]; the division by the
//!   world size happens exactly once, in [`finalize`]. For floats that is a true division
//!   `x / world` (not a multiplication by `1 / world`), done in `float64` for `float64`
//!   and in `float32` for the other float types (16-bit results are rounded back to
//!   nearest even). `world` is converted to the float type first; that conversion is
//!   exact for every world size below 2^24.
//! * **`Max` / `Min` on floats** propagate NaN like `np.maximum` / `np.minimum`: if
//!   either operand is NaN the result is NaN (the first operand's NaN when both are).
//!   Signed zeros are ordered `-0.0 < +0.0`, so `max(-0.0, +0.0) == +0.0` and
//!   `min(-0.0, +0.0) == -0.0` whichever operand comes first. With that rule `Max` and
//!   `Min` are commutative for all non-NaN inputs, and the result of a ring reduction
//!   does not depend on the order in which the peers' chunks are combined.
//!
//! # NaN results
//!
//! * `Sum`, `Prod` and the `Avg` division return the *canonical* quiet NaN whenever the
//!   result is NaN: positive sign, only the quiet bit set (`0x7e00` float16, `0x7fc0`
//!   bfloat16, `0x7fc00000` float32, `0x7ff8000000000000` float64). Which NaN the
//!   hardware would produce differs between CPU architectures and even with the operand
//!   order the compiler happens to pick, so it is normalised away.
//! * `Max` and `Min` return the NaN operand itself (the first one if both are NaN), bit
//!   for bit for float32/float64. For float16/bfloat16 the round trip through float32
//!   quiets a signalling NaN (sets its quiet bit) and otherwise keeps its payload.
//!
//! # Determinism
//!
//! The kernels are pure functions of their inputs: no threads, no reassociation, no
//! fused multiply-add, NaNs normalised as above. The same inputs give the same output
//! bits on every machine and on every code path (aligned or not, [`reduce`] or
//! [`reduce_inplace`]). The 16-bit kernels choose at run time between a portable
//! implementation and one for x86-64 CPUs with AVX2 + F16C; both produce identical bits
//! (the tests check every 16-bit pattern through each). This assumes the default
//! floating-point environment (round to nearest, subnormals not flushed), which is what
//! Rust threads run with unless foreign code changes it.
//!
//! # Alignment and endianness
//!
//! Inputs need not be aligned. When every slice is aligned for the element type (the
//! common case: buffers come from the allocator or from numpy/torch storage) the
//! kernels run directly on typed slices in one auto-vectorised loop; otherwise they
//! copy short steps through aligned stack buffers, which costs little next to memory
//! traffic. The 16-bit kernels widen blocks into `float32` stack buffers with `half`'s
//! slice conversions, or, on AVX2 + F16C CPUs, stream all three buffers eight elements
//! at a time with unaligned vector loads. The wire format is little-endian; on a
//! big-endian host the staged path swaps bytes.

use std::mem::size_of;
use std::ops::Range;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::error::{CoreError, CoreResult};
use crate::pod::{store, view, view_mut, Pod};

// ---------------------------------------------------------------------------------------
// Public enums
// ---------------------------------------------------------------------------------------

/// Element type of a reduction buffer. The discriminants are part of the wire protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    F16 = 0,
    BF16 = 1,
    F32 = 2,
    F64 = 3,
    I8 = 4,
    I16 = 5,
    I32 = 6,
    I64 = 7,
    U8 = 8,
    U16 = 9,
    U32 = 10,
    U64 = 11,
}

impl DType {
    /// Every dtype, in discriminant order.
    pub const ALL: [DType; 12] = [
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::U16,
        DType::U32,
        DType::U64,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 => 1,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    /// The dtype with wire code `v`, if there is one.
    pub fn from_u8(v: u8) -> Option<DType> {
        DType::ALL.get(usize::from(v)).copied()
    }

    /// Parse a numpy-style name (`"float16"`, `"bfloat16"`, `"float32"`, ..., `"uint64"`).
    /// ASCII case is ignored.
    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL
            .iter()
            .copied()
            .find(|d| d.name().eq_ignore_ascii_case(name))
    }

    /// The numpy-style name, e.g. `"bfloat16"`.
    pub fn name(self) -> &'static str {
        match self {
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
            DType::U16 => "uint16",
            DType::U32 => "uint32",
            DType::U64 => "uint64",
        }
    }

    /// True for the four floating-point types.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }
}

/// Reduction operator. The discriminants are part of the wire protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    Sum = 0,
    Avg = 1,
    Prod = 2,
    Max = 3,
    Min = 4,
}

impl ReduceOp {
    /// Every operator, in discriminant order.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Avg,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
    ];

    /// The operator with wire code `v`, if there is one.
    pub fn from_u8(v: u8) -> Option<ReduceOp> {
        ReduceOp::ALL.get(usize::from(v)).copied()
    }

    /// Parse `"sum"`, `"avg"`, `"prod"`, `"max"` or `"min"`, ignoring ASCII case.
    pub fn from_name(name: &str) -> Option<ReduceOp> {
        ReduceOp::ALL
            .iter()
            .copied()
            .find(|o| o.name().eq_ignore_ascii_case(name))
    }

    /// The lower-case name, e.g. `"avg"`.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Prod => "prod",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        }
    }
}

// ---------------------------------------------------------------------------------------
// Public entry points
// ---------------------------------------------------------------------------------------

/// `dst[i] = a[i] (op) b[i]` for every element.
///
/// All three slices are little-endian element bytes of the same length, a multiple of
/// `dtype.size()`; they need not be aligned. For [`ReduceOp::Avg`] this computes the sum;
/// call [`finalize`] once on the fully reduced data.
pub fn reduce(dtype: DType, op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) -> CoreResult<()> {
    check_len("reduce", dtype, "dst", dst.len())?;
    check_same("reduce", "dst", dst.len(), "a", a.len())?;
    check_same("reduce", "dst", dst.len(), "b", b.len())?;
    dispatch(dtype, op, dst, Some(a), b);
    Ok(())
}

/// `acc[i] = acc[i] (op) x[i]` for every element; same rules as [`reduce`].
pub fn reduce_inplace(dtype: DType, op: ReduceOp, acc: &mut [u8], x: &[u8]) -> CoreResult<()> {
    check_len("reduce_inplace", dtype, "acc", acc.len())?;
    check_same("reduce_inplace", "acc", acc.len(), "x", x.len())?;
    dispatch(dtype, op, acc, None, x);
    Ok(())
}

/// Finish a reduction on a fully reduced buffer. For [`ReduceOp::Avg`] every element is
/// divided by `world` (see the module docs for the exact rounding); for the other
/// operators, and for `world == 1`, the data is left untouched. The length and `world` are validated for every
/// operator: `world == 0` or a length that is not a whole number of elements is
/// [`CoreError::InvalidArgument`].
pub fn finalize(dtype: DType, op: ReduceOp, buf: &mut [u8], world: usize) -> CoreResult<()> {
    check_len("finalize", dtype, "buf", buf.len())?;
    if world == 0 {
        return Err(CoreError::InvalidArgument(
            "finalize: world size must be at least 1".to_string(),
        ));
    }
    if op != ReduceOp::Avg || world == 1 {
        return Ok(());
    }
    match dtype {
        DType::F16 => half_divide::<f16>(buf, world),
        DType::BF16 => half_divide::<bf16>(buf, world),
        DType::F32 => map_inplace::<f32>(buf, |s| f32::divide(s, world)),
        DType::F64 => map_inplace::<f64>(buf, |s| f64::divide(s, world)),
        DType::I8 => map_inplace::<i8>(buf, |s| i8::divide(s, world)),
        DType::I16 => map_inplace::<i16>(buf, |s| i16::divide(s, world)),
        DType::I32 => map_inplace::<i32>(buf, |s| i32::divide(s, world)),
        DType::I64 => map_inplace::<i64>(buf, |s| i64::divide(s, world)),
        DType::U8 => map_inplace::<u8>(buf, |s| u8::divide(s, world)),
        DType::U16 => map_inplace::<u16>(buf, |s| u16::divide(s, world)),
        DType::U32 => map_inplace::<u32>(buf, |s| u32::divide(s, world)),
        DType::U64 => map_inplace::<u64>(buf, |s| u64::divide(s, world)),
    }
    Ok(())
}

fn check_len(func: &str, dtype: DType, what: &str, len: usize) -> CoreResult<()> {
    if !len.is_multiple_of(dtype.size()) {
        return Err(CoreError::InvalidArgument(format!(
            "{func}: {what} is {len} bytes, which is not a whole number of {} elements \
             ({} bytes each)",
            dtype.name(),
            dtype.size()
        )));
    }
    Ok(())
}

fn check_same(func: &str, n1: &str, l1: usize, n2: &str, l2: usize) -> CoreResult<()> {
    if l1 != l2 {
        return Err(CoreError::InvalidArgument(format!(
            "{func}: length mismatch, {n1} is {l1} bytes but {n2} is {l2} bytes"
        )));
    }
    Ok(())
}

/// One `match` per call picks a monomorphised kernel; the loops themselves never branch
/// on dtype or operator. `a == None` means "the first operand is `out` itself".
fn dispatch(dtype: DType, op: ReduceOp, out: &mut [u8], a: Option<&[u8]>, b: &[u8]) {
    macro_rules! by_op {
        ($kernel:ident, $t:ty) => {
            match op {
                ReduceOp::Sum | ReduceOp::Avg => $kernel::<$t, Sum>(out, a, b),
                ReduceOp::Prod => $kernel::<$t, Prod>(out, a, b),
                ReduceOp::Max => $kernel::<$t, Max>(out, a, b),
                ReduceOp::Min => $kernel::<$t, Min>(out, a, b),
            }
        };
    }
    match dtype {
        DType::F16 => by_op!(half_kernel, f16),
        DType::BF16 => by_op!(half_kernel, bf16),
        DType::F32 => by_op!(kernel, f32),
        DType::F64 => by_op!(kernel, f64),
        DType::I8 => by_op!(kernel, i8),
        DType::I16 => by_op!(kernel, i16),
        DType::I32 => by_op!(kernel, i32),
        DType::I64 => by_op!(kernel, i64),
        DType::U8 => by_op!(kernel, u8),
        DType::U16 => by_op!(kernel, u16),
        DType::U32 => by_op!(kernel, u32),
        DType::U64 => by_op!(kernel, u64),
    }
}

// ---------------------------------------------------------------------------------------
// Staging of unaligned data (the `Pod` views themselves live in `crate::pod`)
// ---------------------------------------------------------------------------------------

// Block sizes of the staged paths. Blocks are short on purpose: the reads of both
// inputs and the write of the output stay interleaved, so the memory system sees three
// concurrent streams as in the aligned loop (4 KiB blocks measured 25-40% slower at
// 64 MiB), and scratch buffers stay far less than 4 KiB apart, avoiding the "4K
// aliasing" stalls two buffers exactly 4 KiB apart cause (loads from one wrongly wait
// for stores to the other because only the low 12 address bits are compared).

/// Capacity of a staging buffer: one block of the portable 16-bit kernel.
const BLOCK_BYTES: usize = 512;

/// Bytes per step of the staged (unaligned) path for ordinary types.
const STAGED_STEP: usize = 256;

/// An aligned stack buffer used to stage unaligned (or big-endian) data.
type Stage = crate::pod::Stage<BLOCK_BYTES>;

/// Byte ranges covering `total` bytes in steps of `step` (the last one may be short).
#[inline(always)]
fn blocks(total: usize, step: usize) -> impl Iterator<Item = Range<usize>> {
    (0..total)
        .step_by(step)
        .map(move |s| s..(s + step).min(total))
}

// ---------------------------------------------------------------------------------------
// Operators
// ---------------------------------------------------------------------------------------

struct Sum;
struct Prod;
struct Max;
struct Min;

/// A binary operator on `T`. The slice loops are written so LLVM vectorises them once
/// `apply` is inlined; `apply` itself is branch-free (selects only).
trait Op<T: Copy> {
    /// The operator this implements (`Sum` also serves `Avg`).
    const OP: ReduceOp;

    fn apply(a: T, b: T) -> T;

    #[inline(always)]
    fn apply_inplace(acc: &mut [T], x: &[T]) {
        let x = &x[..acc.len()];
        for (a, &b) in acc.iter_mut().zip(x) {
            *a = Self::apply(*a, b);
        }
    }

    #[inline(always)]
    fn apply_into(dst: &mut [T], a: &[T], b: &[T]) {
        let n = dst.len();
        let (a, b) = (&a[..n], &b[..n]);
        for (d, (&x, &y)) in dst.iter_mut().zip(a.iter().zip(b)) {
            *d = Self::apply(x, y);
        }
    }
}

macro_rules! int_ops {
    ($($t:ty),*) => {$(
        impl Op<$t> for Sum {
            const OP: ReduceOp = ReduceOp::Sum;
            #[inline(always)]
            fn apply(a: $t, b: $t) -> $t { a.wrapping_add(b) }
        }
        impl Op<$t> for Prod {
            const OP: ReduceOp = ReduceOp::Prod;
            #[inline(always)]
            fn apply(a: $t, b: $t) -> $t { a.wrapping_mul(b) }
        }
        impl Op<$t> for Max {
            const OP: ReduceOp = ReduceOp::Max;
            #[inline(always)]
            fn apply(a: $t, b: $t) -> $t { if a > b { a } else { b } }
        }
        impl Op<$t> for Min {
            const OP: ReduceOp = ReduceOp::Min;
            #[inline(always)]
            fn apply(a: $t, b: $t) -> $t { if a < b { a } else { b } }
        }
    )*};
}
int_ops!(i8, i16, i32, i64, u8, u16, u32, u64);

macro_rules! float_ops {
    ($($t:ty => $qnan:expr),*) => {$(
        impl Op<$t> for Sum {
            const OP: ReduceOp = ReduceOp::Sum;
            #[inline(always)]
            fn apply(a: $t, b: $t) -> $t { canonical_nan(a + b, $qnan) }
        }
        impl Op<$t> for Prod {
            const OP: ReduceOp = ReduceOp::Prod;
            #[inline(always)]
            fn apply(a: $t, b: $t) -> $t { canonical_nan(a * b, $qnan) }
        }
        impl Op<$t> for Max {
            const OP: ReduceOp = ReduceOp::Max;
            /// NaN-propagating maximum with `-0.0 < +0.0`.
            #[inline(always)]
            fn apply(a: $t, b: $t) -> $t {
                // `a` wins when it is greater or NaN; a NaN `b` then wins via `else`.
                let m = if (a > b) | a.is_nan() { a } else { b };
                // Equal values have equal bits except for +0/-0; AND keeps +0. (This select
                // comes last on purpose: ending on "keep `a`" lets LLVM turn the in-place
                // loop into masked stores, which are very slow on AMD CPUs.)
                if a == b { <$t>::from_bits(a.to_bits() & b.to_bits()) } else { m }
            }
        }
        impl Op<$t> for Min {
            const OP: ReduceOp = ReduceOp::Min;
            /// NaN-propagating minimum with `-0.0 < +0.0`.
            #[inline(always)]
            fn apply(a: $t, b: $t) -> $t {
                let m = if (a < b) | a.is_nan() { a } else { b };
                // Equal values have equal bits except for +0/-0; OR keeps -0.
                if a == b { <$t>::from_bits(a.to_bits() | b.to_bits()) } else { m }
            }
        }
    )*};
}

/// Replace any NaN by the canonical quiet NaN `qnan`. Which NaN an add or multiply
/// produces depends on the CPU (x86 and ARM differ) and even on the operand order the
/// compiler picked, so arithmetic results are normalised to keep every bit deterministic.
#[inline(always)]
fn canonical_nan<T: PartialEq + Copy>(r: T, qnan: T) -> T {
    // `r != r` is the NaN test, kept generic so it stays a vector compare + select.
    #[allow(clippy::eq_op)]
    let nan = r != r;
    if nan {
        qnan
    } else {
        r
    }
}

/// The canonical quiet NaNs: positive sign, only the quiet bit set.
const F32_QNAN: u32 = 0x7FC0_0000;
const F64_QNAN: u64 = 0x7FF8_0000_0000_0000;
float_ops!(f32 => f32::from_bits(F32_QNAN), f64 => f64::from_bits(F64_QNAN));

// ---------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------

/// Kernel for types computed in their own precision. `a == None` means `out` is also the
/// first operand.
fn kernel<T: Pod, O: Op<T>>(out: &mut [u8], a: Option<&[u8]>, b: &[u8]) {
    // Fast path: everything aligned, one pass over typed slices.
    if let Some(tb) = view::<T>(b) {
        match a {
            Some(a) => {
                if let (Some(ta), Some(tout)) = (view::<T>(a), view_mut::<T>(out)) {
                    O::apply_into(tout, ta, tb);
                    return;
                }
            }
            None => {
                if let Some(tout) = view_mut::<T>(out) {
                    O::apply_inplace(tout, tb);
                    return;
                }
            }
        }
    }
    // Staged path: copy blocks into aligned stack buffers, reduce there, copy out.
    let mut sa = Stage::new();
    let mut sb = Stage::new();
    let step = STAGED_STEP / size_of::<T>() * size_of::<T>();
    for r in blocks(out.len(), step) {
        let ta = sa.load::<T>(match a {
            Some(a) => &a[r.clone()],
            None => &out[r.clone()],
        });
        let tb = sb.load::<T>(&b[r.clone()]);
        O::apply_inplace(ta, tb);
        store(ta, &mut out[r]);
    }
}

/// The two 16-bit float types, converted to and from `f32` a block at a time.
trait Half: Pod {
    /// bfloat16 (true) or IEEE float16 (false).
    const IS_BF16: bool;
    fn widen(src: &[Self], dst: &mut [f32]);
    fn narrow(src: &[f32], dst: &mut [Self]);
}

impl Half for f16 {
    const IS_BF16: bool = false;
    #[inline(always)]
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst)
    }
    #[inline(always)]
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src)
    }
}

impl Half for bf16 {
    const IS_BF16: bool = true;
    #[inline(always)]
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst)
    }
    #[inline(always)]
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src)
    }
}

/// Elements per block of the portable 16-bit kernel: the staged halves fill one [`Stage`].
const HALF_BLOCK: usize = BLOCK_BYTES / 2;

/// Widen little-endian 16-bit elements in `src` into `dst`.
#[inline(always)]
fn widen_bytes<H: Half>(src: &[u8], dst: &mut [f32], stage: &mut Stage) {
    let h: &[H] = match view::<H>(src) {
        Some(h) => h,
        None => stage.load::<H>(src),
    };
    H::widen(h, dst);
}

/// Round `src` to 16 bits and write it as little-endian bytes to `dst`.
#[inline(always)]
fn narrow_bytes<H: Half>(src: &[f32], dst: &mut [u8], stage: &mut Stage) {
    if let Some(h) = view_mut::<H>(dst) {
        H::narrow(src, h);
    } else {
        let h = stage.scratch::<H>(src.len());
        H::narrow(src, h);
        store(h, dst);
    }
}

/// Kernel for f16 / bf16. On x86-64 CPUs with AVX2 and F16C (checked at run time; `std`
/// caches the answer) the [`x86`] kernel runs instead of the portable one; it gives the
/// same bits, which the tests check for every 16-bit pattern.
fn half_kernel<H: Half, O: Op<f32>>(out: &mut [u8], a: Option<&[u8]>, b: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    if x86::available() {
        // SAFETY: the CPU supports the features the function is compiled for.
        unsafe { x86::half_kernel::<H, O>(out, a, b) };
        return;
    }
    half_kernel_portable::<H, O>(out, a, b)
}

/// Portable f16 / bf16 kernel: widen a block of each operand to f32 with `half`'s slice
/// conversions, reduce in f32, round the block back to 16 bits.
fn half_kernel_portable<H: Half, O: Op<f32>>(out: &mut [u8], a: Option<&[u8]>, b: &[u8]) {
    let mut fa = [0f32; HALF_BLOCK];
    let mut fb = [0f32; HALF_BLOCK];
    let mut stage = Stage::new();
    for r in blocks(out.len(), HALF_BLOCK * 2) {
        let n = r.len() / 2;
        let (fa, fb) = (&mut fa[..n], &mut fb[..n]);
        let src_a = match a {
            Some(a) => &a[r.clone()],
            None => &out[r.clone()],
        };
        widen_bytes::<H>(src_a, fa, &mut stage);
        widen_bytes::<H>(&b[r.clone()], fb, &mut stage);
        O::apply_inplace(fa, fb);
        narrow_bytes::<H>(fa, &mut out[r], &mut stage);
    }
}

/// The f16 / bf16 kernel for x86-64 CPUs with AVX2 + F16C: one pass over all three buffers,
/// eight elements per step, widening (F16C `vcvtph2ps`, or a shift for bfloat16), applying
/// the operator in f32 and rounding back (F16C `vcvtps2ph`, or integer round-to-nearest-
/// even for bfloat16) without leaving registers. Loads and stores are unaligned, so
/// unaligned input needs no staging (x86 is little-endian). The results are bit-identical
/// to `half`'s conversions and to the scalar operators.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Half, Op, ReduceOp};

    pub(super) fn available() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")
    }

    /// Eight 16-bit values at `src` (any alignment) widened to f32. Exact.
    ///
    /// # Safety
    /// 16 bytes must be readable at `src`.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn widen8<H: Half>(src: *const u8) -> __m256 {
        let h = unsafe { _mm_loadu_si128(src.cast()) };
        if H::IS_BF16 {
            // bfloat16 is the top half of an f32.
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        } else {
            _mm256_cvtph_ps(h)
        }
    }

    /// Eight f32 rounded to nearest even 16-bit values, stored at `dst` (any alignment).
    /// Bit-identical to `half`'s `from_f32` for every input, NaNs included.
    ///
    /// # Safety
    /// 16 bytes must be writable at `dst`.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn narrow8<H: Half>(v: __m256, dst: *mut u8) {
        let h = if H::IS_BF16 {
            let bits = _mm256_castps_si256(v);
            let hi = _mm256_srli_epi32::<16>(bits);
            // Round to nearest even: add 0x7fff plus the lowest kept bit, then truncate.
            let lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
            let bias = _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb);
            let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(bits, bias));
            // NaN: keep the top mantissa bits and set the quiet bit (never rounds to inf).
            let quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
            let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
            let r = _mm256_blendv_epi8(rounded, quiet, nan);
            // 32-bit lanes hold values <= 0xffff: pack to 16 bits, then gather the two
            // 64-bit halves that hold lanes 0..4 and 4..8 into the low 128 bits.
            let packed = _mm256_packus_epi32(r, r);
            _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b00_00_10_00>(packed))
        } else {
            // Rounding comes from the immediate (nearest even), not from MXCSR.
            _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v)
        };
        unsafe { _mm_storeu_si128(dst.cast(), h) }
    }

    /// One step of eight elements: `o[..16] = x[..16] (op) y[..16]` as 16-bit floats.
    /// `x` may equal `o` (in-place); it is read completely before `o` is written.
    ///
    /// # Safety
    /// 16 bytes must be readable at `x` and `y` and writable at `o`.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn step8<H: Half, O: Op<f32>>(x: *const u8, y: *const u8, o: *mut u8) {
        let r = apply8::<O>(unsafe { widen8::<H>(x) }, unsafe { widen8::<H>(y) });
        unsafe { narrow8::<H>(r, o) }
    }

    /// `O::apply` on eight lanes, written out with intrinsics (LLVM's own vectorisation of
    /// the scalar code shuffles its compare masks around needlessly). Must agree with the
    /// scalar definitions bit for bit; the tests compare both against the reference.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    fn apply8<O: Op<f32>>(a: __m256, b: __m256) -> __m256 {
        match O::OP {
            ReduceOp::Sum | ReduceOp::Avg => canonical8(_mm256_add_ps(a, b)),
            ReduceOp::Prod => canonical8(_mm256_mul_ps(a, b)),
            ReduceOp::Max => {
                // `a` if a > b or a is NaN, else `b`; equal values: AND of the bits.
                let a_nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(a, a);
                let a_wins = _mm256_or_ps(_mm256_cmp_ps::<_CMP_GT_OQ>(a, b), a_nan);
                let m = _mm256_blendv_ps(b, a, a_wins);
                let eq = _mm256_cmp_ps::<_CMP_EQ_OQ>(a, b);
                _mm256_blendv_ps(m, _mm256_and_ps(a, b), eq)
            }
            ReduceOp::Min => {
                // `a` if a < b or a is NaN, else `b`; equal values: OR of the bits.
                let a_nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(a, a);
                let a_wins = _mm256_or_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(a, b), a_nan);
                let m = _mm256_blendv_ps(b, a, a_wins);
                let eq = _mm256_cmp_ps::<_CMP_EQ_OQ>(a, b);
                _mm256_blendv_ps(m, _mm256_or_ps(a, b), eq)
            }
        }
    }

    /// NaN lanes replaced by the canonical quiet NaN, as `canonical_nan` does.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    fn canonical8(r: __m256) -> __m256 {
        let qnan = _mm256_castsi256_ps(_mm256_set1_epi32(super::F32_QNAN as i32));
        _mm256_blendv_ps(r, qnan, _mm256_cmp_ps::<_CMP_UNORD_Q>(r, r))
    }

    /// See the module docs. Callers must check [`available`] first, and pass buffers of
    /// equal, even length.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) fn half_kernel<H: Half, O: Op<f32>>(out: &mut [u8], a: Option<&[u8]>, b: &[u8]) {
        let len = out.len();
        assert!(b.len() == len && a.is_none_or(|a| a.len() == len) && len.is_multiple_of(2));
        // One pass, eight elements at a time, streaming all three buffers together.
        let whole = len / 16 * 16;
        let o = out.as_mut_ptr();
        let x = match a {
            Some(a) => a.as_ptr(),
            None => o.cast_const(),
        };
        let y = b.as_ptr();
        for i in (0..whole).step_by(16) {
            // SAFETY: `i + 16 <= len` for all three buffers.
            unsafe { step8::<H, O>(x.add(i), y.add(i), o.add(i)) };
        }
        if whole < len {
            let rest = len - whole;
            let (mut pa, mut pb, mut po) = ([0u8; 16], [0u8; 16], [0u8; 16]);
            pa[..rest].copy_from_slice(match a {
                Some(a) => &a[whole..],
                None => &out[whole..],
            });
            pb[..rest].copy_from_slice(&b[whole..]);
            // SAFETY: 16-byte local buffers.
            unsafe { step8::<H, O>(pa.as_ptr(), pb.as_ptr(), po.as_mut_ptr()) };
            out[whole..].copy_from_slice(&po[..rest]);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Finalize (Avg)
// ---------------------------------------------------------------------------------------

/// Apply `f` to the whole buffer viewed as `[T]`, staging blocks when it is unaligned.
fn map_inplace<T: Pod>(buf: &mut [u8], f: impl Fn(&mut [T])) {
    if let Some(t) = view_mut::<T>(buf) {
        f(t);
        return;
    }
    let mut stage = Stage::new();
    let step = STAGED_STEP / size_of::<T>() * size_of::<T>();
    for r in blocks(buf.len(), step) {
        let t = stage.load::<T>(&buf[r.clone()]);
        f(t);
        store(t, &mut buf[r]);
    }
}

/// Division of every element by the (non-zero) world size, for [`ReduceOp::Avg`].
trait Divide: Sized {
    fn divide(vals: &mut [Self], world: usize);
}

macro_rules! float_divide {
    ($($t:ty => $qnan:expr),*) => {$(
        impl Divide for $t {
            #[inline(always)]
            fn divide(vals: &mut [Self], world: usize) {
                let w = world as $t;
                for v in vals.iter_mut() {
                    *v = canonical_nan(*v / w, $qnan);
                }
            }
        }
    )*};
}
float_divide!(f32 => f32::from_bits(F32_QNAN), f64 => f64::from_bits(F64_QNAN));

macro_rules! int_divide {
    ($wide:ty; $($t:ty),*) => {$(
        impl Divide for $t {
            fn divide(vals: &mut [Self], world: usize) {
                match <$t>::try_from(world) {
                    // `world >= 1`, so this is ordinary division truncating toward zero
                    // and cannot overflow.
                    Ok(w) => vals.iter_mut().for_each(|v| *v = v.wrapping_div(w)),
                    // The world size does not fit the element type: the quotient is small
                    // (usually 0), compute it in a wider type.
                    Err(_) => vals
                        .iter_mut()
                        .for_each(|v| *v = (<$wide>::from(*v) / world as $wide) as $t),
                }
            }
        }
    )*};
}
int_divide!(i128; i8, i16, i32, i64);
int_divide!(u128; u8, u16, u32, u64);

/// Avg finalisation for 16-bit floats: widen, divide in f32, round back.
fn half_divide<H: Half>(buf: &mut [u8], world: usize) {
    let mut f = [0f32; HALF_BLOCK];
    let mut stage = Stage::new();
    for r in blocks(buf.len(), HALF_BLOCK * 2) {
        let f = &mut f[..r.len() / 2];
        widen_bytes::<H>(&buf[r.clone()], f, &mut stage);
        f32::divide(f, world);
        narrow_bytes::<H>(f, &mut buf[r], &mut stage);
    }
}

#[cfg(test)]
mod tests;
