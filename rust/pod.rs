//! Plain-old-data element types and typed views of little-endian byte slices, shared by
//! the reduction kernels (`reduce.rs`) and the quantizer's loops (`quant/kernels.rs`).
//!
//! Buffers arrive as raw little-endian bytes of any alignment. When they are aligned
//! for the element type (and the host is little-endian) the loops run directly on
//! typed slices ([`view`], [`view_mut`]); otherwise they copy short blocks through an
//! aligned stack buffer ([`Stage`]) and back ([`store`]), swapping bytes on a
//! big-endian host.

use std::mem::size_of;

use half::{bf16, f16};

/// Element types that may be viewed in place of bytes.
///
/// # Safety
///
/// Implementors must have no padding, no invalid bit patterns and no drop glue, so that
/// any properly aligned byte range of the right length is a valid `[Self]`.
pub(crate) unsafe trait Pod: Copy + 'static {
    /// Convert between the little-endian wire representation and the host's (a no-op on
    /// little-endian hosts, where it compiles away; the conversion is its own inverse).
    fn le_swap(self) -> Self;
}

macro_rules! pod_int {
    ($($t:ty),*) => {$(
        // SAFETY: primitive integers are plain old data.
        unsafe impl Pod for $t {
            #[inline(always)]
            fn le_swap(self) -> Self { <$t>::from_le(self) }
        }
    )*};
}
pod_int!(i8, i16, i32, i64, u8, u16, u32, u64);

macro_rules! pod_float {
    ($($t:ty),*) => {$(
        // SAFETY: f32/f64 are plain old data; `half`'s types are `repr(transparent)` over
        // `u16`.
        unsafe impl Pod for $t {
            #[inline(always)]
            fn le_swap(self) -> Self { <$t>::from_bits(self.to_bits().to_le()) }
        }
    )*};
}
pod_float!(f32, f64, f16, bf16);

/// The bytes viewed as `[T]`, when they are aligned for `T`, a whole number of elements,
/// and the host is little-endian.
#[inline(always)]
pub(crate) fn view<T: Pod>(bytes: &[u8]) -> Option<&[T]> {
    let p = bytes.as_ptr().cast::<T>();
    if cfg!(target_endian = "little")
        && p.is_aligned()
        && bytes.len().is_multiple_of(size_of::<T>())
    {
        // SAFETY: aligned, in bounds, and every bit pattern is a valid `T` (`Pod`).
        Some(unsafe { std::slice::from_raw_parts(p, bytes.len() / size_of::<T>()) })
    } else {
        None
    }
}

/// Mutable counterpart of [`view`].
#[inline(always)]
pub(crate) fn view_mut<T: Pod>(bytes: &mut [u8]) -> Option<&mut [T]> {
    let p = bytes.as_mut_ptr().cast::<T>();
    if cfg!(target_endian = "little")
        && p.is_aligned()
        && bytes.len().is_multiple_of(size_of::<T>())
    {
        // SAFETY: as in `view`, and the exclusive borrow is carried over.
        Some(unsafe { std::slice::from_raw_parts_mut(p, bytes.len() / size_of::<T>()) })
    } else {
        None
    }
}

/// An aligned stack buffer of `N` bytes used to stage unaligned (or big-endian) data.
/// 64-byte alignment is enough for every [`Pod`] type.
#[repr(C, align(64))]
pub(crate) struct Stage<const N: usize>([u8; N]);

impl<const N: usize> Stage<N> {
    #[inline(always)]
    pub(crate) fn new() -> Self {
        Stage([0; N])
    }

