//! The only pyo3-aware code: exceptions, and thin handles over the Rust core.

pub mod errors;
pub mod fetch;
pub mod hash;
pub mod logging;
pub mod node;
pub mod ring;
pub mod secure;
pub mod transfer;

use pyo3::prelude::*;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::LazyLock;
use tokio_util::sync::CancellationToken;

/// Set at interpreter exit (`leave_python`, from an `atexit` hook): from then on the
/// runtime's threads start no new hand-off into Python.
static EXITING: AtomicBool = AtomicBool::new(false);
static EXIT: LazyLock<CancellationToken> = LazyLock::new(CancellationToken::new);

/// Interpreter exit: awaited pccl operations that have not finished yet never resolve
/// their asyncio futures, and runtime threads stop attaching to Python, so none of them
/// enters an interpreter that is finalizing (CPython would end the thread mid-Rust, an
/// abort, or it would touch freed interpreter state, a crash). Called by `pccl._shutdown`
/// from an `atexit` hook; irreversible.
#[pyfunction]
fn leave_python() {
    EXITING.store(true, Ordering::SeqCst);
    EXIT.cancel();
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(leave_python, m)?)?;
    Ok(())
}

/// `pyo3_async_runtimes::tokio::future_into_py`, except that after `leave_python` the
/// Rust future's result is never handed to Python: the future stays pending instead
/// (the process is exiting; nobody awaits it any more).
pub(crate) fn future_into_py<F, T>(py: Python<'_>, fut: F) -> PyResult<Bound<'_, PyAny>>
where
    F: Future<Output = PyResult<T>> + Send + 'static,
    T: for<'py> IntoPyObject<'py> + Send + 'static,
{
    pyo3_async_runtimes::tokio::future_into_py(py, async move {
        let out = tokio::select! {
            r = fut => r,
            _ = EXIT.cancelled() => std::future::pending::<PyResult<T>>().await,
        };
        if EXITING.load(Ordering::SeqCst) {
            return std::future::pending::<PyResult<T>>().await;
        }
        out
    })
}

/// Runs `f` attached to Python from a runtime (tokio) thread, unless the interpreter is
/// exiting, finalizing or gone: attaching then would have CPython end the thread mid-Rust
/// (an abort) or touch freed interpreter state (a crash). The caller gets an error
/// instead, which nobody is left to read.
pub(crate) fn attach_from_runtime<R>(
    f: impl for<'py> FnOnce(pyo3::Python<'py>) -> pyo3::PyResult<R>,
) -> pyo3::PyResult<R> {
    let attached = match EXITING.load(Ordering::SeqCst) {
        true => None,
        false => pyo3::Python::try_attach(f),
    };
    attached.unwrap_or_else(|| {
        Err(
            crate::error::CoreError::InvalidUsage("the Python interpreter is shutting down".into())
                .into(),
        )
    })
}
