//! A peer's p2p endpoint: one listener on an ephemeral port, the authenticated
//! streams it accepted (filed by sender, epoch and purpose), and the pools it dialed.
//!
//! Every stream is encrypted and integrity-protected (`secure/`, keyed by the shared
//! secret when there is one) before the HMAC handshake (`handshake.rs`) runs inside it;
//! `NodeConfig::insecure` opts out (clear text; both ends must agree, a mismatch fails
//! the handshake with `CoreError::Authentication`).
//!
//! Peers behind NAT: a stream need not be dialed by the side that sends on it. The
//! master picks a `Route` for each ring edge: `Direct` (dial the neighbour), `Reverse`
//! (the neighbour cannot be dialed; it dials us with a token and we take that TCP
//! stream as if we had dialed it) or `Relay` (both ends dial the relay on the master's
//! port with a token and it splices them). Whoever opened the TCP connection, the
//! sending side runs the dialing handshakes and the receiving side the accepting ones
//! (`open_inbound`), so the encryption stays end to end. Reverse and punched streams
//! reach our listener before any authentication; they wait for their link in a
//! `ParkingLot` that strangers cannot fill for honest links.
//!
//! The listener also answers the master's reachability check (`REACH_MAGIC`), inside a
//! secure handshake in which it proves its key (`Node::echo_reach`).
//!
//! Every task the node spawns is tracked and cancelled by `close()`.
//!
//! The parts: `accept.rs` (the listener's side: what a connection's first frame says
//! it is, the accepting handshakes, the reachability check), `routes.rs` (how a ring
//! edge's TCP streams are opened: `Route`, `Inbound`, reverse dials, the relay, hole
//! punching), `parking.rs` (the `ParkingLot` where reverse and punched streams wait for
//! their link), `pools.rs` (pools of streams by peer, epoch and purpose, dialed and
//! accepted, and the idle transfer streams kept between fetches). Their records all log
//! under this module's target (`LOG`: the Python logger `pccl._core.net.node`).

use crate::error::{CoreError, CoreResult};
use crate::net::identity::{fingerprint_hex, Identity, PublicKey};
use crate::net::stream::{P2PStream, Transport};
use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

mod accept;
mod parking;
mod pools;
mod routes;
#[cfg(test)]
mod tests;

use parking::ParkingLot;
pub use pools::PoolKey;
use pools::{Pool, TransferRelay};
pub use routes::{Inbound, Route};

/// The target of every record the node logs, whichever file logs it: the Python logger
/// `pccl._core.net.node`, a name users filter on (`pccl/_logging.py`).
const LOG: &str = module_path!();

/// Most streams a single pool may have; more is a misuse (or an attack).
pub const MAX_POOL: u16 = 64;
/// Most bytes one bandwidth probe stream may send (a bound, not a target).
pub const MAX_PROBE_BYTES: u64 = 1 << 30;

/// First frame of the master's reachability check: `REACH_MAGIC | token`, answered with
/// the token (one frame), then closed.
pub const REACH_MAGIC: &[u8; 8] = b"PCCLRCH\x01";
/// First frame of a reverse stream (see `Route::Reverse`): `REVERSE_MAGIC | token |
/// stream u16`.
pub const REVERSE_MAGIC: &[u8; 8] = b"PCCLREV\x01";
/// First frame on the relay (the master's port): `RELAY_MAGIC | token | stream u16`.
pub const RELAY_MAGIC: &[u8; 8] = b"PCCLRLY\x01";
/// First frame each way on a hole-punched connection: `PUNCH_MAGIC | token | role u8`
/// (0: the sender of the ring link, 1: its receiver).
pub const PUNCH_MAGIC: &[u8; 8] = b"PCCLPCH\x01";
/// Ports held for sending hole-punched links (see `Node::punch_addrs`).
pub const PUNCH_PORTS: usize = 4;
/// How long both ends of a hole-punched link try before they fall back to the relay.
pub const PUNCH_TIMEOUT: Duration = Duration::from_secs(5);
pub const TOKEN_LEN: usize = 16;
/// Parked punch connections use stream numbers from here (+ the remote's role).
const PUNCH_SLOT: u16 = 0xFF00;
/// Streams whose token no link here waits for yet, kept at most (see `ParkingLot`).
const MAX_EARLY: usize = 128;
/// Of those, from any one source address at most.
const MAX_EARLY_PER_SOURCE: usize = 16;
/// How long such a stream is kept for a link that has not asked for it yet.
const EARLY_KEEP: Duration = Duration::from_secs(3);
/// A refused reverse dial (the sender hung up before a word) is dialed again after this
/// pause, doubling up to `REDIAL_PAUSE_MAX`, while the link's deadline allows.
const REDIAL_PAUSE: Duration = Duration::from_millis(50);
const REDIAL_PAUSE_MAX: Duration = Duration::from_secs(1);

