//! The secure handshake and record layer for asyncio callers (the master's control
//! plane): `net::secure::Handshake` and a Noise transport state, with no I/O here. The
//! bytes on the wire are those of the p2p streams (`net/secure/`).

use crate::error::CoreError;
use crate::net::identity::{GROUP_MASTER, GROUP_PEER};
use crate::net::secure::{
    self, Auth, Handshake, HandshakeFailure, MAX_PLAINTEXT, MAX_RECORD, TAG_LEN,
};
use crate::py::identity::{remote_info, PyIdentity, RemoteInfo};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use snow::StatelessTransportState;

/// What `on_frame` returns: the frame to send, the error to raise.
type Step<'py> = (Option<Bound<'py, PyBytes>>, Option<Py<PyAny>>);

/// One side of a secure handshake, driven frame by frame.
///
/// Dialer: send `hello()`, feed the reply to `on_frame`, send what it returns, feed the
/// verdict; done. Acceptor: feed the hello to `on_frame`, send the reply, feed the
/// dialer's identity message, send the verdict it returns; done.
/// `on_frame` returns `(frame_to_send_or_None, error_or_None)`: on an error, send the
/// frame first if there is one (it tells the peer why), then raise the error.
/// The PSKs of `also` (older secrets, at most `MAX_PSKS - 1`), only beside a secret.
pub fn psks_also(has_secret: bool, also: &[Vec<u8>]) -> PyResult<Vec<[u8; 32]>> {
    if also.is_empty() {
        return Ok(Vec::new());
    }
    if !has_secret || also.len() >= secure::MAX_PSKS {
        return Err(CoreError::InvalidArgument(format!(
            "older secrets are accepted only beside a secret, and at most {} of them",
            secure::MAX_PSKS - 1
        ))
        .into());
    }
    Ok(also.iter().map(|s| secure::psk_from_secret(s)).collect())
}

#[pyclass(name = "SecureHandshake", module = "pccl._core")]
pub struct PySecureHandshake {
    inner: Option<Handshake>,
}

#[pymethods]
impl PySecureHandshake {
    /// `secret`: the shared secret (mixed into Noise XXpsk3), or None (Noise XX).
    /// `also`: older secrets still accepted (and offered) while the secret is rotated.
    /// `prologue`: the context both ends must agree on. `identity`: this node's key,
    /// certificate and trust (None: a fresh key that trusts anyone). `group`: what the
    /// other end's certificate must name ("peer" or "master"). `expect`: the static key
    /// the other end must have.
    #[new]
    #[pyo3(signature = (dial, secret, prologue, identity=None, group="peer", expect=None, also=Vec::new()))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        dial: bool,
        secret: Option<&[u8]>,
        prologue: &[u8],
        identity: Option<PyRef<'_, PyIdentity>>,
        group: &str,
        expect: Option<&[u8]>,
        also: Vec<Vec<u8>>,
    ) -> PyResult<Self> {
        let group = match group {
            "peer" => GROUP_PEER,
            "master" => GROUP_MASTER,
            other => {
                return Err(CoreError::InvalidArgument(format!(
                    "group must be \"peer\" or \"master\", not {other:?}"
                ))
                .into())
            }
        };
        let expect = expect
            .map(|k| {
                k.try_into().map_err(|_| {
                    PyErr::from(CoreError::InvalidArgument(
                        "a static key is 32 bytes".into(),
                    ))
                })
            })
            .transpose()?;
        let auth = Auth {
            identity: match identity {
                Some(i) => i.inner.clone(),
                None => crate::net::identity::Identity::ephemeral(),
            },
            psk: secret.map(secure::psk_from_secret),
            also: psks_also(secret.is_some(), &also)?,
            group,
            expect,
        };
        let inner = Handshake::new(dial, auth, prologue, secure::SUITE)?;
        Ok(PySecureHandshake { inner: Some(inner) })
    }

    fn hello<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let hs = self.inner.as_mut().ok_or_else(used_up)?;
        Ok(PyBytes::new(py, &hs.hello()?))
    }

    fn on_frame<'py>(&mut self, py: Python<'py>, frame: &[u8]) -> PyResult<Step<'py>> {
        let hs = self.inner.as_mut().ok_or_else(used_up)?;
        Ok(match hs.on_frame(frame) {
            Ok(out) => (out.map(|f| PyBytes::new(py, &f)), None),
            Err(HandshakeFailure { reply, error }) => {
                self.inner = None;
                let err: PyErr = error.into();
                (
                    reply.map(|f| PyBytes::new(py, &f)),
                    Some(err.into_value(py).into_any()),
                )
            }
        })
    }

    /// True once the keys are set on both sides.
    #[getter]
    fn done(&self) -> bool {
        self.inner.as_ref().is_some_and(Handshake::is_done)
    }

    /// Who the other end proved to be, once its identity was checked (see
    /// `pccl._core.Identity.check_remote` for the tuple).
    #[getter]
    fn remote(&self) -> Option<RemoteInfo> {
        self.inner
            .as_ref()
            .and_then(|h| h.remote())
            .map(remote_info)
    }

    /// The session of a finished handshake (once).
    fn session(&mut self) -> PyResult<SecureSession> {
        let hs = self.inner.take().ok_or_else(used_up)?;
        let Some(transport) = hs.into_transport() else {
            return Err(CoreError::InvalidUsage("the secure handshake is not done".into()).into());
        };
        Ok(SecureSession {
            transport,
            read_nonce: secure::FIRST_NONCE,
            write_nonce: secure::FIRST_NONCE,
            failed: false,
        })
    }
}

