//! The only pyo3-aware code: exceptions, and thin handles over the Rust core.

pub mod errors;
pub mod fetch;
pub mod hash;
pub mod logging;
pub mod node;
pub mod ring;
pub mod secure;
pub mod transfer;

/// Runs `f` attached to Python from a runtime (tokio) thread, unless the interpreter is
/// finalizing or gone: attaching then would have CPython end the thread mid-Rust (an
/// abort) or touch freed interpreter state (a crash). The caller gets an error instead,
/// which nobody is left to read.
pub(crate) fn attach_from_runtime<R>(
    f: impl for<'py> FnOnce(pyo3::Python<'py>) -> pyo3::PyResult<R>,
) -> pyo3::PyResult<R> {
    pyo3::Python::try_attach(f).unwrap_or_else(|| {
        Err(
            crate::error::CoreError::InvalidUsage("the Python interpreter is shutting down".into())
                .into(),
        )
    })
}
