//! The only pyo3-aware code: exceptions, and thin handles over the Rust core.

pub mod buffer;
pub mod errors;
pub mod fetch;
pub mod hash;
pub mod identity;
pub mod logging;
pub mod node;
pub mod ring;
pub mod secure;
pub mod sparse;
pub mod transfer;

use futures::FutureExt;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::IntoPyObjectExt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{LazyLock, OnceLock, RwLock, TryLockError};
use std::thread::ThreadId;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Set at interpreter exit (`leave_python`, from an `atexit` hook): from then on the
/// runtime's threads start no new hand-off into Python, and Python threads that come
/// out of a pccl call with the GIL released ([`detach`]) never take it back.
static EXITING: AtomicBool = AtomicBool::new(false);
static EXIT: LazyLock<CancellationToken> = LazyLock::new(CancellationToken::new);
/// Held (shared) by every runtime thread while it is attached to Python; the exit hook
/// takes it exclusively, so that once it returns no runtime thread is in Python, and
/// none enters again (`EXITING` is set before).
static GATE: RwLock<()> = RwLock::new(());
/// Python threads between the end of a [`detach`]ed pccl call and having the GIL back.
static RETURNING: AtomicUsize = AtomicUsize::new(0);
/// The thread that ran `leave_python`: the one that runs the `atexit` hooks and then
/// finalizes the interpreter (CPython never ends that one).
static FINALIZER: OnceLock<ThreadId> = OnceLock::new();
/// How long the exit hook waits for threads to leave Python (runtime threads) or to get
/// back into it (Python threads returning from a pccl call).
const EXIT_WAIT: Duration = Duration::from_secs(2);

