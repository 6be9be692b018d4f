//! The only pyo3-aware code: exceptions, and thin handles over the Rust core.

pub mod errors;
pub mod fetch;
pub mod hash;
pub mod logging;
pub mod node;
pub mod ring;
pub mod secure;
pub mod transfer;