/// Whether `e` is the other end hanging up (a reset where a clean close was meant).
fn hung_up(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::UnexpectedEof
    )
}

/// Closing `tcp` will reset it instead of lingering in TIME_WAIT (a zero linger time
/// never blocks, which is what tokio's deprecation of `set_linger` is about).
#[allow(deprecated)]
fn zero_linger(tcp: &TcpStream) {
    let _ = tcp.set_linger(Some(Duration::ZERO));
}

/// A TCP socket for `addr`'s family with SO_REUSEADDR (it may bind over connections
/// left in TIME_WAIT).
fn reuseaddr_socket(addr: SocketAddr) -> io::Result<TcpSocket> {
    let s = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    s.set_reuseaddr(true)?;
    Ok(s)
}

/// A TCP socket for `addr`'s family with SO_REUSEADDR and SO_REUSEPORT, so that the
/// listener and the hole-punching connects can share the listening port.
fn reusable_socket(addr: SocketAddr) -> io::Result<TcpSocket> {
    let s = reuseaddr_socket(addr)?;
    #[cfg(unix)]
    s.set_reuseport(true)?;
    Ok(s)
}

/// Fails with `AddrInUse` if a listener already holds `addr`'s port (0: any port, no
/// check). The p2p listener sets SO_REUSEPORT (hole punching connects from its port), so
/// a second process of the same user binding the same port would succeed, and the
/// kernel would then split incoming connections between the two listeners: half of the
/// dials to either peer would reach the other one (seen in a churn soak where two
/// workers were handed the same port). A socket with SO_REUSEADDR alone may bind over
/// connections left in TIME_WAIT, not over a listener.
fn port_not_listened_on(addr: SocketAddr) -> io::Result<()> {
    if addr.port() == 0 {
        return Ok(());
    }
    reuseaddr_socket(addr)?.bind(addr)
}

#[derive(Clone)]
pub struct NodeConfig {
    pub peer_id: u64,
    pub secret: Option<Vec<u8>>,
    /// This node's static key and certificate, and what it trusts (`identity.rs`).
    pub identity: Arc<Identity>,
    /// Bound on a whole handshake, on both ends.
    pub handshake_timeout: Duration,
    /// Bound on establishing one TCP connection.
    pub connect_timeout: Duration,
    /// Clear-text p2p streams (no encryption, no integrity protection beyond TCP's).
    /// Off by default; every peer must use the same setting.
    pub insecure: bool,
}

impl std::fmt::Debug for NodeConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeConfig")
            .field("peer_id", &self.peer_id)
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .field("identity", &self.identity)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("insecure", &self.insecure)
            .finish()
    }
}

pub struct Node {
    cfg: NodeConfig,
    /// How streams are protected (the PSKs derived from the secrets): replaced whole
    /// when the run's secret is rotated (`set_secrets`); each stream takes a copy.
    transport: std::sync::RwLock<Transport>,
    /// The static key of each peer, from the master's roster: a stream from (or to)
    /// peer N must prove it holds N's key. Bounded by `MAX_ROSTER`.
    keys: Mutex<Roster>,
    /// Known only after the master welcomed us; the listener binds before that.
    peer_id: AtomicU64,
    id_known: Notify,
    local_addr: SocketAddr,
    /// Reserve the ports of `punch_addrs` (bound, never listening) until `close()`.
    punch_sockets: Mutex<Vec<TcpSocket>>,
    punch_addrs: Vec<SocketAddr>,
    inbound: Mutex<HashMap<PoolKey, Pool>>,
    outbound: Mutex<HashMap<PoolKey, Vec<P2PStream>>>,
    /// Streams of epochs older than this are refused and dropped.
    min_epoch: Mutex<u64>,
    inbound_changed: Notify,
    cancel: CancellationToken,
    tracker: TaskTracker,
    /// Tensors this peer serves to others during a shared-state sync.
    pub transfers: crate::net::transfer::TransferRegistry,
    /// Transfer streams this peer dialed that finished a fetch cleanly, by source, for
    /// the next fetch from the same source (a dial plus handshake costs round trips).
    idle_transfers: Mutex<HashMap<(SocketAddr, u64), Vec<P2PStream>>>,
    /// Reverse and punch streams received, by (token, stream), until their link takes
    /// them (see `ParkingLot`).
    parked: Mutex<ParkingLot<TcpStream>>,
    parked_changed: Notify,
    /// Holders behind NAT: transfer streams to them go through this relay with this
    /// token, each stream numbered by the counter (the relay pairs by token and number).
    transfer_relays: Mutex<HashMap<u64, TransferRelay>>,
}

