//! Content hash of a byte buffer (a tensor's raw bytes), used by peers to tell whether
//! their copies of a piece of shared state are bit-for-bit the same.
//!
//! # Format (version 1)
//!
//! This is a wire format: two peers compare the 128-bit values, so every detail below is
//! fixed and must never depend on the machine, the thread count or the call site.
//! `XXH3_128(bytes, seed)` is the 128-bit XXH3 hash of xxHash (v0.8) with a 64-bit seed.
//! All integers that get serialized are big-endian.
//!
//! ```text
//! LEAF_SIZE = 1_048_576                          (1 MiB; part of the format)
//! LEAF_SEED = 0x7063_636c_6c65_6166              (ASCII "pcclleaf")
//! ROOT_SEED = 0x7063_636c_726f_6f74              (ASCII "pcclroot")
//!
//! n = len(data)
//! L = ceil(n / LEAF_SIZE)                        (L = 0 when n = 0)
//! leaf[i] = data[i * LEAF_SIZE .. min((i + 1) * LEAF_SIZE, n)]      for 0 <= i < L
//!           (every leaf is exactly LEAF_SIZE bytes except possibly the last one,
//!            which holds 1..=LEAF_SIZE bytes; no leaf is ever empty)
//! d[i]    = XXH3_128(leaf[i], seed = (LEAF_SEED + i) mod 2^64)
//! root    = XXH3_128(be128(d[0]) || ... || be128(d[L-1]) || be64(n) || be64(LEAF_SIZE),
//!                    seed = ROOT_SEED)
//! content_hash(data) = root
//! ```
//!
//! `be128(d)` is the 16-byte big-endian form of a 128-bit digest, i.e. xxHash's canonical
//! representation (`XXH128_canonicalFromHash`: high 64 bits first). The root input is
//! therefore always `16 * L + 16` bytes long.
//!
//! Notes on the definition:
//! * Small inputs take the same path: a buffer of at most one leaf is one leaf (or none
//!   when empty) followed by the root step, so `content_hash(b"")` is
//!   `XXH3_128(be64(0) || be64(LEAF_SIZE), ROOT_SEED)`. There is no short-input shortcut.
//! * Mixing the leaf index into the seed makes the position of each leaf matter: moving
//!   or swapping leaves changes the leaf digests, not only their order.
//! * `n` in the root pins the total length (so trailing bytes cannot be cut off
//!   unnoticed) and `LEAF_SIZE` keeps hashes of a format with a different leaf size from
//!   ever colliding with these by construction.
//! * The leaves are independent, so they can be hashed in parallel; the result is the
//!   same for any number of threads.
//!
//! Python sees the value as 16 bytes, `be128(root)` (see `py/hash.rs`), or as 32
//! lowercase hex digits of those bytes.

use std::num::NonZeroUsize;
use std::sync::OnceLock;

use xxhash_rust::xxh3::{xxh3_128_with_seed, Xxh3};

/// Leaf size of the tree hash, in bytes (part of the format).
pub const LEAF_SIZE: usize = 1 << 20;
/// Base seed of the leaf hashes; leaf `i` uses `LEAF_SEED.wrapping_add(i)`.
pub const LEAF_SEED: u64 = u64::from_be_bytes(*b"pcclleaf");
/// Seed of the root hash over the leaf digests.
pub const ROOT_SEED: u64 = u64::from_be_bytes(*b"pcclroot");

/// Bytes of one serialized leaf digest.
const DIGEST_BYTES: usize = 16;
/// Below this many bytes `content_hash` stays on the calling thread: starting threads
/// would cost about as much as hashing.
const PARALLEL_MIN_BYTES: usize = 8 * LEAF_SIZE;
/// Upper bound on the threads `content_hash_threads` starts, whatever it is asked for.
pub const MAX_THREADS: usize = 256;

