//! pccl's Rust core. The `#[pymodule]` below only re-exports; the work lives in plain
//! Rust modules with their own tests.

pub mod error;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
pub mod hash;
pub mod net;
pub(crate) mod pod;
pub mod py;
pub mod quant;
pub mod reduce;
pub mod ring;
pub mod runtime;
pub mod sparse;
#[cfg(test)]
mod testutil;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // First, so that everything after it may log.
    py::logging::register(m)?;
    py::register(m)?;
    py::errors::register(m)?;
    py::hash::register(m)?;
    py::transfer::register(m)?;
    py::sparse::register(m)?;
    py::secure::register(m)?;
    py::identity::register(m)?;
    m.add_class::<py::node::PyP2PNode>()?;
    m.add_class::<py::ring::RingOp>()?;
    Ok(())
}