fn used_up() -> PyErr {
    CoreError::InvalidUsage("this secure handshake failed or was used up".into()).into()
}

/// The record layer of one connection: `seal` turns bytes into wire records
/// (`u32 BE length | ciphertext and tag`, each at most `MAX_RECORD`), `open` one record
/// body back into bytes. A record that fails authentication (modified, injected,
/// replayed, reordered) raises ProtocolError and the session refuses everything after.
#[pyclass(module = "pccl._core")]
pub struct SecureSession {
    transport: StatelessTransportState,
    read_nonce: u64,
    write_nonce: u64,
    failed: bool,
}

#[pymethods]
impl SecureSession {
    /// Largest record body `open` accepts (the length prefix's upper bound).
    #[classattr]
    const MAX_RECORD: usize = MAX_RECORD;
    /// Smallest record body (an empty plaintext and its tag).
    #[classattr]
    const MIN_RECORD: usize = TAG_LEN;

    fn seal<'py>(&mut self, py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
        let chunks = data.len().div_ceil(MAX_PLAINTEXT).max(1);
        let total = data.len() + chunks * (4 + TAG_LEN);
        let transport = &mut self.transport;
        let mut nonce = self.write_nonce;
        let out = PyBytes::new_with(py, total, |buf| {
            let mut at = 0;
            let mut pieces = data.chunks(MAX_PLAINTEXT);
            let mut next = pieces.next().or(Some(&[][..]));
            while let Some(piece) = next {
                let len = piece.len() + TAG_LEN;
                buf[at..at + 4].copy_from_slice(&(len as u32).to_be_bytes());
                transport
                    .write_message(nonce, piece, &mut buf[at + 4..at + 4 + len])
                    .map_err(|e| CoreError::Protocol(format!("secure session: {e}")))?;
                nonce += 1;
                if nonce.is_multiple_of(secure::REKEY_INTERVAL) {
                    transport.rekey_outgoing(); // (Noise REKEY, as the p2p streams do)
                }
                at += 4 + len;
                next = pieces.next();
            }
            Ok(())
        })?;
        self.write_nonce = nonce;
        Ok(out)
    }

    fn open<'py>(&mut self, py: Python<'py>, record: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
        if self.failed {
            return Err(integrity("an earlier record failed"));
        }
        if !(TAG_LEN..=MAX_RECORD).contains(&record.len()) {
            self.failed = true;
            return Err(integrity("bad record length"));
        }
        let mut plain = vec![0u8; record.len()];
        match self
            .transport
            .read_message(self.read_nonce, record, &mut plain)
        {
            Ok(n) => {
                self.read_nonce += 1;
                if self.read_nonce.is_multiple_of(secure::REKEY_INTERVAL) {
                    self.transport.rekey_incoming();
                }
                Ok(PyBytes::new(py, &plain[..n]))
            }
            Err(_) => {
                self.failed = true;
                Err(integrity("a record did not authenticate"))
            }
        }
    }
}

fn integrity(what: &str) -> PyErr {
    CoreError::Protocol(format!(
        "secure connection: integrity check failed ({what})"
    ))
    .into()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySecureHandshake>()?;
    m.add_class::<SecureSession>()?;
    m.add(
        "SECURE_HELLO_MAGIC",
        PyBytes::new(m.py(), secure::HELLO_MAGIC),
    )?;
    m.add("CLEAR_HELLO", PyBytes::new(m.py(), secure::CLEAR_HELLO))?;
    m.add("MAX_HANDSHAKE_FRAME", secure::MAX_HANDSHAKE_FRAME)?;
    m.add(
        "STATUS_TRANSPORT_MISMATCH",
        secure::STATUS_TRANSPORT_MISMATCH,
    )?;
    Ok(())
}