    /// Copy `src` (at most `N` bytes, whole elements) into the buffer and return it as
    /// host-order elements.
    #[inline(always)]
    pub(crate) fn load<T: Pod>(&mut self, src: &[u8]) -> &mut [T] {
        let n = src.len() / size_of::<T>();
        assert!(n * size_of::<T>() == src.len() && src.len() <= N);
        self.0[..src.len()].copy_from_slice(src);
        // SAFETY: the buffer is 64-byte aligned (enough for every `Pod`), holds at least
        // `n` elements, and any bit pattern is a valid `T`.
        let s = unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast::<T>(), n) };
        if cfg!(target_endian = "big") {
            s.iter_mut().for_each(|x| *x = x.le_swap());
        }
        s
    }

    /// A scratch view of `n` elements (contents unspecified but valid).
    #[inline(always)]
    pub(crate) fn scratch<T: Pod>(&mut self, n: usize) -> &mut [T] {
        assert!(n * size_of::<T>() <= N);
        // SAFETY: as in `load`.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast::<T>(), n) }
    }
}

/// Write host-order elements to little-endian bytes (`vals` is clobbered on big-endian).
#[inline(always)]
pub(crate) fn store<T: Pod>(vals: &mut [T], dst: &mut [u8]) {
    if cfg!(target_endian = "big") {
        vals.iter_mut().for_each(|x| *x = x.le_swap());
    }
    // SAFETY: reading the initialised elements of a `Pod` slice as bytes.
    let bytes = unsafe {
        std::slice::from_raw_parts(vals.as_ptr().cast::<u8>(), std::mem::size_of_val(vals))
    };
    dst.copy_from_slice(bytes);
}

/// Test buffers whose data starts at a chosen offset past a 64-byte boundary, so the
/// tests of both kernels control alignment.
#[cfg(test)]
pub(crate) struct OffsetBuf {
    words: Vec<u64>,
    start: usize,
    len: usize,
}

#[cfg(test)]
impl OffsetBuf {
    /// A copy of `bytes` starting `offset` bytes past a 64-byte boundary.
    pub(crate) fn new(bytes: &[u8], offset: usize) -> OffsetBuf {
        let mut b = OffsetBuf::zeroed(bytes.len(), offset);
        b.bytes_mut().copy_from_slice(bytes);
        b
    }

    /// `len` zero bytes starting `offset` bytes past a 64-byte boundary.
    pub(crate) fn zeroed(len: usize, offset: usize) -> OffsetBuf {
        // Over-allocate so the data can start at a 64-byte boundary plus `offset`.
        let words = vec![0u64; (len + offset + 128) / 8];
        let p = words.as_ptr() as usize;
        let start = (64 - p % 64) % 64 + offset;
        OffsetBuf { words, start, len }
    }

    fn all(&self) -> &[u8] {
        // SAFETY: viewing an initialised u64 vector as bytes.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast(), self.words.len() * 8) }
    }

    fn all_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, exclusively borrowed.
        unsafe {
            std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast(), self.words.len() * 8)
        }
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.all()[self.start..self.start + self.len]
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        let (s, n) = (self.start, self.len);
        &mut self.all_mut()[s..s + n]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_need_alignment_and_whole_elements() {
        let mut b = OffsetBuf::new(&[1, 0, 0, 0, 2, 0, 0, 0], 0);
        assert_eq!(view::<u32>(b.bytes()), Some(&[1u32, 2][..]));
        view_mut::<u32>(b.bytes_mut()).unwrap()[1] = 3;
        assert_eq!(b.bytes(), &[1, 0, 0, 0, 3, 0, 0, 0]);
        assert!(view::<u32>(&b.bytes()[..7]).is_none());
        let shifted = OffsetBuf::new(&[1, 0, 0, 0], 1);
        assert!(view::<u32>(shifted.bytes()).is_none());
        assert_eq!(view::<u8>(shifted.bytes()), Some(&[1u8, 0, 0, 0][..]));
    }

    #[test]
    fn stage_round_trips_unaligned_bytes() {
        let src = OffsetBuf::new(&1.5f32.to_le_bytes().repeat(3), 3);
        let mut stage = Stage::<64>::new();
        let vals = stage.load::<f32>(src.bytes());
        assert_eq!(vals, &[1.5f32; 3]);
        vals[2] = -2.0;
        let mut dst = OffsetBuf::zeroed(12, 1);
        store(vals, dst.bytes_mut());
        assert_eq!(&dst.bytes()[8..], &(-2.0f32).to_le_bytes());
    }
}
