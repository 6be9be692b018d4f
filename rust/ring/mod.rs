//! The data plane of the ring all-reduce: the links to the ring neighbours
//! (`links.rs`), the reduce-scatter + all-gather over them (`allreduce.rs`), and the
//! assembly of a peer's ring and its ops out of a node's pools (`assembly.rs`).

pub mod allreduce;
pub mod assembly;
pub mod links;
#[cfg(test)]
mod tests;

pub use allreduce::{ring_all_reduce, ReduceSpec, ReduceStats};
pub use assembly::{LinkConfig, Ring, RingOp};
pub use links::RingLinks;