/// Most peer keys a node keeps from the roster (more than any group has peers).
pub const MAX_ROSTER: usize = 1 << 16;

/// The peers' static keys the master named, with the order they were learned in.
#[derive(Default)]
struct Roster {
    keys: HashMap<u64, (PublicKey, u64)>,
    seq: u64,
}

impl Node {
    /// Binds the listener and starts accepting.
    pub async fn bind(cfg: NodeConfig, addr: SocketAddr) -> CoreResult<Arc<Node>> {
        let listener = port_not_listened_on(addr)
            .and_then(|()| reusable_socket(addr))
            .and_then(|s| {
                s.bind(addr)?;
                s.listen(1024)
            })
            .map_err(|e| CoreError::io(format!("binding the p2p listener on {addr}"), e))?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| CoreError::io("reading the p2p listener address", e))?;
        // Ports held for the sending side of hole-punched links: a link and the one back
        // between the same two peers (a ring of two) must not share both ports, and a
        // round that punches the same pair again while the last round's link is still
        // open uses the next port (`PUNCH_PORTS`, by epoch).
        let mut punch_sockets = Vec::with_capacity(PUNCH_PORTS);
        let mut punch_addrs = Vec::with_capacity(PUNCH_PORTS);
        for _ in 0..PUNCH_PORTS {
            let s = reusable_socket(addr)
                .and_then(|s| {
                    s.bind(SocketAddr::new(local_addr.ip(), 0))?;
                    Ok(s)
                })
                .map_err(|e| CoreError::io("binding a p2p punch port", e))?;
            punch_addrs.push(
                s.local_addr()
                    .map_err(|e| CoreError::io("reading a p2p punch port", e))?,
            );
            punch_sockets.push(s);
        }
        let node = Arc::new(Node {
            punch_sockets: Mutex::new(punch_sockets),
            punch_addrs,
            peer_id: AtomicU64::new(cfg.peer_id),
            id_known: Notify::new(),
            transport: std::sync::RwLock::new(Transport::new(
                cfg.secret.as_deref(),
                cfg.insecure,
                cfg.identity.clone(),
            )),
            keys: Mutex::new(Roster::default()),
            cfg,
            local_addr,
            inbound: Mutex::new(HashMap::new()),
            outbound: Mutex::new(HashMap::new()),
            min_epoch: Mutex::new(0),
            inbound_changed: Notify::new(),
            cancel: CancellationToken::new(),
            tracker: TaskTracker::new(),
            transfers: Default::default(),
            idle_transfers: Mutex::new(HashMap::new()),
            parked: Mutex::new(ParkingLot::new()),
            parked_changed: Notify::new(),
            transfer_relays: Mutex::new(HashMap::new()),
        });
        let weak = Arc::downgrade(&node);
        let cancel = node.cancel.clone();
        node.tracker.spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = cancel.cancelled() => break,
                    r = listener.accept() => r,
                };
                let Some(node) = weak.upgrade() else { break };
                match accepted {
                    Ok((stream, remote)) => {
                        let n = node.clone();
                        node.tracker
                            .spawn(async move { n.handle_incoming(stream, remote).await });
                    }
                    Err(e) => {
                        log::warn!("peer {}: p2p accept failed: {e}", node.peer_id());
                        // Out of file descriptors and similar: back off instead of spinning.
                        tokio::select! {
                            _ = cancel.cancelled() => break,
                            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                        }
                    }
                }
            }
        });
        Ok(node)
    }

    /// A copy of how streams are protected now (a rotation may replace it meanwhile).
    fn transport(&self) -> Transport {
        self.transport.read().unwrap().clone()
    }

    /// The run's secret was rotated: streams are dialed with `secret` from now on, and
    /// streams keyed by an older secret of `also` are still accepted (and offered).
    pub fn set_secrets(&self, secret: Option<&[u8]>, also: &[Vec<u8>]) -> CoreResult<()> {
        let next = self.transport().with_secrets(secret, also)?;
        *self.transport.write().unwrap() = next;
        Ok(())
    }

    /// Learns peers' static keys from the master's roster (replacing what it said of
    /// the same ids before). Past `MAX_ROSTER` ids the ones learned longest ago are
    /// forgotten (ids only grow over a run; a forgotten peer's streams are refused
    /// until the master names it again).
    pub fn set_peer_keys(&self, keys: &[(u64, PublicKey)]) -> CoreResult<()> {
        let mut held = self.keys.lock().unwrap();
        for (id, key) in keys {
            held.seq += 1;
            let seq = held.seq;
            held.keys.insert(*id, (*key, seq));
        }
        while held.keys.len() > MAX_ROSTER {
            let oldest = held
                .keys
                .iter()
                .min_by_key(|(_, (_, s))| *s)
                .map(|(id, _)| *id);
            if let Some(id) = oldest {
                held.keys.remove(&id);
            }
        }
        Ok(())
    }

    /// This node's static public key.
    pub fn public_key(&self) -> PublicKey {
        *self.cfg.identity.key().public()
    }

    /// The roster's key of peer `id` (None in clear text, where there are no keys).
    fn expected_key(&self, id: u64) -> CoreResult<Option<PublicKey>> {
        if !self.transport().is_secure() {
            return Ok(None);
        }
        match self.keys.lock().unwrap().keys.get(&id) {
            Some((k, _)) => Ok(Some(*k)),
            None => Err(CoreError::Identity(format!(
                "the master's roster names no key for peer {id}: its streams cannot be \
                 authenticated"
            ))),
        }
    }

    /// Whether `stream` proved the key the roster names for peer `id` (when the roster
    /// knows it; `strict`: also when it does not).
    fn stream_is(&self, stream: &P2PStream, id: u64, strict: bool) -> Result<(), String> {
        let Some(remote) = stream.remote() else {
            return Ok(());
        };
        match self.keys.lock().unwrap().keys.get(&id) {
            Some((k, _)) if *k == remote.key => Ok(()),
            Some((k, _)) => Err(format!(
                "it says it is peer {id} but holds key {}, not peer {id}'s key {}",
                remote.fingerprint(),
                fingerprint_hex(k)
            )),
            None if strict => Err(format!(
                "it says it is peer {id} (key {}), whom the master's roster does not name",
                remote.fingerprint()
            )),
            None => Ok(()),
        }
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The ports the sending side of hole-punched links connects from: the one of a
    /// link of `epoch` is `[epoch % PUNCH_PORTS]`.
    pub fn punch_addrs(&self) -> &[SocketAddr] {
        &self.punch_addrs
    }

    pub fn peer_id(&self) -> u64 {
        self.peer_id.load(Ordering::Acquire)
    }

    pub fn set_peer_id(&self, id: u64) {
        self.peer_id.store(id, Ordering::Release);
        self.id_known.notify_waiters();
    }

    /// Our id, waiting for it if the master has not told us yet (a neighbour may dial
    /// us a moment before our own welcome message has been processed).
    async fn known_peer_id(&self) -> u64 {
        loop {
            let notified = self.id_known.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let id = self.peer_id();
            if id != 0 {
                return id;
            }
            notified.await;
        }
    }

    pub fn config(&self) -> &NodeConfig {
        &self.cfg
    }

    pub fn cancel_token(&self) -> &CancellationToken {
        &self.cancel
    }

    pub fn tracker(&self) -> &TaskTracker {
        &self.tracker
    }

    /// Stops the listener and every task; drops all streams. Idempotent.
    pub async fn close(&self) {
        self.cancel.cancel();
        self.tracker.close();
        self.tracker.wait().await;
        self.parked.lock().unwrap().clear();
        self.punch_sockets.lock().unwrap().clear();
        self.inbound.lock().unwrap().clear();
        self.outbound.lock().unwrap().clear();
        self.drop_idle_transfers();
    }
}
