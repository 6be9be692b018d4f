//! Peer-to-peer networking: framing, the authenticated handshake, the listener and the
//! pools of TCP streams between ring neighbours. No pyo3 in here.

pub mod fetch;
pub mod frame;
pub mod handshake;
pub mod identity;
pub mod node;
pub mod secure;
pub mod stream;
pub mod transfer;

pub use node::{Node, NodeConfig};
pub use stream::{P2PReadHalf, P2PStream, P2PWriteHalf};
