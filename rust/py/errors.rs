//! Python exception classes, created here once and re-exported by `pccl/errors.py`,
//! and the single `CoreError -> PyErr` conversion.

use crate::error::CoreError;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    pccl,
    PCCLError,
    PyException,
    "Base class of every pccl error."
);
create_exception!(
    pccl,
    InvalidArgumentError,
    PCCLError,
    "An argument is invalid (dtype, layout, size, value)."
);
create_exception!(
    pccl,
    InvalidUsageError,
    PCCLError,
    "The call is not valid in the current state (or disagrees with other peers)."
);
create_exception!(
    pccl,
    TooFewPeersError,
    PCCLError,
    "The operation cannot run with this few peers."
);
create_exception!(
    pccl,
    MasterConnectionError,
    PCCLError,
    "The master could not be reached or the connection to it was lost."
);
create_exception!(
    pccl,
    PeerConnectionError,
    PCCLError,
    "A peer-to-peer link failed, timed out or the peer died."
);
create_exception!(
    pccl,
    NoSharedStateAvailableError,
    PCCLError,
    "No peer holds the requested shared state."
);
create_exception!(
    pccl,
    PendingAsyncOpsError,
    PCCLError,
    "Asynchronous operations are still in flight."
);
create_exception!(
    pccl,
    UpdateTopologyFailedError,
    PCCLError,
    "update_topology() could not complete."
);
create_exception!(
    pccl,
    TopologyOptimizationFailedError,
    PCCLError,
    "optimize_topology() could not complete."
);
create_exception!(
    pccl,
    RevisionIncrementViolationError,
    PCCLError,
    "A shared-state revision did not advance by exactly one."
);
create_exception!(
    pccl,
    AuthenticationError,
    PCCLError,
    "The shared secrets differ (or one side has none)."
);
create_exception!(
    pccl,
    IdentityError,
    AuthenticationError,
    "A node's identity was refused: its certificate (none, not signed by a trusted run key, expired, revoked, wrong group) or its key (not the one the master's roster names for that peer). The message names the key's fingerprint."
);
create_exception!(
    pccl,
    ProtocolError,
    PCCLError,
    "The remote end sent something that is not valid pccl protocol."
);
create_exception!(pccl, CollectiveAbortedError, PCCLError, "The collective was called off before it ran because other peers of the group called update_topology(); call update_topology() and retry.");

impl From<CoreError> for PyErr {
    fn from(e: CoreError) -> PyErr {
        let msg = e.to_string();
        match e {
            CoreError::InvalidArgument(_) => InvalidArgumentError::new_err(msg),
            CoreError::InvalidUsage(_) => InvalidUsageError::new_err(msg),
            CoreError::PeerConnection(_) | CoreError::Aborted(_) => {
                PeerConnectionError::new_err(msg)
            }
            CoreError::Authentication(_) => AuthenticationError::new_err(msg),
            CoreError::Identity(_) => IdentityError::new_err(msg),
            CoreError::Protocol(_) => ProtocolError::new_err(msg),
        }
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("PCCLError", py.get_type::<PCCLError>())?;
    m.add(
        "InvalidArgumentError",
        py.get_type::<InvalidArgumentError>(),
    )?;
    m.add("InvalidUsageError", py.get_type::<InvalidUsageError>())?;
    m.add("TooFewPeersError", py.get_type::<TooFewPeersError>())?;
    m.add(
        "MasterConnectionError",
        py.get_type::<MasterConnectionError>(),
    )?;
    m.add("PeerConnectionError", py.get_type::<PeerConnectionError>())?;
    m.add(
        "NoSharedStateAvailableError",
        py.get_type::<NoSharedStateAvailableError>(),
    )?;
    m.add(
        "PendingAsyncOpsError",
        py.get_type::<PendingAsyncOpsError>(),
    )?;
    m.add(
        "UpdateTopologyFailedError",
        py.get_type::<UpdateTopologyFailedError>(),
    )?;
    m.add(
        "TopologyOptimizationFailedError",
        py.get_type::<TopologyOptimizationFailedError>(),
    )?;
    m.add(
        "RevisionIncrementViolationError",
        py.get_type::<RevisionIncrementViolationError>(),
    )?;
    m.add("AuthenticationError", py.get_type::<AuthenticationError>())?;
    m.add("IdentityError", py.get_type::<IdentityError>())?;
    m.add("ProtocolError", py.get_type::<ProtocolError>())?;
    m.add(
        "CollectiveAbortedError",
        py.get_type::<CollectiveAbortedError>(),
    )?;
    Ok(())
}
