//! Rust log records into Python's `logging`, as they happen, at their own level.
//!
//! Rust code logs with the `log` macros (`log::warn!`, `log::debug!`, ...); the target
//! (the module path, `_core::net::node`) becomes the Python logger `pccl._core.net.node`,
//! so `logging.getLogger("pccl").setLevel(logging.DEBUG)` (or `PCCL_LOG_LEVEL=debug`)
//! shows them. pyo3-log does the bridging; this module installs it once, from the
//! module init, and adds two things:
//!
//! * The Python loggers' effective levels are cached on the Rust side, so a record of a
//!   disabled level costs no GIL (tokio threads never wait for Python for nothing).
//!   `reset_log_cache()` forgets the cache; `pccl/_logging.py` calls it whenever a
//!   Python logging level changes, so levels set at run time apply at once.
//! * `close_log_bridge()` (an `atexit` hook of `pccl/_logging.py`) stops forwarding
//!   before the interpreter finalizes: a tokio thread that took the GIL then would be
//!   ended by CPython mid-Rust and abort the process (see `pccl/_shutdown.py`). A
//!   thread that checked the flag just before it closed still only attaches through
//!   `crate::py::with_python`, which the exit hook closes for good.
//!
//! Records are formatted on the calling thread; only enabled ones take the GIL. Log
//! events, not per-byte progress: nothing on a hot path logs, and no record is logged
//! while a lock that Python-facing methods take is held (the GIL would wait on it).

use log::{LevelFilter, Log, Metadata, Record};
use pyo3::prelude::*;
use pyo3_log::{Caching, Logger, ResetHandle};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// The Python logger every Rust target is placed under (`pccl._core...`).
const PREFIX: &str = "pccl";
/// Our own targets start with the crate name (`_core::net::node`, ...).
const OWN_TARGET: &str = "_core";

static RESET: OnceLock<ResetHandle> = OnceLock::new();
static OPEN: AtomicBool = AtomicBool::new(false);

/// pyo3-log's logger, closed off once Python starts shutting down.
struct Bridge(Logger);

impl Log for Bridge {
    fn enabled(&self, metadata: &Metadata) -> bool {
        OPEN.load(Ordering::Acquire) && self.0.enabled(metadata)
    }

    fn log(&self, record: &Record) {
        if OPEN.load(Ordering::Acquire) {
            // pyo3-log attaches to Python itself; attaching here first, only while the
            // interpreter is neither finalizing nor gone, makes its attach a nested one
            // (a record logged by a tokio thread during interpreter exit is dropped
            // instead of crashing the process).
            let _ = crate::py::with_python(|_py| self.0.log(record));
        }
    }

    fn flush(&self) {}
}

/// Installs the bridge (once per process; later calls do nothing).
pub fn init(py: Python<'_>) -> PyResult<()> {
    if RESET.get().is_some() {
        return Ok(());
    }
    let logger = Logger::new(py, Caching::LoggersAndLevels)?
        .set_prefix(PREFIX)
        // Other crates' records (none today) only from warnings up; ours from debug.
        .filter(LevelFilter::Warn)
        .filter_target(OWN_TARGET.to_owned(), LevelFilter::Debug);
    let handle = logger.reset_handle();
    if log::set_boxed_logger(Box::new(Bridge(logger))).is_ok() {
        log::set_max_level(LevelFilter::Debug);
        let _ = RESET.set(handle);
        OPEN.store(true, Ordering::Release);
    }
    Ok(())
}

/// Forgets the cached Python loggers and levels; the next record of each logger looks
/// them up again. Call after changing a logging level (pccl does, see `pccl._logging`).
#[pyfunction]
pub fn reset_log_cache() {
    if let Some(handle) = RESET.get() {
        handle.reset();
    }
}

/// Stops forwarding Rust records to Python for good (interpreter exit).
#[pyfunction]
pub fn close_log_bridge() {
    OPEN.store(false, Ordering::Release);
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    init(m.py())?;
    m.add_function(wrap_pyfunction!(reset_log_cache, m)?)?;
    m.add_function(wrap_pyfunction!(close_log_bridge, m)?)?;
    Ok(())
}

/// A process-wide logger for Rust tests: keeps every record, so a test can look for its
/// own (tests run in parallel: match on something unique to the test, a port say).
#[cfg(test)]
pub(crate) mod capture {
    use log::{Level, LevelFilter, Log, Metadata, Record};
    use std::sync::{Mutex, Once};

    /// One record: level, target, message.
    pub type Entry = (Level, String, String);

    static RECORDS: Mutex<Vec<Entry>> = Mutex::new(Vec::new());
    static INSTALL: Once = Once::new();

    struct Capture;

    impl Log for Capture {
        fn enabled(&self, _: &Metadata) -> bool {
            true
        }
        fn log(&self, r: &Record) {
            RECORDS
                .lock()
                .unwrap()
                .push((r.level(), r.target().to_owned(), r.args().to_string()));
        }
        fn flush(&self) {}
    }

    /// Starts capturing (idempotent).
    pub fn install() {
        INSTALL.call_once(|| {
            log::set_boxed_logger(Box::new(Capture)).expect("no other logger in tests");
            log::set_max_level(LevelFilter::Trace);
        });
    }

    /// The records so far whose message contains `needle`.
    pub fn matching(needle: &str) -> Vec<Entry> {
        RECORDS
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, _, m)| m.contains(needle))
            .cloned()
            .collect()
    }
}
