//! `P2PNode`: the Python handle of a peer's p2p endpoint. Every network method returns
//! an awaitable that runs on tokio with the GIL released.

use crate::error::{CoreError, CoreResult};
use crate::net::handshake::Purpose;
use crate::net::identity::{Identity, PublicKey};
use crate::net::node::{Inbound, Route};
use crate::net::{Node, NodeConfig};
use crate::py::future_into_py;
use crate::py::identity::PyIdentity;
use crate::ring::Ring;
use pyo3::prelude::*;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// Scratch memory kept for reuse per peer (freed buffers beyond this are released).
const SCRATCH_CACHE_BYTES: usize = 1 << 30;

#[pyclass(name = "P2PNode", module = "pccl._core", frozen)]
pub struct PyP2PNode {
    pub(crate) node: Arc<Node>,
    /// The ring links of the current epoch (if this peer is in a ring of two or more)
    /// and the scratch buffers recycled between collectives.
    pub(crate) ring: Arc<Ring>,
}

pub(crate) async fn resolve(addr: &str) -> Result<SocketAddr, CoreError> {
    tokio::net::lookup_host(addr)
        .await
        .map_err(|e| CoreError::InvalidArgument(format!("cannot resolve {addr:?}: {e}")))?
        .next()
        .ok_or_else(|| CoreError::InvalidArgument(format!("{addr:?} resolves to no address")))
}

/// Longest span of seconds taken from Python (about 31 years: "never" for any run),
/// far below where deadline arithmetic (`Instant + Duration`) would overflow.
pub(crate) const MAX_SECONDS: f64 = 1e9;

/// A span of seconds from Python: finite, non-negative and at most `MAX_SECONDS`, or an
/// `InvalidArgumentError` (`Duration::from_secs_f64` would panic on the rest).
pub(crate) fn seconds(name: &str, v: f64) -> CoreResult<Duration> {
    // Written so that NaN fails too.
    if !(0.0..=MAX_SECONDS).contains(&v) {
        return Err(CoreError::InvalidArgument(format!(
            "{name} must be a number of seconds between 0 and {MAX_SECONDS:e}, got {v}"
        )));
    }
    Ok(Duration::from_secs_f64(v))
}