/// Interpreter exit: awaited pccl operations that have not finished yet never resolve
/// their asyncio futures, runtime threads stop attaching to Python, and other Python
/// threads (daemon threads) that are in a pccl call with the GIL released stay in it, so
/// that none of them enters an interpreter that is finalizing (CPython would end the
/// thread with a forced unwind through Rust frames, a crash, or it would touch freed
/// interpreter state). Returns once no runtime thread is attached and no Python thread
/// is on its way back from a pccl call (or after [`EXIT_WAIT`]). Called by
/// `pccl._shutdown` from an `atexit` hook, on the thread that will finalize;
/// irreversible.
#[pyfunction]
fn leave_python(py: Python<'_>) {
    let _ = FINALIZER.set(std::thread::current().id());
    EXITING.store(true, Ordering::SeqCst);
    EXIT.cancel();
    // With the GIL released: a thread holding the gate, or one returning from `detach`,
    // may be waiting for it.
    py.detach(|| {
        let deadline = Instant::now() + EXIT_WAIT;
        loop {
            let closed = match GATE.try_write() {
                Ok(_) | Err(TryLockError::Poisoned(_)) => true,
                Err(TryLockError::WouldBlock) => false,
            };
            if (closed && RETURNING.load(Ordering::SeqCst) == 0) || Instant::now() >= deadline {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    });
}

/// `py.detach(f)` for pccl calls that release the GIL (hashing, copies, commits), safe
/// at interpreter exit: a Python thread other than the finalizing one that finishes `f`
/// after `leave_python` never takes the GIL back, it stays parked until the process
/// ends. (Taking it back while CPython 3.11-3.13 finalizes ends the thread with
/// `pthread_exit`, whose forced unwind through these Rust frames crashed the process:
/// SIGSEGV, every time for a daemon thread hashing as the program ended. CPython 3.14
/// hangs such threads instead of ending them, too.) The finalizing thread, and every
/// thread while the program runs, get `f`'s value as with `py.detach`.
pub(crate) fn detach<T, F>(py: Python<'_>, f: F) -> T
where
    F: Send + FnOnce() -> T,
    T: Send,
{
    let (value, _back) = py.detach(|| {
        let value = f();
        (value, Returning::announce())
    });
    value
}

/// A Python thread on its way back into Python from [`detach`]; dropped once it holds
/// the GIL again.
struct Returning;

impl Returning {
    /// Counted first, then `EXITING` read (both sequentially consistent): either the
    /// exit hook, which sets the flag and then reads the count, waits for this thread
    /// to be back in Python, or this thread sees the flag and never goes back.
    fn announce() -> Returning {
        RETURNING.fetch_add(1, Ordering::SeqCst);
        if EXITING.load(Ordering::SeqCst) && FINALIZER.get() != Some(&std::thread::current().id()) {
            RETURNING.fetch_sub(1, Ordering::SeqCst);
            loop {
                std::thread::park();
            }
        }
        Returning
    }
}

impl Drop for Returning {
    fn drop(&mut self) {
        RETURNING.fetch_sub(1, Ordering::SeqCst);
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(leave_python, m)?)?;
    Ok(())
}

/// Runs `f` attached to Python from a thread Python did not start (a runtime thread),
/// unless the interpreter is exiting, finalizing or gone: attaching then would have
/// CPython end the thread mid-Rust (an abort) or touch freed interpreter state (a
/// crash). `None` when it did not run. Every such attach goes through here.
pub(crate) fn with_python<R>(f: impl for<'py> FnOnce(Python<'py>) -> R) -> Option<R> {
    let _open = GATE.read().unwrap_or_else(|e| e.into_inner());
    if EXITING.load(Ordering::SeqCst) {
        return None;
    }
    Python::try_attach(f)
}

/// Runs `f` attached to Python from a runtime thread (see [`with_python`]); when it
/// cannot, the caller gets an error instead, which nobody is left to read.
pub(crate) fn attach_from_runtime<R>(
    f: impl for<'py> FnOnce(pyo3::Python<'py>) -> pyo3::PyResult<R>,
) -> pyo3::PyResult<R> {
    with_python(f).unwrap_or_else(|| {
        Err(
            crate::error::CoreError::InvalidUsage("the Python interpreter is shutting down".into())
                .into(),
        )
    })
}

static GET_RUNNING_LOOP: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// Done callback of a bridged asyncio future: its cancellation cancels the Rust future.
#[pyclass(frozen)]
struct CancelOnDone(CancellationToken);

#[pymethods]
impl CancelOnDone {
    fn __call__(&self, fut: &Bound<'_, PyAny>) -> PyResult<()> {
        if fut
            .call_method0(pyo3::intern!(fut.py(), "cancelled"))?
            .is_truthy()?
        {
            self.0.cancel();
        }
        Ok(())
    }
}

/// Scheduled on the event loop by a runtime thread: settles a bridged asyncio future
/// with the Rust future's outcome, unless it is settled (cancelled) already.
#[pyclass(frozen)]
struct Settle;

#[pymethods]
impl Settle {
    fn __call__(&self, fut: &Bound<'_, PyAny>, ok: bool, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = fut.py();
        if fut.call_method0(pyo3::intern!(py, "done"))?.is_truthy()? {
            return Ok(());
        }
        let how = match ok {
            true => pyo3::intern!(py, "set_result"),
            false => pyo3::intern!(py, "set_exception"),
        };
        fut.call_method1(how, (value,))?;
        Ok(())
    }
}

/// An asyncio future (of the running event loop) for a Rust future run on the runtime.
///
/// Cancelling the asyncio future drops the Rust future. The outcome is handed over with
/// `loop.call_soon_threadsafe` from a blocking-pool thread (attaching may wait for the
/// GIL), through [`with_python`]: after `leave_python` it is never handed over, and the
/// asyncio future stays pending (the process is exiting; nobody awaits it any more). A
/// Rust panic settles it with a `RuntimeError`. Our own bridge rather than
/// pyo3-async-runtimes' `future_into_py`, whose hand-off (and whose path for a
/// cancelled future) attaches to Python without such a gate.
pub(crate) fn future_into_py<F, T>(py: Python<'_>, fut: F) -> PyResult<Bound<'_, PyAny>>
where
    F: Future<Output = PyResult<T>> + Send + 'static,
    T: for<'py> IntoPyObject<'py> + Send + 'static,
{
    let get_loop = GET_RUNNING_LOOP.get_or_try_init(py, || {
        Ok::<_, PyErr>(py.import("asyncio")?.getattr("get_running_loop")?.unbind())
    })?;
    let event_loop = get_loop.bind(py).call0()?;
    let py_fut = event_loop.call_method0(pyo3::intern!(py, "create_future"))?;
    let cancel = CancellationToken::new();
    py_fut.call_method1(
        pyo3::intern!(py, "add_done_callback"),
        (CancelOnDone(cancel.clone()),),
    )?;
    let (loop_ref, fut_ref) = (event_loop.unbind(), py_fut.clone().unbind());
    pyo3_async_runtimes::tokio::get_runtime().spawn(async move {
        let outcome = tokio::select! {
            r = std::panic::AssertUnwindSafe(fut).catch_unwind() => r,
            _ = cancel.cancelled() => return,
            _ = EXIT.cancelled() => return,
        };
        // Not on a worker thread: attaching may wait for the GIL.
        let _ = tokio::task::spawn_blocking(move || {
            with_python(|py| {
                let result = match outcome {
                    Ok(r) => r.and_then(|v| v.into_py_any(py)),
                    Err(panic) => Err(pyo3::exceptions::PyRuntimeError::new_err(format!(
                        "pccl's Rust core panicked: {}",
                        panic_message(&*panic)
                    ))),
                };
                let (ok, value) = match result {
                    Ok(v) => (true, v),
                    Err(e) => (false, e.into_value(py).into_any()),
                };
                // Fails only if the loop is closed: nobody is left to await it.
                let _ = loop_ref.bind(py).call_method1(
                    pyo3::intern!(py, "call_soon_threadsafe"),
                    (Settle, fut_ref.bind(py), ok, value),
                );
            });
        })
        .await;
    });
    Ok(py_fut)
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    match (panic.downcast_ref::<&str>(), panic.downcast_ref::<String>()) {
        (Some(s), _) => s,
        (_, Some(s)) => s,
        _ => "(no message)",
    }
}
