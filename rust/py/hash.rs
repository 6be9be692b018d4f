//! Python entry points of the content hash (`crate::hash`): `content_hash(buffer,
//! threads=None) -> bytes` and `content_hash_hex(buffer, threads=None) -> str`.
//!
//! The buffer is any C-contiguous object with the buffer protocol. Byte-formatted
//! buffers (`bytes`, `bytearray`, `memoryview`, uint8 numpy arrays) are read directly;
//! other formats (a float32 array, say) are read through `memoryview(obj).cast("B")`,
//! which sees the same bytes. The GIL is released while hashing, so the object must not
//! be written to by another thread meanwhile (the hash of bytes that change under it
//! means nothing).

use crate::error::CoreError;
use crate::hash;
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyMemoryView};

/// A read-only byte view of `obj`'s memory, refused unless C-contiguous.
fn byte_view(obj: &Bound<'_, PyAny>) -> PyResult<PyBuffer<u8>> {
    let buf = match PyBuffer::<u8>::get(obj) {
        Ok(buf) => buf,
        Err(_) => {
            // Not exported with a one-byte format: look at it as raw bytes instead.
            let view = PyMemoryView::from(obj).map_err(|e| {
                CoreError::InvalidArgument(format!(
                    "content_hash needs an object with the buffer protocol: {e}"
                ))
            })?;
            if !view.getattr("c_contiguous")?.is_truthy()? {
                return Err(not_contiguous());
            }
            let bytes = view.call_method1("cast", ("B",)).map_err(|e| {
                CoreError::InvalidArgument(format!("cannot read the buffer as bytes: {e}"))
            })?;
            PyBuffer::<u8>::get(&bytes)?
        }
    };
    if !buf.is_c_contiguous() {
        return Err(not_contiguous());
    }
    Ok(buf)
}

fn not_contiguous() -> PyErr {
    CoreError::InvalidArgument(
        "content_hash needs a C-contiguous buffer (use np.ascontiguousarray)".into(),
    )
    .into()
}

/// Hashes the bytes of `obj` with the GIL released.
fn hash_object(py: Python<'_>, obj: &Bound<'_, PyAny>, threads: Option<i64>) -> PyResult<u128> {
    let threads = match threads {
        None => None,
        Some(t) if t >= 1 => Some(usize::try_from(t).unwrap_or(usize::MAX)),
        Some(t) => {
            return Err(CoreError::InvalidArgument(format!(
                "threads must be at least 1 (or None for all cores), got {t}"
            ))
            .into())
        }
    };
    with_bytes(py, obj, |data| match threads {
        None => hash::content_hash(data),
        Some(t) => hash::content_hash_threads(data, t),
    })
}

/// Runs `f` over the bytes of `obj` with the GIL released.
fn with_bytes<R: Send>(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    f: impl FnOnce(&[u8]) -> R + Send,
) -> PyResult<R> {
    let buf = byte_view(obj)?;
    let len = buf.len_bytes();
    let data: &[u8] = if len == 0 {
        &[]
    } else {
        // SAFETY: `buf` holds the exporter's buffer (C-contiguous, `len` bytes) until it
        // is dropped at the end of this function, after `f` is done.
        unsafe { std::slice::from_raw_parts(buf.buf_ptr() as *const u8, len) }
    };
    let value = crate::py::detach(py, || f(data));
    drop(buf);
    Ok(value)
}

/// The 128-bit content hash of the buffer's bytes, as 16 big-endian bytes. `threads`
/// only changes the speed, never the value (None: all cores for large buffers).
#[pyfunction]
#[pyo3(signature = (buffer, threads=None))]
pub fn content_hash<'py>(
    py: Python<'py>,
    buffer: &Bound<'py, PyAny>,
    threads: Option<i64>,
) -> PyResult<Bound<'py, PyBytes>> {
    let value = hash_object(py, buffer, threads)?;
    Ok(PyBytes::new(py, &value.to_be_bytes()))
}

/// `content_hash(buffer, threads).hex()`: 32 lowercase hex digits.
#[pyfunction]
#[pyo3(signature = (buffer, threads=None))]
pub fn content_hash_hex(
    py: Python<'_>,
    buffer: &Bound<'_, PyAny>,
    threads: Option<i64>,
) -> PyResult<String> {
    Ok(hash::to_hex(hash_object(py, buffer, threads)?))
}

/// The leaf digests (16 big-endian bytes each) of `buffer`, a run of whole hash leaves
/// (or ending the data) whose first leaf is leaf `first_leaf` of the data: what a fetch
/// of those bytes would have returned. Used to resume a range another source started.
#[pyfunction]
pub fn leaf_digests<'py>(
    py: Python<'py>,
    buffer: &Bound<'py, PyAny>,
    first_leaf: usize,
) -> PyResult<Bound<'py, PyBytes>> {
    let digests = with_bytes(py, buffer, |data| {
        let mut h = hash::LeafHasher::starting_at(first_leaf);
        h.update(data);
        h.into_digests()
    })?;
    Ok(PyBytes::new(py, &digests))
}

/// The content hash (16 big-endian bytes) of `nbytes` bytes from their leaf digests in
/// order, as `P2PNode.fetch_into` returns them for the ranges of one tensor.
#[pyfunction]
pub fn hash_root<'py>(
    py: Python<'py>,
    digests: &[u8],
    nbytes: u64,
) -> PyResult<Bound<'py, PyBytes>> {
    let value = hash::root_of_digests(digests, nbytes as usize).ok_or_else(|| {
        crate::error::CoreError::InvalidArgument(format!(
            "{} bytes of leaf digests do not fit {nbytes} bytes of data",
            digests.len()
        ))
    })?;
    Ok(PyBytes::new(py, &value.to_be_bytes()))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(hash_root, m)?)?;
    m.add_function(wrap_pyfunction!(leaf_digests, m)?)?;
    m.add_function(wrap_pyfunction!(content_hash, m)?)?;
    m.add_function(wrap_pyfunction!(content_hash_hex, m)?)?;
    Ok(())
}