#[pymethods]
impl PyP2PNode {
    /// Binds a listener on `host:port` (port 0: ephemeral) and starts accepting.
    /// Streams are encrypted unless `insecure` (clear text; every peer must agree), the
    /// handshakes made as `identity` (None: a fresh key that checks no certificates).
    #[staticmethod]
    #[pyo3(signature = (peer_id, host="127.0.0.1", port=0, secret=None, handshake_timeout=5.0, connect_timeout=5.0, insecure=false, identity=None))]
    #[allow(clippy::too_many_arguments)]
    fn bind<'py>(
        py: Python<'py>,
        peer_id: u64,
        host: &str,
        port: u16,
        secret: Option<Vec<u8>>,
        handshake_timeout: f64,
        connect_timeout: f64,
        insecure: bool,
        identity: Option<PyRef<'py, PyIdentity>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        crate::runtime::init();
        let cfg = NodeConfig {
            peer_id,
            secret,
            identity: identity.map_or_else(Identity::ephemeral, |i| i.inner.clone()),
            handshake_timeout: seconds("handshake_timeout", handshake_timeout)?,
            connect_timeout: seconds("connect_timeout", connect_timeout)?,
            insecure,
        };
        let addr = format!("{host}:{port}");
        future_into_py(py, async move {
            let addr = resolve(&addr).await?;
            let node = Node::bind(cfg, addr).await?;
            Ok(PyP2PNode {
                node,
                ring: Arc::new(Ring::new(SCRATCH_CACHE_BYTES)),
            })
        })
    }

    /// The port the listener is bound to.
    #[getter]
    fn port(&self) -> u16 {
        self.node.local_addr().port()
    }

    /// The ports the sending side of hole-punched ring links connects from (the one of
    /// a link of epoch `e` is `[e % len]`).
    #[getter]
    fn punch_ports(&self) -> Vec<u16> {
        self.node.punch_addrs().iter().map(|a| a.port()).collect()
    }

    #[getter]
    fn peer_id(&self) -> u64 {
        self.node.peer_id()
    }

    /// Sets the id this node answers for (known once the master welcomed the peer).
    fn set_peer_id(&self, peer_id: u64) {
        self.node.set_peer_id(peer_id)
    }

    /// The run's secret was rotated: dial with `secret` from now on, and still accept
    /// (and offer) the older secrets of `also` (at most 3). A node without a secret, or in
    /// clear text, cannot be given one this way (`InvalidUsageError`).
    #[pyo3(signature = (secret, also=Vec::new()))]
    fn set_secrets(&self, secret: Option<Vec<u8>>, also: Vec<Vec<u8>>) -> PyResult<()> {
        crate::py::secure::psks_also(secret.is_some(), &also)?;
        Ok(self.node.set_secrets(secret.as_deref(), &also)?)
    }

    /// Learns peers' static keys from the master's roster ({peer id: 32-byte key}): a
    /// stream to or from peer N must prove it holds N's key.
    fn set_peer_keys(&self, keys: std::collections::HashMap<u64, Vec<u8>>) -> PyResult<()> {
        let keys = keys
            .into_iter()
            .map(|(id, k)| {
                PublicKey::try_from(k.as_slice())
                    .map(|k| (id, k))
                    .map_err(|_| {
                        CoreError::InvalidArgument(format!("peer {id}'s key is not 32 bytes"))
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(self.node.set_peer_keys(&keys)?)
    }

    /// Dials `pool_size` authenticated streams to peer `to` for `epoch`. `route`:
    /// "direct" (to `addr`), "reverse" (peer `to` dials us with `token`; `addr` unused),
    /// "relay" (through the relay at `addr` with `token`) or "punch" (one hole-punched
    /// connection to `addr`, else the relay at `relay`). `mesh`: the pool is a link of
    /// the mesh all-reduce, not the ring's.
    #[pyo3(signature = (addr, to, epoch, pool_size, route="direct", token=None, relay=None, mesh=false))]
    #[allow(clippy::too_many_arguments)]
    fn connect_pool<'py>(
        &self,
        py: Python<'py>,
        addr: String,
        to: u64,
        epoch: u64,
        pool_size: u16,
        route: &str,
        token: Option<Vec<u8>>,
        relay: Option<String>,
        mesh: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let node = self.node.clone();
        let kind = route.to_owned();
        let purpose = if mesh { Purpose::Mesh } else { Purpose::Ring };
        future_into_py(py, async move {
            let sock = if addr.is_empty() {
                None
            } else {
                Some(resolve(&addr).await?)
            };
            let relay = match relay {
                Some(r) => Some(resolve(&r).await?),
                None => None,
            };
            let route = Route::parse(&kind, sock, token.as_deref().unwrap_or_default(), relay)?;
            node.connect_pool_via(route, to, epoch, pool_size, purpose)
                .await?;
            Ok(())
        })
    }

    /// The receiving side of a ring edge whose sender cannot dial us: opens the
    /// sender's pool of streams, "reverse" (dialing the sender at `addr`) or "relay"
    /// (through the relay at `addr`), with `token`, and accepts the sender's
    /// handshakes on them.
    /// With `stream`, that one stream only (a relayed transfer stream). "punch": one
    /// hole-punched connection to the sender at `addr`, else the relay at `relay`.
    #[pyo3(signature = (route, addr, token, stream=None, relay=None))]
    fn open_inbound<'py>(
        &self,
        py: Python<'py>,
        route: String,
        addr: String,
        token: Vec<u8>,
        stream: Option<u16>,
        relay: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let node = self.node.clone();
        future_into_py(py, async move {
            let sock = resolve(&addr).await?;
            let relay = match relay {
                Some(r) => Some(resolve(&r).await?),
                None => None,
            };
            node.open_inbound(Inbound::parse(&route, sock, &token, relay)?, stream)
                .await?;
            Ok(())
        })
    }

    /// Shared-state transfers from peer `to` go through the relay at `relay` with
    /// `token` (a holder behind NAT); an empty `relay` dials it directly again.
    fn set_transfer_relay<'py>(
        &self,
        py: Python<'py>,
        to: u64,
        relay: String,
        token: Vec<u8>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let node = self.node.clone();
        future_into_py(py, async move {
            if relay.is_empty() {
                node.set_transfer_relay(to, None);
                return Ok(());
            }
            let sock = resolve(&relay).await?;
            let token: [u8; crate::net::node::TOKEN_LEN] = token
                .as_slice()
                .try_into()
                .map_err(|_| CoreError::InvalidArgument("a relay token has 16 bytes".into()))?;
            node.set_transfer_relay(to, Some((sock, token)));
            Ok(())
        })
    }

    /// Drops pools of epochs before `epoch` and refuses them from now on.
    fn retain_from_epoch(&self, epoch: u64) {
        self.node.retain_from_epoch(epoch)
    }

    /// Reverse and punch streams held by the listener: (those kept for a link of ours
    /// that waits for them, those of links not asked for yet). For tests and diagnosis.
    fn parked(&self) -> (usize, usize) {
        self.node.parked_counts()
    }

    /// Stops the listener and all tasks and drops every stream. Idempotent.
    fn close<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let node = self.node.clone();
        let ring = self.ring.clone();
        future_into_py(py, async move {
            ring.close().await; // the ring links and the mesh
            node.close().await;
            Ok(())
        })
    }
}

impl Drop for PyP2PNode {
    fn drop(&mut self) {
        // A node dropped without close() must not keep listening.
        self.node.cancel_token().cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_refuses_what_duration_would_panic_on() {
        assert_eq!(seconds("t", 0.0).unwrap(), Duration::ZERO);
        assert_eq!(seconds("t", -0.0).unwrap(), Duration::ZERO);
        assert_eq!(seconds("t", 2.5).unwrap(), Duration::from_millis(2500));
        assert_eq!(
            seconds("t", MAX_SECONDS).unwrap(),
            Duration::from_secs(MAX_SECONDS as u64)
        );
        for bad in [
            -1.0,
            -1e-9,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            MAX_SECONDS * 1.5,
            1e300,
        ] {
            match seconds("io_timeout", bad) {
                Err(CoreError::InvalidArgument(msg)) => {
                    assert!(msg.starts_with("io_timeout must be"), "{msg}")
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
        // The largest accepted span still makes a deadline without overflowing.
        let _ = std::time::Instant::now() + seconds("t", MAX_SECONDS).unwrap();
    }
}
