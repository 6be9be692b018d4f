//! Sparse, quantized encoding of `f32` tensors for error-feedback compression
//! (SparseLoCo-style): per chunk of `chunk` elements only the `k` largest magnitudes are
//! kept, each as its offset in the chunk and a `bits`-bit code on one per-tensor scale.
//!
//! # Interface
//!
//! * [`compress`]`(p, acc, out)`: encodes `acc` (little-endian `f32`, any alignment) into
//!   `out` ([`encoded_len`] bytes) and leaves in `acc` what the payload does not carry
//!   (the residual: `acc - decoded`), bit for bit what [`decode_add`] of the payload into
//!   zeros followed by a subtraction gives. Error feedback therefore loses nothing.
//! * [`decode_add`]`(p, payload, dst)`: `dst[i] += decoded[i]`, after checking the payload
//!   completely (it comes from another peer). Summing the payloads of a group in one
//!   agreed order (by rank) gives the same bytes on every peer.
//!
//! Everything is deterministic: ties in magnitude keep the lower index, the scale and
//! every decoded value are computed by the same `f32` operations on both ends.
//!
//! # Wire format
//!
//! A payload is a 16-byte header, then one bit stream (least significant bit first,
//! padded with zero bits to a whole byte). Header, little-endian:
//!
//! | offset | size | field |
//! |-------:|-----:|-------|
//! | 0  | 4 | magic `PSP1` |
//! | 4  | 4 | `count`: elements of the tensor (`u32`) |
//! | 8  | 2 | `chunk` (`u16`, 2..=32768) |
//! | 10 | 1 | `k` (1..=`chunk`, at most 255) |
//! | 11 | 1 | `bits` (2, 4 or 8) |
//! | 12 | 4 | `scale` (`f32`, finite, >= 0): the largest kept magnitude |
//!
//! For each chunk in order (the last may be shorter, `len` elements), `min(k, len)`
//! entries in increasing offset order, each the offset in `ceil(log2(chunk))` bits then
//! the code in `bits` bits. A code `c` of `L = 2^bits` levels decodes to
//! `scale * (2c - (L - 1)) / (L - 1)` (for 2 bits: `-1, -1/3, 1/3, 1` times the scale).
//! A receiver rejects a payload with other parameters than agreed, another length,
//! offsets not strictly increasing or past the chunk, a non-zero padding, or a bad scale.

use crate::error::CoreError;

#[cfg(test)]
mod tests;

pub const MAGIC: [u8; 4] = *b"PSP1";
pub const HEADER_LEN: usize = 16;

/// The agreed parameters of one tensor's encoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    pub count: usize,
    pub chunk: usize,
    pub k: usize,
    pub bits: u32,
}

impl Params {
    pub fn new(count: usize, chunk: usize, k: usize, bits: u32) -> Result<Params, CoreError> {
        let bad = |what: String| Err(CoreError::InvalidArgument(what));
        if count > u32::MAX as usize {
            return bad(format!(
                "a sparse tensor has at most 2^32-1 elements, got {count}"
            ));
        }
        if !(2..=32768).contains(&chunk) {
            return bad(format!("chunk must be 2..=32768, got {chunk}"));
        }
        if k == 0 || k > chunk || k > 255 {
            return bad(format!(
                "k must be 1..=min(chunk, 255), got {k} (chunk {chunk})"
            ));
        }
        if !matches!(bits, 2 | 4 | 8) {
            return bad(format!("bits must be 2, 4 or 8, got {bits}"));
        }
        Ok(Params {
            count,
            chunk,
            k,
            bits,
        })
    }

    /// Bits of one offset in a chunk.
    pub fn index_bits(&self) -> u32 {
        usize::BITS - (self.chunk - 1).leading_zeros()
    }

    fn levels(&self) -> u32 {
        1 << self.bits
    }

    /// Entries (kept elements) of the whole tensor.
    pub fn entries(&self) -> usize {
        let full = self.count / self.chunk;
        let rest = self.count % self.chunk;
        full * self.k + rest.min(self.k)
    }
}

/// Bytes of a payload with these parameters.
pub fn encoded_len(p: &Params) -> usize {
    let bits = p.entries() as u64 * u64::from(p.index_bits() + p.bits);
    HEADER_LEN + bits.div_ceil(8) as usize
}

fn level_value(p: &Params, scale: f32, code: u32) -> f32 {
    let top = (p.levels() - 1) as f32;
    scale * ((2 * code) as f32 - top) / top
}

fn quantize(p: &Params, scale: f32, x: f32) -> u32 {
    if scale == 0.0 {
        return p.levels() / 2; // (any code: every kept value is zero; decodes near 0)
    }
    let top = (p.levels() - 1) as f32;
    let t = ((x / scale) * top + top) * 0.5;
    (t.round().clamp(0.0, top)) as u32
}

fn read_f32(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap())
}

fn write_f32(b: &mut [u8], i: usize, v: f32) {
    b[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
}

struct BitWriter<'a> {
    out: &'a mut [u8],
    pos: usize,
    acc: u64,
    n: u32,
}

