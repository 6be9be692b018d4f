//! Node identities for Python (`net::identity`): a node's key, certificate, trusted run
//! keys and denylist as one shared object, and the operator's tools (`pccl ca ...`):
//! signing certificates and denylists with a run key. Bytes only: files are Python's.

use crate::error::CoreError;
use crate::net::identity::{
    self, fingerprint_hex, Cert, Denylist, Fingerprint, Identity, NodeKey, PublicKey, Remote,
    KEY_LEN,
};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::sync::Arc;

fn key32(what: &str, b: &[u8]) -> PyResult<[u8; KEY_LEN]> {
    b.try_into().map_err(|_| {
        CoreError::InvalidArgument(format!("{what} must be 32 bytes, got {}", b.len())).into()
    })
}

/// What a handshake learned of the other end, for Python: (static key, fingerprint,
/// certificate name or None, certificate groups, certificate not_after or None).
pub type RemoteInfo = (Vec<u8>, String, Option<String>, Vec<String>, Option<u64>);

pub fn remote_info(r: &Remote) -> RemoteInfo {
    match &r.cert {
        Some(c) => (
            r.key.to_vec(),
            r.fingerprint(),
            Some(c.name.clone()),
            c.groups.clone(),
            Some(c.not_after),
        ),
        None => (r.key.to_vec(), r.fingerprint(), None, Vec::new(), None),
    }
}

/// A node's static key (and certificate), the run keys it trusts and the newest
/// denylist it has seen. `Identity()` makes a fresh key with no certificate.
#[pyclass(name = "Identity", module = "pccl._core", frozen)]
pub struct PyIdentity {
    pub inner: Arc<Identity>,
}

#[pymethods]
impl PyIdentity {
    #[new]
    #[pyo3(signature = (secret_key=None, cert=None, anchors=Vec::new()))]
    fn new(
        secret_key: Option<&[u8]>,
        cert: Option<Vec<u8>>,
        anchors: Vec<Vec<u8>>,
    ) -> PyResult<Self> {
        let key = match secret_key {
            Some(k) => NodeKey::from_secret(key32("a node's secret key", k)?),
            None => NodeKey::generate(),
        };
        let anchors = anchors
            .iter()
            .map(|a| key32("a run key's public key", a))
            .collect::<PyResult<Vec<PublicKey>>>()?;
        Ok(PyIdentity {
            inner: Identity::new(key, cert, anchors)?,
        })
    }

    #[getter]
    fn public_key<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, self.inner.key().public())
    }

    #[getter]
    fn fingerprint(&self) -> String {
        fingerprint_hex(self.inner.key().public())
    }

    #[getter]
    fn cert<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.inner.cert().map(|c| PyBytes::new(py, c))
    }

    /// Whether this node asks every other end for a certificate.
    #[getter]
    fn checks_certs(&self) -> bool {
        self.inner.checks_certs()
    }

    #[getter]
    fn anchors<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyBytes>> {
        self.inner
            .anchors()
            .iter()
            .map(|a| PyBytes::new(py, a))
            .collect()
    }

    /// Installs a denylist signed by a trusted run key when it is newer than the one
    /// held: True if installed, False if not newer. IdentityError for a bad signature or
    /// an untrusted signer, InvalidArgumentError for bytes that are no denylist.
    fn install_denylist(&self, raw: &[u8]) -> PyResult<bool> {
        Ok(self.inner.install_denylist(raw)?)
    }

    /// The denylist held (its signed bytes), or None.
    #[getter]
    fn denylist<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.inner.denylist().map(|d| PyBytes::new(py, &d.raw))
    }

    #[getter]
    fn denylist_version(&self) -> u64 {
        self.inner.denylist().map_or(0, |d| d.version)
    }

    fn is_denied(&self, key: &[u8]) -> bool {
        self.inner.is_denied(key)
    }

    /// Checks another node's static key and certificate as a handshake would (for
    /// `group`): its `RemoteInfo`, or IdentityError naming its fingerprint.
    fn check_remote(&self, key: &[u8], cert: &[u8], group: &str) -> PyResult<RemoteInfo> {
        Ok(remote_info(&self.inner.check_remote(key, cert, group)?))
    }

    fn __repr__(&self) -> String {
        let cert = self
            .inner
            .cert()
            .and_then(|c| Cert::parse(c).ok())
            .map(|c| format!(", name={:?}, not_after={}", c.name, c.not_after))
            .unwrap_or_default();
        format!(
            "Identity(fingerprint={:?}{cert}, anchors={})",
            fingerprint_hex(self.inner.key().public()),
            self.inner.anchors().len()
        )
    }
}