/// Content hash of `data` (see the module doc for the exact definition). Inputs of at
/// least 8 MiB are hashed on all available cores, smaller ones on the calling thread;
/// the value is the same either way.
pub fn content_hash(data: &[u8]) -> u128 {
    let threads = if data.len() >= PARALLEL_MIN_BYTES {
        available_cores()
    } else {
        1
    };
    tree_hash(data, LEAF_SIZE, threads)
}

/// Same value as [`content_hash`], computed with `threads` threads (the calling one
/// included). Leaves are split into contiguous runs, one per thread; `threads` is
/// clamped to `1..=min(number of leaves, MAX_THREADS)`, so 0 means 1.
pub fn content_hash_threads(data: &[u8], threads: usize) -> u128 {
    tree_hash(data, LEAF_SIZE, threads)
}

/// Number of cores this process may use (looked up once).
fn available_cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| {
        std::thread::available_parallelism()
            .map(NonZeroUsize::get)
            .unwrap_or(1)
    })
}

/// The tree hash with a given leaf size. Only `LEAF_SIZE` is the format; other sizes are
/// for tests, which can then cover many leaves with little data.
fn tree_hash(data: &[u8], leaf_size: usize, threads: usize) -> u128 {
    assert!(leaf_size > 0, "leaf size must be positive");
    let n_leaves = data.len().div_ceil(leaf_size);
    let mut digests = vec![0u8; n_leaves * DIGEST_BYTES];
    let threads = threads.clamp(1, n_leaves.clamp(1, MAX_THREADS));

    if threads == 1 {
        hash_leaves(data, leaf_size, 0, &mut digests);
    } else {
        // Thread t gets `base` leaves, plus one more for the first `extra` threads. The
        // last run is hashed on the calling thread instead of a new one.
        let base = n_leaves / threads;
        let extra = n_leaves % threads;
        std::thread::scope(|scope| {
            let mut rest = digests.as_mut_slice();
            let mut first = 0usize;
            for t in 0..threads {
                let count = base + usize::from(t < extra);
                let (mine, tail) = std::mem::take(&mut rest).split_at_mut(count * DIGEST_BYTES);
                rest = tail;
                let start = first * leaf_size;
                let end = ((first + count) * leaf_size).min(data.len());
                let chunk = &data[start..end];
                let first_leaf = first;
                if t + 1 == threads {
                    hash_leaves(chunk, leaf_size, first_leaf, mine);
                } else {
                    scope.spawn(move || hash_leaves(chunk, leaf_size, first_leaf, mine));
                }
                first += count;
            }
        });
    }

    root_of(&digests, data.len(), leaf_size)
}

/// The root over the leaf digests of `len` bytes.
fn root_of(digests: &[u8], len: usize, leaf_size: usize) -> u128 {
    let mut root = Xxh3::with_seed(ROOT_SEED);
    root.update(digests);
    root.update(&(len as u64).to_be_bytes());
    root.update(&(leaf_size as u64).to_be_bytes());
    root.digest128()
}

/// [`content_hash`] of bytes that arrive in order, hashed as they come (e.g. while a
/// transfer lands them), so that no second pass over the data is needed.
#[derive(Default)]
pub struct LeafHasher {
    digests: Vec<u8>,
    len: usize,
    first_leaf: usize,
}

impl LeafHasher {
    pub fn new() -> Self {
        Self::default()
    }

    /// Hashes a run of leaves of a larger buffer, the first being leaf `first_leaf`
    /// (a range fetched on its own); combine the runs' [`LeafHasher::into_digests`]
    /// in order with [`root_of_digests`].
    pub fn starting_at(first_leaf: usize) -> Self {
        LeafHasher {
            first_leaf,
            ..Self::default()
        }
    }

    /// The big-endian leaf digests hashed so far, 16 bytes each.
    pub fn into_digests(self) -> Vec<u8> {
        self.digests
    }

