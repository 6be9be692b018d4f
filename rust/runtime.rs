//! The tokio runtime shared by every node in the process, and the asyncio bridge.
//!
//! The runtime is process-wide (pyo3-async-runtimes owns it); peers are not: each
//! `P2PNode` carries its own state, so many peers can live in one process.

use std::sync::Once;

static INIT: Once = Once::new();

/// Configures the runtime before its first use: named worker threads, all cores.
pub fn init() {
    INIT.call_once(|| {
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        builder.enable_all().thread_name("pccl-tokio");
        pyo3_async_runtimes::tokio::init(builder);
    });
}
