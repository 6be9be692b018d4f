//! The ring all-reduce computed in one process: given every rank's input, the exact
//! bytes `ring_all_reduce` leaves on each peer. Lets the master reduce tiny collectives
//! itself (every peer sends its tensor, all get the result back) without changing a bit.
//!
//! The ring folds chunk `c` starting from rank `c`'s input: rank `c + 1` reduces its
//! input into it, then rank `c + 2`, ..., rank `c - 1` last, which also finalizes it
//! (see `Shared::landed`). Chunks are elementwise and the kernels give the same bits on
//! every code path, so replaying that order chunk by chunk reproduces the ring exactly;
//! the piece split and the lanes do not matter. Non-quantized runs only.

use crate::error::{CoreError, CoreResult};
use crate::reduce::{self, DType, ReduceOp};

/// The all-reduce of `inputs` (rank order: `inputs[r]` is rank `r`'s tensor) as the
/// ring computes it. A world of one returns its input unchanged, as the peers do.
pub fn star_all_reduce(inputs: &[&[u8]], dtype: DType, op: ReduceOp) -> CoreResult<Vec<u8>> {
    let Some(first) = inputs.first() else {
        return Err(CoreError::InvalidArgument(
            "star all-reduce: no inputs".into(),
        ));
    };
    let (world, len, elem) = (inputs.len(), first.len(), dtype.size());
    if let Some((rank, x)) = inputs.iter().enumerate().find(|(_, x)| x.len() != len) {
        return Err(CoreError::InvalidArgument(format!(
            "star all-reduce: rank {rank} has {} bytes, rank 0 has {len}",
            x.len()
        )));
    }
    if !len.is_multiple_of(elem) {
        return Err(CoreError::InvalidArgument(format!(
            "star all-reduce: {len} bytes are not a whole number of {} elements",
            dtype.name()
        )));
    }
    let mut out = first.to_vec();
    if world == 1 {
        return Ok(out);
    }
    let count = len / elem;
    for c in 0..world {
        // Same boundaries as the ring's `Plan::chunk`, in elements.
        let (lo, hi) = (count * c / world, count * (c + 1) / world);
        let range = lo * elem..hi * elem;
        let acc = &mut out[range.clone()];
        acc.copy_from_slice(&inputs[c][range.clone()]);
        for j in 1..world {
            reduce::reduce_inplace(dtype, op, acc, &inputs[(c + j) % world][range.clone()])?;
        }
        reduce::finalize(dtype, op, acc, world)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    fn bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn refuses_no_inputs_unequal_lengths_and_partial_elements() {
        let no: [&[u8]; 0] = [];
        let e = star_all_reduce(&no, DType::F32, ReduceOp::Sum).unwrap_err();
        assert!(matches!(e, CoreError::InvalidArgument(_)), "{e:?}");
        let e = star_all_reduce(&[&[0u8; 8], &[0u8; 4]], DType::F32, ReduceOp::Sum).unwrap_err();
        assert!(matches!(e, CoreError::InvalidArgument(ref m) if m.contains("rank 1")));
        let e = star_all_reduce(&[&[0u8; 6], &[0u8; 6]], DType::F32, ReduceOp::Sum).unwrap_err();
        assert!(matches!(e, CoreError::InvalidArgument(ref m) if m.contains("float32")));
    }

    #[test]
    fn a_world_of_one_is_its_input_and_empty_tensors_stay_empty() {
        let x = bytes(&[1.5, -3.0, 7.0]);
        for op in ReduceOp::ALL {
            assert_eq!(star_all_reduce(&[&x], DType::F32, op).unwrap(), x);
        }
        let e: &[u8] = &[];
        assert!(star_all_reduce(&[e, e, e], DType::F64, ReduceOp::Avg)
            .unwrap()
            .is_empty());
    }

    #[test]
    fn each_chunk_is_folded_from_its_own_rank() {
        // 1e8 + 1 - 1e8 in f32: the order decides between 0 and 1 (or -1e8 + 1 + 1e8).
        let (big, one, neg) = (1e8f32, 1.0f32, -1e8f32);
        let inputs = [
            bytes(&[big, big, big]),
            bytes(&[one, one, one]),
            bytes(&[neg, neg, neg]),
        ];
        let refs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
        let got = f32s(&star_all_reduce(&refs, DType::F32, ReduceOp::Sum).unwrap());
        // Chunk 0: (1e8 + 1) - 1e8 = 0; chunk 1: (1 - 1e8) + 1e8 = 0; chunk 2:
        // (-1e8 + 1e8) + 1 = 1.
        assert_eq!(got, vec![0.0, 0.0, 1.0]);
    }
}