    /// Hashes the next `chunk` of the data. Every chunk but the last must be a whole
    /// number of leaves (a multiple of [`LEAF_SIZE`]).
    pub fn update(&mut self, chunk: &[u8]) {
        assert!(
            self.len.is_multiple_of(LEAF_SIZE),
            "only the last chunk may end inside a leaf"
        );
        let start = self.digests.len();
        let n = chunk.len().div_ceil(LEAF_SIZE);
        self.digests.resize(start + n * DIGEST_BYTES, 0);
        hash_leaves(
            chunk,
            LEAF_SIZE,
            self.first_leaf + self.len / LEAF_SIZE,
            &mut self.digests[start..],
        );
        self.len += chunk.len();
    }

    /// The content hash of everything passed to [`LeafHasher::update`] (a hasher made
    /// with [`LeafHasher::new`]: the data starts at leaf 0).
    pub fn finish(&self) -> u128 {
        assert_eq!(self.first_leaf, 0, "a run of leaves has no root of its own");
        root_of(&self.digests, self.len, LEAF_SIZE)
    }
}

/// The content hash of `len` bytes from their leaf digests (16 bytes each, in order),
/// e.g. runs of leaves hashed by several [`LeafHasher::starting_at`]. `None` when the
/// number of digests does not fit `len`.
pub fn root_of_digests(digests: &[u8], len: usize) -> Option<u128> {
    (digests.len() == len.div_ceil(LEAF_SIZE) * DIGEST_BYTES)
        .then(|| root_of(digests, len, LEAF_SIZE))
}

/// Hashes the consecutive leaves of `chunk` (whose first leaf has global index
/// `first_leaf`) and writes their big-endian digests into `out`, 16 bytes each.
fn hash_leaves(chunk: &[u8], leaf_size: usize, first_leaf: usize, out: &mut [u8]) {
    debug_assert_eq!(out.len(), chunk.len().div_ceil(leaf_size) * DIGEST_BYTES);
    for (i, (leaf, slot)) in chunk
        .chunks(leaf_size)
        .zip(out.chunks_exact_mut(DIGEST_BYTES))
        .enumerate()
    {
        let seed = LEAF_SEED.wrapping_add((first_leaf + i) as u64);
        slot.copy_from_slice(&xxh3_128_with_seed(leaf, seed).to_be_bytes());
    }
}