impl BitWriter<'_> {
    fn put(&mut self, value: u32, bits: u32) {
        self.acc |= u64::from(value) << self.n;
        self.n += bits;
        while self.n >= 8 {
            self.out[self.pos] = self.acc as u8;
            self.pos += 1;
            self.acc >>= 8;
            self.n -= 8;
        }
    }

    fn finish(mut self) -> usize {
        if self.n > 0 {
            self.out[self.pos] = self.acc as u8;
            self.pos += 1;
        }
        self.pos
    }
}

struct BitReader<'a> {
    src: &'a [u8],
    pos: usize,
    acc: u64,
    n: u32,
}

impl BitReader<'_> {
    fn get(&mut self, bits: u32) -> Result<u32, CoreError> {
        while self.n < bits {
            let Some(&byte) = self.src.get(self.pos) else {
                return Err(CoreError::Protocol("sparse payload ends early".into()));
            };
            self.acc |= u64::from(byte) << self.n;
            self.pos += 1;
            self.n += 8;
        }
        let v = (self.acc & ((1u64 << bits) - 1)) as u32;
        self.acc >>= bits;
        self.n -= bits;
        Ok(v)
    }
}

/// The offsets of the `k` largest of `mags` (ties: the lower offset first), in
/// increasing order, into `keep`. `mags` are the bits of finite magnitudes (the sign
/// cleared), which order as the magnitudes do.
fn top_k(mags: &[u32], k: usize, keep: &mut Vec<usize>) {
    keep.clear();
    if k >= mags.len() {
        keep.extend(0..mags.len());
    } else if k == 1 {
        // The first of the largest: a later equal magnitude does not replace it.
        let (mut best, mut at) = (mags[0], 0);
        for (o, &m) in mags.iter().enumerate().skip(1) {
            if m > best {
                (best, at) = (m, o);
            }
        }
        keep.push(at);
    } else if k == 2 {
        // The two largest in (magnitude, then offset) order, in two registers.
        let (mut m1, mut o1, mut m2, mut o2) = (mags[0], 0, mags[1], 1);
        if m2 > m1 {
            (m1, o1, m2, o2) = (m2, o2, m1, o1);
        }
        for (o, &m) in mags.iter().enumerate().skip(2) {
            if m > m1 {
                (m2, o2, m1, o1) = (m1, o1, m, o);
            } else if m > m2 {
                (m2, o2) = (m, o);
            }
        }
        keep.extend_from_slice(&[o1.min(o2), o1.max(o2)]);
        return;
    } else if k <= SMALL_K {
        // The k best so far, largest first (equal magnitudes in offset order): a value
        // goes in only if strictly larger than the smallest kept, behind its equals.
        let mut best = [0u32; SMALL_K];
        let mut offs = [0usize; SMALL_K];
        let mut n = 0;
        for (o, &m) in mags.iter().enumerate() {
            if n == k && m <= best[k - 1] {
                continue;
            }
            let mut i = if n < k { n } else { k - 1 };
            while i > 0 && best[i - 1] < m {
                best[i] = best[i - 1];
                offs[i] = offs[i - 1];
                i -= 1;
            }
            best[i] = m;
            offs[i] = o;
            n = (n + 1).min(k);
        }
        keep.extend_from_slice(&offs[..k]);
    } else {
        keep.extend(0..mags.len());
        // Larger magnitude first; equal magnitudes by offset: a total, deterministic order.
        keep.select_nth_unstable_by(k - 1, |&a, &b| mags[b].cmp(&mags[a]).then(a.cmp(&b)));
        keep.truncate(k);
    }
    keep.sort_unstable();
}

/// Up to this many kept per chunk, `top_k` keeps a small sorted list in one pass.
const SMALL_K: usize = 16;

