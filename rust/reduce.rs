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

// ---------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------

#[cfg(test)]
mod tests {
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
        0x0000, 0x8000, 0x0001, 0x8001, 0x3C00, 0xBC00, 0x3C01, 0x7BFF, 0x7C00, 0xFE00, 0x1234,
        0x5555,
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
}