/// 32 lowercase hex digits of the big-endian bytes of a hash (what Python's
/// `content_hash_hex` returns).
pub fn to_hex(hash: u128) -> String {
    format!("{hash:032x}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn runs_of_leaves_hashed_apart_give_the_same_root() {
        let data = pattern(5 * LEAF_SIZE + 12_345, 9);
        for cuts in [vec![], vec![1], vec![2, 3], vec![1, 2, 3, 4, 5]] {
            let mut digests = Vec::new();
            let mut bounds = vec![0];
            bounds.extend(cuts.iter().map(|c| c * LEAF_SIZE));
            bounds.push(data.len());
            for w in bounds.windows(2) {
                let mut h = LeafHasher::starting_at(w[0] / LEAF_SIZE);
                h.update(&data[w[0]..w[1]]);
                digests.extend(h.into_digests());
            }
            assert_eq!(
                root_of_digests(&digests, data.len()),
                Some(content_hash(&data))
            );
        }
        assert_eq!(root_of_digests(&[0; 16], 2 * LEAF_SIZE), None);
        assert_eq!(root_of_digests(&[], 0), Some(content_hash(&[])));
    }

    /// Deterministic, non-repeating-looking test bytes (a 64-bit LCG, top byte).
    fn pattern(len: usize, salt: u64) -> Vec<u8> {
        let mut x = salt.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..len)
            .map(|_| {
                x = x
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                (x >> 56) as u8
            })
            .collect()
    }

    /// The format written out as plainly as possible, straight from the module doc,
    /// with one-shot XXH3 calls only (no streaming, no threads).
    fn reference(data: &[u8]) -> u128 {
        let mut root_input = Vec::new();
        let n_leaves = data.len().div_ceil(LEAF_SIZE);
        for i in 0..n_leaves {
            let leaf = &data[i * LEAF_SIZE..((i + 1) * LEAF_SIZE).min(data.len())];
            let d = xxh3_128_with_seed(leaf, LEAF_SEED.wrapping_add(i as u64));
            root_input.extend_from_slice(&d.to_be_bytes());
        }
        root_input.extend_from_slice(&(data.len() as u64).to_be_bytes());
        root_input.extend_from_slice(&(LEAF_SIZE as u64).to_be_bytes());
        xxh3_128_with_seed(&root_input, ROOT_SEED)
    }

    const SIZES: [usize; 6] = [
        0,
        1,
        LEAF_SIZE - 1,
        LEAF_SIZE,
        LEAF_SIZE + 1,
        10 * LEAF_SIZE + 7,
    ];

    #[test]
    fn hash_threads_agree_and_match_reference() {
        for (k, &size) in SIZES.iter().enumerate() {
            let data = pattern(size, k as u64);
            let want = reference(&data);
            assert_eq!(content_hash(&data), want, "size {size}");
            for threads in 0..=8 {
                assert_eq!(
                    content_hash_threads(&data, threads),
                    want,
                    "size {size}, {threads} threads"
                );
            }
        }
    }

    #[test]
    fn leaf_hasher_matches_content_hash_for_any_whole_leaf_chunking() {
        for len in [
            0,
            1,
            LEAF_SIZE - 1,
            LEAF_SIZE,
            3 * LEAF_SIZE + 17,
            9 * LEAF_SIZE,
        ] {
            let data = pattern(len, 7);
            for per in [1, 2, 4] {
                let mut h = LeafHasher::new();
                for chunk in data.chunks(per * LEAF_SIZE) {
                    h.update(chunk);
                }
                assert_eq!(
                    h.finish(),
                    content_hash(&data),
                    "len {len}, {per} leaves per chunk"
                );
            }
        }
    }

    #[test]
    #[should_panic(expected = "only the last chunk")]
    fn leaf_hasher_refuses_a_chunk_after_a_partial_leaf() {
        let mut h = LeafHasher::new();
        h.update(&[1, 2, 3]);
        h.update(&[4]);
    }

    #[test]
    fn hash_seeds_spell_their_names() {
        assert_eq!(LEAF_SEED, 0x7063_636c_6c65_6166);
        assert_eq!(ROOT_SEED, 0x7063_636c_726f_6f74);
        assert_eq!(LEAF_SIZE, 1_048_576);
    }

    #[test]
    fn hash_known_answers() {
        // Computed once, by this code and independently from the module doc with the
        // `xxhash` Python package (tests/test_hash.py repeats that when it is installed).
        // A failure here means the wire format changed: peers running the old code would
        // disagree with the new one.
        assert_eq!(
            to_hex(content_hash(b"")),
            "e6a7a223d25e5c0eeb8d9c58d2979dad"
        );
        assert_eq!(
            to_hex(content_hash(b"pccl")),
            "b9c3b887c5fc62c15337d7c10534a9ee"
        );
        let ramp: Vec<u8> = (0..2 * LEAF_SIZE + 3).map(|i| (i % 251) as u8).collect();
        assert_eq!(
            to_hex(content_hash(&ramp)),
            "73f009d6557e171c486f7447718b0d7a"
        );
        let zeros = vec![0u8; 3 * LEAF_SIZE];
        assert_eq!(
            to_hex(content_hash(&zeros)),
            "211d4fd1d7886dd52bb8383b909e9437"
        );
    }

    #[test]
    fn hash_empty_is_root_of_lengths_only() {
        let mut root_input = [0u8; 16];
        root_input[8..].copy_from_slice(&(LEAF_SIZE as u64).to_be_bytes());
        assert_eq!(
            content_hash(&[]),
            xxh3_128_with_seed(&root_input, ROOT_SEED)
        );
    }

    #[test]
    fn hash_one_byte_change_anywhere_changes_it() {
        let size = 3 * LEAF_SIZE + 5;
        let mut data = pattern(size, 7);
        let base = content_hash_threads(&data, 3);
        let positions = [
            0,
            1,
            LEAF_SIZE - 1,
            LEAF_SIZE,
            LEAF_SIZE + 1,
            2 * LEAF_SIZE + 12_345,
            3 * LEAF_SIZE,
            size - 1,
        ];
        for pos in positions {
            for flip in [0x01u8, 0x80] {
                data[pos] ^= flip;
                assert_ne!(
                    content_hash_threads(&data, 3),
                    base,
                    "byte {pos} ^ {flip:#x}"
                );
                data[pos] ^= flip;
            }
        }
        assert_eq!(content_hash_threads(&data, 3), base);
    }

    #[test]
    fn hash_length_matters() {
        // Same bytes, one more zero at the end: a different length, a different hash,
        // also where the extra byte lands in a new leaf.
        for size in [0, 5, LEAF_SIZE - 1, LEAF_SIZE] {
            let mut data = pattern(size, 3);
            let short = content_hash(&data);
            data.push(0);
            assert_ne!(content_hash(&data), short, "size {size}");
        }
    }

    #[test]
    fn hash_swapping_two_leaves_changes_it() {
        let mut data = pattern(4 * LEAF_SIZE, 11);
        let base = content_hash(&data);
        let (a, b) = data.split_at_mut(2 * LEAF_SIZE);
        a[LEAF_SIZE..].swap_with_slice(&mut b[..LEAF_SIZE]);
        assert_ne!(content_hash(&data), base);

        // Two identical leaves still hash differently by position, so the same content
        // at other offsets does not cancel out.
        let twice = [pattern(LEAF_SIZE, 5), pattern(LEAF_SIZE, 5)].concat();
        let d0 = xxh3_128_with_seed(&twice[..LEAF_SIZE], LEAF_SEED);
        let d1 = xxh3_128_with_seed(&twice[LEAF_SIZE..], LEAF_SEED.wrapping_add(1));
        assert_ne!(d0, d1);
    }

    #[test]
    fn hash_small_leaves_split_every_way() {
        // With a tiny leaf the thread split covers many uneven partitions cheaply.
        let data = pattern(1000, 13);
        for leaf in [1, 3, 7, 64, 999, 1000, 1001] {
            let want = tree_hash(&data, leaf, 1);
            for threads in 2..=17 {
                assert_eq!(
                    tree_hash(&data, leaf, threads),
                    want,
                    "leaf {leaf}, {threads} threads"
                );
            }
        }
        assert_ne!(tree_hash(&data, 7, 1), tree_hash(&data, 8, 1));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn hash_prop_thread_count_independent_small_leaves(
            data in proptest::collection::vec(any::<u8>(), 0..4096),
            leaf in 1usize..300,
            threads in 2usize..12,
        ) {
            prop_assert_eq!(tree_hash(&data, leaf, threads), tree_hash(&data, leaf, 1));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(12))]

        #[test]
        fn hash_prop_thread_count_independent(
            size in 0usize..(3 * LEAF_SIZE + 100),
            salt in any::<u64>(),
            threads in 1usize..=8,
        ) {
            let data = pattern(size, salt);
            let want = reference(&data);
            prop_assert_eq!(content_hash_threads(&data, threads), want);
            prop_assert_eq!(content_hash(&data), want);
        }

        #[test]
        fn hash_prop_flip_changes_it(
            size in 1usize..(2 * LEAF_SIZE + 100),
            salt in any::<u64>(),
            pos_frac in 0.0f64..1.0,
            flip in 1u8..=255,
        ) {
            let mut data = pattern(size, salt);
            let before = content_hash_threads(&data, 2);
            let pos = ((size as f64 * pos_frac) as usize).min(size - 1);
            data[pos] ^= flip;
            prop_assert_ne!(content_hash_threads(&data, 2), before);
        }
    }
}
