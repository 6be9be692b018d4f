//! Buffers that Python objects export to Rust (the buffer protocol), held for as long as
//! Rust uses their memory. The held export is what keeps that memory in place (while it
//! lives, a `bytearray` cannot be resized: `BufferError`); a reference to the object
//! alone does not.
//!
//! An export that one call uses (`Export`) is released when the call returns, on the
//! calling Python thread. Exports that tokio tasks use after the call returned go into a
//! `Held`, which is released when its last owner drops it, and always on a thread
//! attached to Python, never by a runtime thread taking the GIL for it (which, at
//! interpreter exit, hangs or ends the thread mid-Rust): dropped on a Python thread, it
//! is released there and then; dropped on a runtime thread, by pyo3's deferred
//! reference count, applied the next time any thread attaches (every pccl call and
//! every hand-off of a result does).

use crate::error::CoreError;
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::PyCapsule;

/// A C-contiguous byte buffer exported by a Python object; the export is held while
/// this lives. Only for memory used while the caller waits (drop it on a Python thread:
/// dropped elsewhere, a `PyBuffer` takes the GIL); see [`Held`] for the rest.
pub(crate) struct Export(PyBuffer<u8>);

/// Where an export's bytes are, for code that runs without the GIL. Valid while the
/// export it came from is held.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawBuffer {
    pub ptr: usize,
    pub len: usize,
}

impl RawBuffer {
    /// The bytes, writable.
    ///
    /// # Safety
    /// The export this came from is held for `'a`, it was taken writable, and nothing
    /// else reads or writes the bytes meanwhile.
    pub(crate) unsafe fn bytes_mut<'a>(self) -> &'a mut [u8] {
        match self.len {
            0 => &mut [],
            // SAFETY: forwarded to the caller.
            len => unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, len) },
        }
    }

    /// The bytes.
    ///
    /// # Safety
    /// The export this came from is held for `'a`, and nothing writes the bytes
    /// meanwhile.
    pub(crate) unsafe fn bytes<'a>(self) -> &'a [u8] {
        match self.len {
            0 => &[],
            // SAFETY: forwarded to the caller.
            len => unsafe { std::slice::from_raw_parts(self.ptr as *const u8, len) },
        }
    }
}

impl Export {
    /// `obj`'s bytes (`writable`: refused if read-only); `what` names it in errors.
    pub(crate) fn get(obj: &Bound<'_, PyAny>, writable: bool, what: &str) -> PyResult<Export> {
        let buf = PyBuffer::<u8>::get(obj).map_err(|e| {
            CoreError::InvalidArgument(format!("{what} must expose a byte buffer: {e}"))
        })?;
        if !buf.is_c_contiguous() {
            return Err(CoreError::InvalidArgument(format!("{what} must be C-contiguous")).into());
        }
        if writable && buf.readonly() {
            return Err(CoreError::InvalidArgument(format!("{what} is read-only")).into());
        }
        Ok(Export(buf))
    }

    pub(crate) fn raw(&self) -> RawBuffer {
        RawBuffer {
            ptr: self.0.buf_ptr() as usize,
            len: self.0.len_bytes(),
        }
    }
}

/// Exports held beyond the call that took them, for tokio tasks: a capsule owns them,
/// so that whichever thread drops the last owner, Python's own reference counting
/// releases them on a thread attached to it (see the module docs).
pub(crate) struct Held {
    _capsule: Py<PyCapsule>,
}

impl Held {
    pub(crate) fn new(py: Python<'_>, exports: Vec<Export>) -> PyResult<Held> {
        Ok(Held {
            _capsule: PyCapsule::new(py, exports, None)?.unbind(),
        })
    }
}
