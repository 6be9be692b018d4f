//! The one error type of the Rust core. `py/errors.rs` maps it onto the Python
//! exception classes once; nothing else in the core knows about Python.

use std::io;

#[derive(Debug, Clone, thiserror::Error)]
pub enum CoreError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    InvalidUsage(String),
    #[error("{0}")]
    PeerConnection(String),
    #[error("{0}")]
    Authentication(String),
    /// A node's identity was refused: its certificate (none, not signed by a trusted run
    /// key, expired, revoked, wrong group) or its key (not the one the roster names).
    #[error("{0}")]
    Identity(String),
    #[error("{0}")]
    Protocol(String),
    #[error("{0}")]
    Aborted(String),
}

impl CoreError {
    /// Wrap an I/O error with what we were doing and with whom.
    pub fn io(context: impl std::fmt::Display, err: io::Error) -> Self {
        CoreError::PeerConnection(format!("{context}: {err}"))
    }
}

pub type CoreResult<T> = Result<T, CoreError>;
