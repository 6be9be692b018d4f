//! The data plane of the ring all-reduce: the links to the ring neighbours
//! (`links.rs`), the reduce-scatter + all-gather over them (`allreduce.rs`), the
//! assembly of a peer's ring and its ops out of a node's pools (`assembly.rs`), and the
//! same reduction computed in one process (`star.rs`) and the ring all-gather
//! (`gather.rs`: every peer gets every peer's bytes). Small collectives run on the
//! mesh instead (`mesh.rs`: recursive doubling over links to log2(k) partners).

pub mod allreduce;
pub mod assembly;
pub mod gather;
#[cfg(test)]
mod gather_tests;
pub mod links;
pub mod mesh;
mod pieces;
pub mod star;
#[cfg(test)]
mod tests;

pub use allreduce::{ring_all_reduce, ReduceSpec, ReduceStats};
pub use assembly::{Ring, RingOp};
pub use links::LinkConfig;
pub use links::RingLinks;
pub use star::star_all_reduce;