/// Encodes `acc` into `out` and leaves the residual in `acc` (see the module docs).
///
/// Two passes over `acc`: the finiteness check and the scale (the largest magnitude of
/// the whole tensor: every chunk keeps its own largest, so that is the largest kept),
/// then per chunk the selection, the codes and the residual, while the chunk is in cache.
pub fn compress(p: &Params, acc: &mut [u8], out: &mut [u8]) -> Result<(), CoreError> {
    if acc.len() != 4 * p.count {
        return Err(CoreError::InvalidArgument(format!(
            "the accumulator has {} bytes, {} f32 need {}",
            acc.len(),
            p.count,
            4 * p.count
        )));
    }
    if out.len() != encoded_len(p) {
        return Err(CoreError::InvalidArgument(format!(
            "a sparse payload of these parameters is {} bytes, got a buffer of {}",
            encoded_len(p),
            out.len()
        )));
    }
    // The magnitude's bits (sign cleared) order finite floats as the floats do, and
    // are at least those of infinity exactly for the non-finite ones: one integer max,
    // which vectorizes, gives both the scale and the check.
    const MAGNITUDE: u32 = 0x7fff_ffff;
    const NON_FINITE: u32 = 0x7f80_0000;
    let mut lanes = [0u32; 16];
    let mut blocks = acc.chunks_exact(4 * lanes.len());
    for block in &mut blocks {
        for (m, b) in lanes.iter_mut().zip(block.chunks_exact(4)) {
            *m = (*m).max(u32::from_le_bytes(b.try_into().unwrap()) & MAGNITUDE);
        }
    }
    let tail = blocks.remainder().chunks_exact(4);
    let top = tail
        .map(|b| u32::from_le_bytes(b.try_into().unwrap()) & MAGNITUDE)
        .chain(lanes)
        .max()
        .unwrap_or(0);
    if top >= NON_FINITE {
        let (i, v) = (0..p.count)
            .map(|i| (i, read_f32(acc, i)))
            .find(|(_, v)| !v.is_finite())
            .expect("a non-finite value");
        return Err(CoreError::InvalidArgument(format!(
            "the accumulator holds a non-finite value at {i} ({v})"
        )));
    }
    let scale = f32::from_bits(top);
    out[..4].copy_from_slice(&MAGIC);
    out[4..8].copy_from_slice(&(p.count as u32).to_le_bytes());
    out[8..10].copy_from_slice(&(p.chunk as u16).to_le_bytes());
    out[10] = p.k as u8;
    out[11] = p.bits as u8;
    out[12..16].copy_from_slice(&scale.to_le_bytes());
    let (ib, body) = (p.index_bits(), &mut out[HEADER_LEN..]);
    body.fill(0);
    let mut w = BitWriter {
        out: body,
        pos: 0,
        acc: 0,
        n: 0,
    };
    let mut keep = Vec::with_capacity(p.chunk);
    let mut mags = vec![0u32; p.chunk];
    for bytes in acc.chunks_mut(4 * p.chunk) {
        let mags = &mut mags[..bytes.len() / 4];
        for (m, b) in mags.iter_mut().zip(bytes.chunks_exact(4)) {
            *m = u32::from_le_bytes(b.try_into().unwrap()) & MAGNITUDE;
        }
        top_k(mags, p.k, &mut keep);
        for &o in &keep {
            let v = read_f32(bytes, o);
            let code = quantize(p, scale, v);
            w.put(o as u32, ib);
            w.put(code, p.bits);
            // The residual is what the receivers do not get: exactly acc - decoded.
            write_f32(bytes, o, v - level_value(p, scale, code));
        }
    }
    w.finish();
    Ok(())
}

/// Checks `payload` against the agreed parameters and adds what it carries to `dst`.
pub fn decode_add(p: &Params, payload: &[u8], dst: &mut [u8]) -> Result<(), CoreError> {
    let bad = |what: String| Err(CoreError::Protocol(format!("sparse payload: {what}")));
    if dst.len() != 4 * p.count {
        return Err(CoreError::InvalidArgument(format!(
            "the output has {} bytes, {} f32 need {}",
            dst.len(),
            p.count,
            4 * p.count
        )));
    }
    if payload.len() != encoded_len(p) {
        return bad(format!(
            "{} bytes where these parameters make {}",
            payload.len(),
            encoded_len(p)
        ));
    }
    let header_ok = payload[..4] == MAGIC
        && u32::from_le_bytes(payload[4..8].try_into().unwrap()) as usize == p.count
        && u16::from_le_bytes(payload[8..10].try_into().unwrap()) as usize == p.chunk
        && payload[10] as usize == p.k
        && u32::from(payload[11]) == p.bits;
    if !header_ok {
        return bad("its header names other parameters than agreed".into());
    }
    let scale = f32::from_le_bytes(payload[12..16].try_into().unwrap());
    if !scale.is_finite() || scale < 0.0 || scale.is_sign_negative() {
        return bad(format!("bad scale {scale}"));
    }
    let ib = p.index_bits();
    let mut r = BitReader {
        src: &payload[HEADER_LEN..],
        pos: 0,
        acc: 0,
        n: 0,
    };
    // Everything is checked before anything is added: a bad payload changes nothing.
    let mut entries: Vec<(usize, f32)> = Vec::with_capacity(p.entries());
    let chunks = p.count.div_ceil(p.chunk);
    for c in 0..chunks {
        let len = p.chunk.min(p.count - c * p.chunk);
        let mut last: Option<usize> = None;
        for _ in 0..p.k.min(len) {
            let offset = r.get(ib)? as usize;
            let code = r.get(p.bits)?;
            if offset >= len || last.is_some_and(|l| offset <= l) {
                return bad(format!(
                    "offset {offset} in chunk {c} out of order or range"
                ));
            }
            last = Some(offset);
            entries.push((c * p.chunk + offset, level_value(p, scale, code)));
        }
    }
    if r.acc != 0 || r.pos != r.src.len() {
        return bad("non-zero padding or trailing bytes".into());
    }
    for (i, v) in entries {
        let sum = read_f32(dst, i) + v;
        write_f32(dst, i, sum);
    }
    Ok(())
}
