//! The Python edge of the sparse encoding (`crate::sparse`): compress an error-feedback
//! accumulator in place, and add a peer's payload into a sum.

use crate::py::buffer::Export;
use crate::sparse::{self, Params};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// Bytes of one tensor's sparse payload (`count` float32 elements).
#[pyfunction]
pub fn sparse_encoded_len(count: usize, chunk: usize, k: usize, bits: u32) -> PyResult<usize> {
    Ok(sparse::encoded_len(&Params::new(count, chunk, k, bits)?))
}

/// Encodes the float32 accumulator `acc` (writable, C-contiguous) and leaves in it what
/// the payload does not carry (the residual). Returns the payload.
#[pyfunction]
pub fn sparse_compress<'py>(
    py: Python<'py>,
    acc: &Bound<'py, PyAny>,
    chunk: usize,
    k: usize,
    bits: u32,
) -> PyResult<Bound<'py, PyBytes>> {
    let export = Export::get(acc, true, "the accumulator")?;
    let raw = export.raw();
    if raw.len % 4 != 0 {
        return Err(crate::error::CoreError::InvalidArgument(format!(
            "the accumulator has {} bytes: not float32 elements",
            raw.len
        ))
        .into());
    }
    let p = Params::new(raw.len / 4, chunk, k, bits)?;
    let mut out = vec![0u8; sparse::encoded_len(&p)];
    crate::py::detach(py, || {
        // SAFETY: the export is held (writable) until this call returns.
        let acc = unsafe { raw.bytes_mut() };
        sparse::compress(&p, acc, &mut out)
    })?;
    drop(export);
    Ok(PyBytes::new(py, &out))
}

/// Checks `payload` against the agreed parameters and adds what it carries to the
/// float32 buffer `out` (unchanged if the payload is refused: `ProtocolError`).
#[pyfunction]
pub fn sparse_decode_add(
    py: Python<'_>,
    payload: &[u8],
    out: &Bound<'_, PyAny>,
    chunk: usize,
    k: usize,
    bits: u32,
) -> PyResult<()> {
    let export = Export::get(out, true, "the output")?;
    let raw = export.raw();
    let p = Params::new(raw.len / 4, chunk, k, bits)?;
    crate::py::detach(py, || {
        // SAFETY: the export is held (writable) until this call returns.
        let dst = unsafe { raw.bytes_mut() };
        sparse::decode_add(&p, payload, dst)
    })?;
    drop(export);
    Ok(())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(sparse_encoded_len, m)?)?;
    m.add_function(wrap_pyfunction!(sparse_compress, m)?)?;
    m.add_function(wrap_pyfunction!(sparse_decode_add, m)?)?;
    Ok(())
}
