//! The data plane of the ring all-reduce: the links to the ring neighbours
//! (`links.rs`) and the reduce-scatter + all-gather over them (`allreduce.rs`).

pub mod allreduce;
pub mod links;

pub use allreduce::{ring_all_reduce, ReduceSpec, ReduceStats};
pub use links::RingLinks;