/// The X25519 public key of a node's 32-byte secret key.
#[pyfunction]
fn node_public_key<'py>(py: Python<'py>, secret_key: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    Ok(PyBytes::new(
        py,
        &identity::x25519_public(&key32("a node's secret key", secret_key)?),
    ))
}

/// The Ed25519 public key of a run key given by its 32-byte seed.
#[pyfunction]
fn run_public_key<'py>(py: Python<'py>, seed: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    Ok(PyBytes::new(
        py,
        &identity::run_public(&key32("a run key", seed)?),
    ))
}

/// A key's fingerprint (hex of the first 16 bytes of its SHA-256).
#[pyfunction]
fn key_fingerprint(key: &[u8]) -> String {
    fingerprint_hex(key)
}

/// Signs a certificate for `node_key` with the run key `seed`.
#[pyfunction]
fn sign_cert<'py>(
    py: Python<'py>,
    seed: &[u8],
    node_key: &[u8],
    name: &str,
    groups: Vec<String>,
    not_before: u64,
    not_after: u64,
) -> PyResult<Bound<'py, PyBytes>> {
    let raw = Cert::sign(
        &key32("a run key", seed)?,
        key32("a node's public key", node_key)?,
        name,
        &groups,
        not_before,
        not_after,
    )?;
    Ok(PyBytes::new(py, &raw))
}

/// (issuer, node_key, name, groups, not_before, not_after) of a certificate.
type CertInfo = (Vec<u8>, Vec<u8>, String, Vec<String>, u64, u64);

/// What a certificate says, its signature checked against its own issuer.
#[pyfunction]
fn parse_cert(raw: &[u8]) -> PyResult<CertInfo> {
    let c = Cert::parse(raw)?;
    Ok((
        c.issuer.to_vec(),
        c.node_key.to_vec(),
        c.name,
        c.groups,
        c.not_before,
        c.not_after,
    ))
}

/// Signs a denylist (`version`, revoked keys by 16-byte fingerprint) with `seed`.
#[pyfunction]
fn sign_denylist<'py>(
    py: Python<'py>,
    seed: &[u8],
    version: u64,
    issued_at: u64,
    fingerprints: Vec<Vec<u8>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let fps = fingerprints
        .iter()
        .map(|f| {
            Fingerprint::try_from(f.as_slice()).map_err(|_| {
                CoreError::InvalidArgument("a fingerprint is 16 bytes (32 hex digits)".into())
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let raw = Denylist::sign(&key32("a run key", seed)?, version, issued_at, &fps)?;
    Ok(PyBytes::new(py, &raw))
}

/// (issuer, version, issued_at, fingerprints) of a denylist.
type DenylistInfo = (Vec<u8>, u64, u64, Vec<Vec<u8>>);

/// What a denylist says, its signature checked against its own issuer.
#[pyfunction]
fn parse_denylist(raw: &[u8]) -> PyResult<DenylistInfo> {
    let d = Denylist::parse(raw)?;
    let mut fps: Vec<Vec<u8>> = d.denied.iter().map(|f| f.to_vec()).collect();
    fps.sort();
    Ok((d.issuer.to_vec(), d.version, d.issued_at, fps))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyIdentity>()?;
    m.add_function(wrap_pyfunction!(node_public_key, m)?)?;
    m.add_function(wrap_pyfunction!(run_public_key, m)?)?;
    m.add_function(wrap_pyfunction!(key_fingerprint, m)?)?;
    m.add_function(wrap_pyfunction!(sign_cert, m)?)?;
    m.add_function(wrap_pyfunction!(parse_cert, m)?)?;
    m.add_function(wrap_pyfunction!(sign_denylist, m)?)?;
    m.add_function(wrap_pyfunction!(parse_denylist, m)?)?;
    m.add("GROUP_PEER", identity::GROUP_PEER)?;
    m.add("GROUP_MASTER", identity::GROUP_MASTER)?;
    Ok(())
}
