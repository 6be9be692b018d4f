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

use crate::error::{CoreError, CoreResult};
use crate::net::frame::write_frame;
use crate::net::handshake::{self, Purpose, StreamHello};
use crate::net::identity::{fingerprint_hex, Identity, PublicKey, GROUP_MASTER};
use crate::net::secure::{secure_accept_first, Auth};
use crate::net::stream::{read_first_frame, P2PStream, Transport, REACH_PROLOGUE};
use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

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

/// How transfer streams reach a holder behind NAT: (relay, token, streams so far).
type TransferRelay = (SocketAddr, [u8; TOKEN_LEN], u16);

/// A reverse stream waiting for its pool: (token, stream index).
type ParkKey = ([u8; TOKEN_LEN], u16);

/// How the sending side of a ring edge gets its TCP streams.
#[derive(Clone)]
pub enum Route {
    /// Dial the neighbour at this address.
    Direct(SocketAddr),
    /// The neighbour dials us (it is behind NAT and we are not), with this token.
    Reverse([u8; TOKEN_LEN]),
    /// Both ends dial the relay at this address with this token.
    Relay(SocketAddr, [u8; TOKEN_LEN]),
    /// Both ends are behind NAT: open one TCP connection by simultaneous open from our
    /// listening port to the neighbour's predicted public address (first field), with
    /// this token; if that fails, meet at the relay (second field) instead.
    Punch(SocketAddr, SocketAddr, [u8; TOKEN_LEN]),
}

// Tokens are capabilities (on the relay): logs show the route, never the token.
impl std::fmt::Debug for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Route::Direct(a) => write!(f, "direct to {a}"),
            Route::Reverse(_) => write!(f, "a reverse connection"),
            Route::Relay(a, _) => write!(f, "the relay at {a}"),
            Route::Punch(a, _, _) => write!(f, "hole punching to {a}"),
        }
    }
}

/// How the receiving side of an edge that is not `Direct` opens its TCP streams.
#[derive(Clone)]
pub enum Inbound {
    /// Dial the sender at this address (the sender's `Route::Reverse`).
    Reverse(SocketAddr, [u8; TOKEN_LEN]),
    /// Dial the relay (the sender's `Route::Relay`).
    Relay(SocketAddr, [u8; TOKEN_LEN]),
    /// The sender's `Route::Punch`: (its predicted public address, the relay, token).
    Punch(SocketAddr, SocketAddr, [u8; TOKEN_LEN]),
}

impl Route {
    /// From the names the master uses: "direct" (`addr`: the neighbour), "reverse"
    /// (`addr` unused) or "relay" (`addr`: the relay).
    pub fn parse(
        kind: &str,
        addr: Option<SocketAddr>,
        token: &[u8],
        relay: Option<SocketAddr>,
    ) -> CoreResult<Route> {
        match (kind, addr, parse_token(token), relay) {
            ("direct", Some(a), _, _) => Ok(Route::Direct(a)),
            ("reverse", _, Some(t), _) => Ok(Route::Reverse(t)),
            ("relay", Some(a), Some(t), _) => Ok(Route::Relay(a, t)),
            ("punch", Some(a), Some(t), Some(r)) => Ok(Route::Punch(a, r, t)),
            _ => Err(CoreError::InvalidArgument(format!(
                "bad p2p route {kind:?} (direct needs an address; reverse a token; relay both)"
            ))),
        }
    }
}

impl Inbound {
    /// "reverse" (`addr`: the sender) or "relay" (`addr`: the relay), with the token.
    pub fn parse(
        kind: &str,
        addr: SocketAddr,
        token: &[u8],
        relay: Option<SocketAddr>,
    ) -> CoreResult<Inbound> {
        match (kind, parse_token(token), relay) {
            ("reverse", Some(t), _) => Ok(Inbound::Reverse(addr, t)),
            ("relay", Some(t), _) => Ok(Inbound::Relay(addr, t)),
            ("punch", Some(t), Some(r)) => Ok(Inbound::Punch(addr, r, t)),
            _ => Err(CoreError::InvalidArgument(format!(
                "bad inbound p2p route {kind:?} (reverse or relay, with a {TOKEN_LEN}-byte token)"
            ))),
        }
    }
}

fn parse_token(token: &[u8]) -> Option<[u8; TOKEN_LEN]> {
    token.try_into().ok()
}

/// The token of a route frame (`MAGIC | token | ...`), its length checked by the caller.
fn frame_token(frame: &[u8]) -> [u8; TOKEN_LEN] {
    parse_token(&frame[8..8 + TOKEN_LEN]).expect("a checked route frame")
}

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

fn route_frame(magic: &[u8; 8], token: &[u8; TOKEN_LEN], stream: u16) -> Vec<u8> {
    let mut f = Vec::with_capacity(8 + TOKEN_LEN + 2);
    f.extend_from_slice(magic);
    f.extend_from_slice(token);
    f.extend_from_slice(&stream.to_be_bytes());
    f
}

/// Where reverse and punch streams wait for their link; they come before any
/// authentication, so a stranger can send any number of them with made-up tokens.
///
/// Their tokens come from the master, which hands them to both ends of a link in
/// EstablishP2P; a stranger cannot guess one. The end that waits for the link's streams
/// says so (`want`) as soon as it starts (`connect_pool_via` on a reverse route, `punch`
/// on either end), and from then on a stream with that token is kept for it (`parked`)
/// whatever strangers do: at most one per valid stream number, so at most a pool's worth
/// per wanted token, until the waiter takes it or gives up (`unwant` drops the rest).
///
/// A stream whose token nobody here wants yet is either a stranger's or an honest one
/// that beat its link (the other end processed its EstablishP2P first). It waits in the
/// `early` area: small (`MAX_EARLY`), at most `MAX_EARLY_PER_SOURCE` per source address,
/// kept `EARLY_KEEP` at most, and moved to `parked` when its token becomes wanted. When
/// that area is full the newcomer is refused (closed), never anyone already kept; an
/// honest dialer that was refused dials again (`Node::open_inbound`), and by then its
/// token is normally wanted.
///
/// A stream whose (token, stream number) is already kept is refused as well: the first
/// one stays (a later one could only be a repeat or a replay).
struct ParkingLot<T> {
    /// Tokens that a link here waits for, with how many waiters.
    wanted: HashMap<[u8; TOKEN_LEN], usize>,
    /// Streams of wanted tokens.
    parked: HashMap<ParkKey, T>,
    /// Streams of tokens not wanted (yet): (stream, source, kept until).
    early: HashMap<ParkKey, (T, IpAddr, Instant)>,
}

/// Why the parking lot did not keep a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Refusal {
    /// No link uses that stream number.
    BadSlot,
    /// A stream with the same token and number is kept already.
    Duplicate,
    /// The early area is full.
    Full,
    /// The early area holds its share of streams from this source address.
    SourceFull,
}

/// Where the parking lot put a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Placed {
    /// For a link that waits for it.
    Parked,
    /// In the early area, until the returned deadline.
    Early(Instant),
}

impl<T> ParkingLot<T> {
    fn new() -> Self {
        ParkingLot {
            wanted: HashMap::new(),
            parked: HashMap::new(),
            early: HashMap::new(),
        }
    }

    /// Stream numbers in use: those of a pool, and the two punch roles.
    fn valid_slot(slot: u16) -> bool {
        slot < MAX_POOL || slot == PUNCH_SLOT || slot == PUNCH_SLOT + 1
    }

    /// Keeps `item` (from `source`) for (token, slot), or gives it back with the reason.
    fn offer(
        &mut self,
        token: [u8; TOKEN_LEN],
        slot: u16,
        item: T,
        source: IpAddr,
        now: Instant,
    ) -> Result<Placed, (T, Refusal)> {
        if !Self::valid_slot(slot) {
            return Err((item, Refusal::BadSlot));
        }
        self.purge(now);
        let key = (token, slot);
        if self.parked.contains_key(&key) || self.early.contains_key(&key) {
            return Err((item, Refusal::Duplicate));
        }
        if self.wanted.contains_key(&token) {
            self.parked.insert(key, item);
            return Ok(Placed::Parked);
        }
        if self.early.len() >= MAX_EARLY {
            return Err((item, Refusal::Full));
        }
        let source = source.to_canonical();
        if self.early.values().filter(|e| e.1 == source).count() >= MAX_EARLY_PER_SOURCE {
            return Err((item, Refusal::SourceFull));
        }
        let until = now + EARLY_KEEP;
        self.early.insert(key, (item, source, until));
        Ok(Placed::Early(until))
    }

    /// A link starts waiting for streams with `token`: those that came early are kept
    /// for it from now on.
    fn want(&mut self, token: [u8; TOKEN_LEN]) {
        *self.wanted.entry(token).or_default() += 1;
        let keys: Vec<ParkKey> = self
            .early
            .keys()
            .filter(|k| k.0 == token)
            .copied()
            .collect();
        for key in keys {
            if let Some((item, _, _)) = self.early.remove(&key) {
                self.parked.insert(key, item);
            }
        }
    }

    /// A waiter for `token` is done; with the last one, the streams still kept for the
    /// token are of no use: they are returned (to be closed).
    fn unwant(&mut self, token: [u8; TOKEN_LEN]) -> Vec<T> {
        match self.wanted.get_mut(&token) {
            Some(n) if *n > 1 => {
                *n -= 1;
                return Vec::new();
            }
            Some(_) => {
                self.wanted.remove(&token);
            }
            None => return Vec::new(),
        }
        let keys: Vec<ParkKey> = self
            .parked
            .keys()
            .filter(|k| k.0 == token)
            .copied()
            .collect();
        keys.iter().filter_map(|k| self.parked.remove(k)).collect()
    }

    /// The stream kept for (token, slot), if any.
    fn take(&mut self, token: &[u8; TOKEN_LEN], slot: u16) -> Option<T> {
        let key = (*token, slot);
        self.parked
            .remove(&key)
            .or_else(|| self.early.remove(&key).map(|e| e.0))
    }

    /// Drops early streams whose time is up (closing them).
    fn purge(&mut self, now: Instant) {
        self.early.retain(|_, e| e.2 > now);
    }

    /// (streams kept for links that wait for them, streams in the early area).
    fn counts(&self) -> (usize, usize) {
        (self.parked.len(), self.early.len())
    }

    /// Drops everything (the node is closing).
    fn clear(&mut self) {
        self.wanted.clear();
        self.parked.clear();
        self.early.clear();
    }
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

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PoolKey {
    pub peer: u64,
    pub epoch: u64,
    pub purpose: Purpose,
}

/// Streams of one pool, indexed by stream number.
struct Pool {
    size: u16,
    streams: Vec<Option<P2PStream>>,
}

impl Pool {
    fn new(size: u16) -> Self {
        Pool {
            size,
            streams: (0..size).map(|_| None).collect(),
        }
    }
    fn complete(&self) -> bool {
        self.streams.iter().all(Option::is_some)
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

/// Most idle transfer streams kept per source.
const MAX_IDLE_TRANSFERS: usize = 16;

/// A link of ours waits for streams with `token` while this lives (`Node::want`).
struct Wanted<'a> {
    node: &'a Node,
    token: [u8; TOKEN_LEN],
}

impl Drop for Wanted<'_> {
    fn drop(&mut self) {
        let unused = self.node.parked.lock().unwrap().unwant(self.token);
        drop(unused); // closed outside the lock
    }
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

    /// Learns peers' static keys from the master's roster (replacing what it said of
    /// the same ids before). Past `MAX_ROSTER` ids the ones learned longest ago are
    /// forgotten (ids only grow over a run; a forgotten peer's streams are refused
    /// until the master names it again).
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

    async fn handle_incoming(self: Arc<Self>, mut tcp: TcpStream, remote: SocketAddr) {
        let _ = tcp.set_nodelay(true);
        let timeout = self.cfg.handshake_timeout;
        let first = tokio::select! {
            _ = self.cancel.cancelled() => return,
            r = tokio::time::timeout(timeout, read_first_frame(&mut tcp)) => r,
        };
        let first = match first {
            Ok(Ok(f)) => f,
            Ok(Err(e)) => return self.log_refused(remote, &e),
            Err(_) => {
                log::info!(
                    "peer {}: p2p connection from {remote} refused: no hello in time",
                    self.peer_id()
                );
                return;
            }
        };
        if first.len() == 8 + TOKEN_LEN && first.starts_with(REACH_MAGIC) {
            // The master checks that our advertised address reaches us.
            let token = first[8..].to_vec();
            let echoed = tokio::select! {
                _ = self.cancel.cancelled() => return,
                r = tokio::time::timeout(timeout, self.echo_reach(tcp, &token)) => r,
            };
            if let Ok(Err(e)) = echoed {
                log::info!(
                    "peer {}: reachability check from {remote} failed: {e}",
                    self.peer_id()
                );
            }
            return;
        }
        let slot = if first.len() == 8 + TOKEN_LEN + 2 && first.starts_with(REVERSE_MAGIC) {
            Some(u16::from_be_bytes([
                first[8 + TOKEN_LEN],
                first[9 + TOKEN_LEN],
            ]))
        } else if first.len() == 8 + TOKEN_LEN + 1 && first.starts_with(PUNCH_MAGIC) {
            // A neighbour's hole-punching connect that reached our listener: the punch
            // loop of that link takes it (keyed by the token and its role + PUNCH_SLOT).
            Some(PUNCH_SLOT + first[8 + TOKEN_LEN] as u16)
        } else {
            None
        };
        if let Some(slot) = slot {
            if let Some(until) = self.park(frame_token(&first), slot, tcp, remote) {
                // Kept early: this task lets it go when its time is up, unless its link
                // took it by then (a purge drops only what has expired).
                tokio::select! {
                    _ = self.cancel.cancelled() => {}
                    _ = tokio::time::sleep_until(until) => {
                        self.parked.lock().unwrap().purge(Instant::now());
                    }
                }
            }
            return;
        }
        let accepted = tokio::select! {
            _ = self.cancel.cancelled() => return,
            r = self.accept_stream(tcp, Some(first)) => r,
        };
        if let Err(e) = accepted {
            self.log_refused(remote, &e);
        }
    }

    /// Answers the master's reachability check: encrypted, a secure handshake in which
    /// the master proves its identity (a certificate for the group `master`, where
    /// certificates are checked) and this node proves the key the master saw on its
    /// control connection, then the token inside it; in clear text, the token echoed.
    async fn echo_reach(&self, mut tcp: TcpStream, token: &[u8]) -> CoreResult<()> {
        use tokio::io::AsyncWriteExt;
        match &self.transport() {
            Transport::Clear => write_frame(&mut tcp, token).await,
            Transport::Secure(auth) => {
                let auth = Auth {
                    group: GROUP_MASTER,
                    ..(**auth).clone()
                };
                let timeout = self.cfg.handshake_timeout;
                let mut s = secure_accept_first(tcp, None, &auth, REACH_PROLOGUE, timeout).await?;
                let sent = async {
                    s.write_all(token).await?;
                    s.flush().await?;
                    s.shutdown().await
                };
                sent.await
                    .map_err(|e| CoreError::io("echoing the reachability token", e))
            }
        }
    }

    /// Keeps a reverse (or punch) connection until its link asks for (token, slot), or
    /// refuses it (closes it). Returns the deadline of one kept in the early area.
    fn park(
        &self,
        token: [u8; TOKEN_LEN],
        slot: u16,
        tcp: TcpStream,
        remote: SocketAddr,
    ) -> Option<Instant> {
        let now = Instant::now();
        let offered = self
            .parked
            .lock()
            .unwrap()
            .offer(token, slot, tcp, remote.ip(), now);
        // (A refused stream is closed here, outside the lock.)
        let why = match offered {
            Ok(placed) => {
                self.parked_changed.notify_waiters();
                return match placed {
                    Placed::Parked => None,
                    Placed::Early(until) => Some(until),
                };
            }
            Err((_closed, why)) => why,
        };
        // Never logged louder than info: a stranger may send thousands of these.
        let why = match why {
            Refusal::BadSlot => format!("stream number {slot} is not one a link uses"),
            Refusal::Duplicate => "a stream with its token and number is waiting already".into(),
            Refusal::Full => format!("{MAX_EARLY} streams of links not asked for yet wait already"),
            Refusal::SourceFull => format!(
                "{MAX_EARLY_PER_SOURCE} streams from {} for links not asked for yet wait \
                 already",
                remote.ip()
            ),
        };
        let kind = if slot >= PUNCH_SLOT {
            "punched"
        } else {
            "reverse"
        };
        log::info!(
            "peer {}: {kind} p2p stream from {remote} refused: {why}",
            self.peer_id()
        );
        None
    }

    /// Streams with `token` are kept for a link of ours from now on, until the guard is
    /// dropped (see `ParkingLot`).
    fn want(&self, token: [u8; TOKEN_LEN]) -> Wanted<'_> {
        self.parked.lock().unwrap().want(token);
        self.parked_changed.notify_waiters();
        Wanted { node: self, token }
    }

    /// (streams kept for links that wait for them, streams of links not asked for yet).
    pub fn parked_counts(&self) -> (usize, usize) {
        self.parked.lock().unwrap().counts()
    }

    fn log_refused(&self, remote: SocketAddr, e: &CoreError) {
        // A wrong secret or bytes that are no pccl handshake (a port scanner, a
        // misdirected client) are worth a warning; a dialer that went away mid-handshake
        // is not.
        let (level, hint) = match e {
            CoreError::Authentication(m) if m.contains("insecure") => (log::Level::Warn, ""),
            CoreError::Identity(_) => (log::Level::Warn, ""),
            CoreError::Authentication(_) => (
                log::Level::Warn,
                " (do all peers use the same secret as this one?)",
            ),
            CoreError::Protocol(_) => (log::Level::Warn, ""),
            CoreError::PeerConnection(m) if m.starts_with("garbage") => (log::Level::Warn, ""),
            _ => (log::Level::Info, ""),
        };
        log::log!(
            level,
            "peer {}: p2p connection from {remote} refused: {e}{hint}",
            self.peer_id()
        );
    }

    /// The accepting side of one stream over `tcp`, whoever opened it: the transport
    /// and p2p handshakes (bounded), then the stream goes where its purpose says.
    /// `first`: the dialer's first frame when already read. Returns the size of the pool
    /// the stream belongs to.
    async fn accept_stream(&self, tcp: TcpStream, first: Option<Vec<u8>>) -> CoreResult<u16> {
        let timeout = self.cfg.handshake_timeout;
        // Inside the encrypted transport the hello needs no MAC of its own: the
        // handshake proved the key, and `stream_is` binds the key to the peer id.
        let secret = if self.transport().is_secure() {
            None
        } else {
            self.cfg.secret.clone()
        };
        let (hello, stream) = tokio::time::timeout(timeout, async {
            let mut stream = match first {
                Some(first) => self.transport().accept_first(tcp, first, timeout).await?,
                None => self.transport().accept(tcp, timeout).await?,
            };
            let own = self.known_peer_id().await;
            let hello = handshake::accept(&mut stream, secret.as_deref(), own).await?;
            Ok::<_, CoreError>((hello, stream))
        })
        .await
        .map_err(|_| CoreError::PeerConnection("the p2p handshake timed out".into()))??;
        // A stream may only take a slot (or a transfer) of the peer whose key it holds.
        if let Err(why) = self.stream_is(&stream, hello.from, false) {
            return Err(CoreError::Identity(format!("p2p stream refused: {why}")));
        }
        if hello.purpose == Purpose::Probe {
            let timeout = self.cfg.connect_timeout.max(Duration::from_secs(30));
            if let Err(e) =
                crate::net::transfer::absorb_probe(stream, MAX_PROBE_BYTES, timeout).await
            {
                log::info!(
                    "peer {}: bandwidth probe from peer {} failed: {e}",
                    self.peer_id(),
                    hello.from
                );
            }
            return Ok(1);
        }
        if hello.purpose == Purpose::Transfer {
            let timeout = self.cfg.connect_timeout.max(Duration::from_secs(30));
            if let Err(e) = crate::net::transfer::serve(&self.transfers, stream, timeout).await {
                log::info!(
                    "peer {}: serving a transfer to peer {} failed: {e}",
                    self.peer_id(),
                    hello.from
                );
            }
            return Ok(1);
        }
        let (from, epoch, index, pool) = (hello.from, hello.epoch, hello.stream, hello.pool);
        match self.file_inbound(hello, stream) {
            Ok(()) => {
                log::debug!(
                    "peer {}: accepted p2p stream {index} of {pool} from peer {from} (epoch \
                     {epoch})",
                    self.peer_id()
                );
                Ok(pool)
            }
            Err((level, msg)) => {
                log::log!(
                    level,
                    "peer {}: p2p stream from peer {from} dropped: {msg}",
                    self.peer_id()
                );
                Err(CoreError::PeerConnection(format!(
                    "p2p stream from peer {from} dropped: {msg}"
                )))
            }
        }
    }

    /// The receiving side of an edge that is not `Route::Direct`: opens TCP streams as
    /// `how` says and runs the accepting handshakes on each; the ring then finds them
    /// among the inbound pools as if they had come to the listener. The first stream's
    /// hello tells the pool size (the sender's), the rest are opened together.
    /// With `stream`: that one stream only (a relayed transfer stream a fetcher asked for).
    pub async fn open_inbound(&self, how: Inbound, stream: Option<u16>) -> CoreResult<()> {
        let how = match how {
            Inbound::Punch(remote, relay, token) => {
                let punched = tokio::select! {
                    _ = self.cancel.cancelled() => {
                        return Err(CoreError::Aborted("the p2p node is closing".into()))
                    }
                    r = self.punch(remote, &token, false, 0) => r,
                };
                match punched {
                    Ok(tcp) => {
                        log::info!(
                            "peer {}: hole punched a ring link from {remote}",
                            self.peer_id()
                        );
                        return self.accept_stream(tcp, None).await.map(|_| ());
                    }
                    Err(e) => {
                        log::warn!(
                            "peer {}: {e}; taking the link through the relay",
                            self.peer_id()
                        );
                        Inbound::Relay(relay, token)
                    }
                }
            }
            other => other,
        };
        let (first, one) = (stream.unwrap_or(0), stream.is_some());
        let open = |i: u16| {
            let how = how.clone();
            async move {
                let (addr, magic, token, what) = match &how {
                    Inbound::Reverse(a, t) => (*a, REVERSE_MAGIC, t, "dialing back the peer at"),
                    Inbound::Relay(a, t) | Inbound::Punch(_, a, t) => {
                        (*a, RELAY_MAGIC, t, "reaching the relay at")
                    }
                };
                let frame = route_frame(magic, token, i);
                if !matches!(how, Inbound::Reverse(..)) {
                    let mut tcp = self.connect_tcp(addr, &format!("{what} {addr}")).await?;
                    write_frame(&mut tcp, &frame).await?;
                    return self.accept_stream(tcp, None).await;
                }
                // The sender's listener may refuse our stream (closes it without a word):
                // it came before the sender's side of the link asked for it, while
                // strangers filled the area for such streams (see `ParkingLot`). Dial
                // again, a little later each time, as long as the sender would wait.
                let deadline =
                    Instant::now() + self.cfg.connect_timeout + self.cfg.handshake_timeout;
                let mut pause = REDIAL_PAUSE;
                loop {
                    let mut tcp = self.connect_tcp(addr, &format!("{what} {addr}")).await?;
                    write_frame(&mut tcp, &frame).await?;
                    // The sender speaks first once its link took the stream.
                    let mut byte = [0u8; 1];
                    let refused = match tokio::time::timeout_at(deadline, tcp.peek(&mut byte)).await
                    {
                        Ok(Ok(0)) => true,
                        Ok(Ok(_)) => false,
                        Ok(Err(e)) if hung_up(&e) => true,
                        Ok(Err(e)) => return Err(CoreError::io(format!("{what} {addr}"), e)),
                        Err(_) => {
                            return Err(CoreError::PeerConnection(format!(
                                "the peer at {addr} did not take our dial-back in time"
                            )))
                        }
                    };
                    if !refused {
                        return self.accept_stream(tcp, None).await;
                    }
                    if Instant::now() + pause >= deadline {
                        return Err(CoreError::PeerConnection(format!(
                            "the peer at {addr} kept refusing our dial-back (closed it \
                             before its hello)"
                        )));
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(REDIAL_PAUSE_MAX);
                }
            }
        };
        let all = async {
            let pool = open(first).await?;
            if one {
                return Ok(vec![]);
            }
            futures::future::try_join_all((1..pool).map(open)).await
        };
        tokio::select! {
            _ = self.cancel.cancelled() => Err(CoreError::Aborted("the p2p node is closing".into())),
            r = all => r.map(|_| ()),
        }
    }

    async fn connect_tcp(&self, addr: SocketAddr, what: &str) -> CoreResult<TcpStream> {
        let tcp = tokio::time::timeout(self.cfg.connect_timeout, TcpStream::connect(addr))
            .await
            .map_err(|_| CoreError::PeerConnection(format!("{what}: timed out")))?
            .map_err(|e| CoreError::io(what, e))?;
        let _ = tcp.set_nodelay(true);
        Ok(tcp)
    }

    /// The TCP stream for slot `stream` of a pool to peer `to` along `route`.
    async fn open_tcp(
        &self,
        route: &Route,
        to: u64,
        stream: u16,
        epoch: u64,
    ) -> CoreResult<TcpStream> {
        match route {
            Route::Direct(addr) => {
                self.connect_tcp(*addr, &format!("connecting to peer {to} at {addr}"))
                    .await
            }
            Route::Relay(addr, token) => {
                let mut tcp = self
                    .connect_tcp(
                        *addr,
                        &format!("reaching peer {to} through the relay at {addr}"),
                    )
                    .await?;
                write_frame(&mut tcp, &route_frame(RELAY_MAGIC, token, stream)).await?;
                Ok(tcp)
            }
            Route::Reverse(token) => {
                let deadline = tokio::time::Instant::now()
                    + self.cfg.connect_timeout
                    + self.cfg.handshake_timeout;
                self.wait_parked(token, stream, deadline)
                    .await
                    .ok_or_else(|| {
                        CoreError::PeerConnection(format!(
                            "peer {to} (behind NAT) did not dial back in time"
                        ))
                    })
            }
            Route::Punch(remote, _, token) => self.punch(*remote, token, true, epoch).await,
        }
    }

    /// A parked stream for (token, slot), waiting for it until `deadline`.
    async fn wait_parked(
        &self,
        token: &[u8; TOKEN_LEN],
        slot: u16,
        deadline: tokio::time::Instant,
    ) -> Option<TcpStream> {
        loop {
            let notified = self.parked_changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let taken = self.parked.lock().unwrap().take(token, slot);
            if let Some(tcp) = taken {
                let _ = tcp.set_nodelay(true);
                return Some(tcp);
            }
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => return None,
                _ = notified => {}
            }
        }
    }

    /// One TCP connection to the neighbour at `remote` (its predicted public address)
    /// through both NATs: connects from our punch port (the sender) or our listening
    /// port (the receiver; SO_REUSEPORT lets both share it) until the
    /// neighbour's connect and ours meet (a simultaneous open; or one side's connect
    /// lands on the other's listener, which parks it for us). Each side then sends
    /// `PUNCH_MAGIC | token | role` and checks the other's. `sender`: our role is the
    /// ring link's sender. Fails after `PUNCH_TIMEOUT` (e.g. a NAT that maps every
    /// connection to a new port: then the caller takes the relay).
    async fn punch(
        &self,
        remote: SocketAddr,
        token: &[u8; TOKEN_LEN],
        sender: bool,
        epoch: u64,
    ) -> CoreResult<TcpStream> {
        let (mine, theirs) = if sender { (0u8, 1u8) } else { (1u8, 0u8) };
        // The neighbour's connect may land on our listener: kept for us meanwhile.
        let _wanted = self.want(*token);
        let hello = |role: u8| {
            let mut f = PUNCH_MAGIC.to_vec();
            f.extend_from_slice(token);
            f.push(role);
            f
        };
        let deadline = tokio::time::Instant::now() + PUNCH_TIMEOUT.min(self.cfg.connect_timeout);
        let failed = || {
            CoreError::PeerConnection(format!(
                "hole punching to {remote} failed within {:?} (a NAT that maps each \
                 connection to a new port, or a firewall)",
                PUNCH_TIMEOUT.min(self.cfg.connect_timeout)
            ))
        };
        while tokio::time::Instant::now() < deadline {
            let attempt = async {
                let s = reusable_socket(remote)?;
                s.bind(if sender {
                    self.punch_addrs[(epoch % PUNCH_PORTS as u64) as usize]
                } else {
                    self.local_addr
                })?;
                s.connect(remote).await
            };
            tokio::select! {
                parked = self.wait_parked(token, PUNCH_SLOT + theirs as u16, deadline) => {
                    // Their connect reached our listener; they wait for our hello.
                    let Some(mut tcp) = parked else { break };
                    zero_linger(&tcp);
                    write_frame(&mut tcp, &hello(mine)).await?;
                    return Ok(tcp);
                }
                r = tokio::time::timeout_at(deadline, attempt) => match r {
                    Ok(Ok(mut tcp)) => {
                        let _ = tcp.set_nodelay(true);
                        // The next round punches the same pair of ports again: closing
                        // with a reset leaves no TIME_WAIT to block that 4-tuple.
                        zero_linger(&tcp);
                        write_frame(&mut tcp, &hello(mine)).await?;
                        let mut buf = Vec::new();
                        let answer = tokio::time::timeout(
                            self.cfg.handshake_timeout,
                            crate::net::frame::read_frame(&mut tcp, &mut buf, 64),
                        )
                        .await;
                        if matches!(answer, Ok(Ok(true))) && buf == hello(theirs) {
                            return Ok(tcp);
                        }
                        // Someone else, or a half-open leftover: try again.
                    }
                    Ok(Err(_)) => {
                        // Refused or unreachable for now (their NAT has no mapping yet).
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Err(_) => break,
                }
            }
        }
        Err(failed())
    }

    /// Files an accepted stream; on refusal, why and how loudly to say so (the lock is
    /// released by then: never log under it).
    fn file_inbound(&self, h: StreamHello, stream: P2PStream) -> Result<(), (log::Level, String)> {
        if h.pool == 0 || h.pool > MAX_POOL || h.stream >= h.pool {
            return Err((
                log::Level::Warn,
                format!("bad stream index {} of pool {}", h.stream, h.pool),
            ));
        }
        if h.epoch < *self.min_epoch.lock().unwrap() {
            // A neighbour still dialing for a ring the group has moved past: routine.
            return Err((log::Level::Debug, format!("stale epoch {}", h.epoch)));
        }
        let key = PoolKey {
            peer: h.from,
            epoch: h.epoch,
            purpose: h.purpose,
        };
        let mut inbound = self.inbound.lock().unwrap();
        let pool = inbound.entry(key).or_insert_with(|| Pool::new(h.pool));
        if pool.size != h.pool {
            return Err((
                log::Level::Warn,
                format!("pool size {} disagrees with earlier {}", h.pool, pool.size),
            ));
        }
        // A re-dial of the same slot replaces the old stream (the dialer gave up on it).
        pool.streams[h.stream as usize] = Some(stream);
        drop(inbound);
        self.inbound_changed.notify_waiters();
        Ok(())
    }

    /// Dials `n` streams to peer `to` at `addr`, handshakes each, and keeps them as
    /// the outbound pool for `(to, epoch, purpose)`.
    pub async fn connect_pool(
        &self,
        addr: SocketAddr,
        to: u64,
        epoch: u64,
        n: u16,
        purpose: Purpose,
    ) -> CoreResult<()> {
        self.connect_pool_via(Route::Direct(addr), to, epoch, n, purpose)
            .await
    }

    /// `connect_pool` along any route.
    pub async fn connect_pool_via(
        &self,
        route: Route,
        to: u64,
        epoch: u64,
        n: u16,
        purpose: Purpose,
    ) -> CoreResult<()> {
        if n == 0 || n > MAX_POOL {
            return Err(CoreError::InvalidArgument(format!(
                "p2p pool size must be in 1..={MAX_POOL}, got {n}"
            )));
        }
        let (route, n) = match route {
            Route::Punch(remote, relay, token) => {
                let hello = StreamHello {
                    from: self.peer_id(),
                    to,
                    epoch,
                    stream: 0,
                    pool: 1,
                    purpose,
                };
                // One punched connection per link (one port pair); the ring spreads its
                // pieces over however many streams a link has.
                let punched = tokio::select! {
                    _ = self.cancel.cancelled() => {
                        return Err(CoreError::Aborted("the p2p node is closing".into()))
                    }
                    r = self.dial_one(&route, hello, 0) => r,
                };
                match punched {
                    Ok(stream) => {
                        log::info!(
                            "peer {}: hole punched the ring link to peer {to} at {remote}",
                            self.peer_id()
                        );
                        let key = PoolKey {
                            peer: to,
                            epoch,
                            purpose,
                        };
                        self.outbound.lock().unwrap().insert(key, vec![stream]);
                        return Ok(());
                    }
                    Err(e) => {
                        log::warn!(
                            "peer {}: {e}; taking the link to peer {to} through the relay",
                            self.peer_id()
                        );
                        (Route::Relay(relay, token), n)
                    }
                }
            }
            other => (other, n),
        };
        // The neighbour dials us for a reverse route: its streams are kept for this pool
        // from now on, whatever strangers send meanwhile.
        let _wanted = match &route {
            Route::Reverse(token) => Some(self.want(*token)),
            _ => None,
        };
        let dials = (0..n).map(|i| {
            let hello = StreamHello {
                from: self.peer_id(),
                to,
                epoch,
                stream: i,
                pool: n,
                purpose,
            };
            self.dial_one(&route, hello, i)
        });
        let streams = tokio::select! {
            _ = self.cancel.cancelled() => {
                return Err(CoreError::Aborted("the p2p node is closing".into()))
            }
            r = futures::future::try_join_all(dials) => r?,
        };
        self.outbound.lock().unwrap().insert(
            PoolKey {
                peer: to,
                epoch,
                purpose,
            },
            streams,
        );
        log::debug!(
            "peer {}: {n} p2p stream(s) open to peer {to} via {route:?} ({purpose:?}, epoch \
             {epoch})",
            self.peer_id()
        );
        Ok(())
    }

    /// One authenticated transfer stream to peer `to` (see `transfer.rs`): dialed at
    /// `addr`, or through the relay when `set_transfer_relay` says so.
    pub async fn dial_transfer(&self, addr: SocketAddr, to: u64) -> CoreResult<P2PStream> {
        let (route, slot) = self.transfer_relays.lock().unwrap().get_mut(&to).map_or(
            (Route::Direct(addr), 0),
            |r| {
                r.2 = r.2.wrapping_add(1);
                (Route::Relay(r.0, r.1), r.2)
            },
        );
        let hello = StreamHello {
            from: self.peer_id(),
            to,
            epoch: 0,
            stream: 0,
            pool: 1,
            purpose: Purpose::Transfer,
        };
        self.dial_one(&route, hello, slot).await
    }

    /// Transfer streams to peer `to` go through the relay at `relay` with `token` (a
    /// holder behind NAT), or are dialed again (`None`).
    pub fn set_transfer_relay(&self, to: u64, relay: Option<(SocketAddr, [u8; TOKEN_LEN])>) {
        let mut relays = self.transfer_relays.lock().unwrap();
        match relay {
            Some((addr, token)) => {
                relays.insert(to, (addr, token, 0));
            }
            None => {
                relays.remove(&to);
            }
        }
    }

    /// An idle transfer stream to peer `to` at `addr` from an earlier fetch, if any
    /// (`true`: reused), else a new one.
    pub async fn take_transfer(&self, addr: SocketAddr, to: u64) -> CoreResult<(P2PStream, bool)> {
        let idle = self
            .idle_transfers
            .lock()
            .unwrap()
            .get_mut(&(addr, to))
            .and_then(Vec::pop);
        match idle {
            Some(stream) => Ok((stream, true)),
            None => Ok((self.dial_transfer(addr, to).await?, false)),
        }
    }

    /// Keeps `stream`, which just finished a fetch cleanly, for the next fetch from the
    /// same source (until `drop_idle_transfers`). Never after `close()`.
    pub fn put_transfer(&self, addr: SocketAddr, to: u64, stream: P2PStream) {
        if self.cancel.is_cancelled() {
            return;
        }
        let mut idle = self.idle_transfers.lock().unwrap();
        let streams = idle.entry((addr, to)).or_default();
        if streams.len() < MAX_IDLE_TRANSFERS {
            streams.push(stream);
        }
    }

    /// Closes every idle transfer stream (the end of a sync: the sources stop serving).
    pub fn drop_idle_transfers(&self) {
        let idle: Vec<P2PStream> = std::mem::take(&mut *self.idle_transfers.lock().unwrap())
            .into_values()
            .flatten()
            .collect();
        if !self.cancel.is_cancelled() {
            self.close_streams(idle);
        }
    }

    /// Ends `streams` cleanly in the background (an authenticated end of stream, which
    /// the peer tells from a cut), bounded, and then drops them.
    pub fn close_streams(&self, streams: Vec<P2PStream>) {
        use tokio::io::AsyncWriteExt;
        if streams.is_empty() || tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let cancel = self.cancel.clone();
        self.tracker.spawn(async move {
            let ends = streams.into_iter().map(|mut s| async move {
                let _ = tokio::time::timeout(Duration::from_secs(2), s.shutdown()).await;
            });
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = futures::future::join_all(ends) => {}
            }
        });
    }

    /// One authenticated stream of `purpose` (slot `stream` of `pool`) to peer `to`.
    pub async fn dial_purpose(
        &self,
        addr: SocketAddr,
        to: u64,
        stream: u16,
        pool: u16,
        purpose: Purpose,
    ) -> CoreResult<P2PStream> {
        let hello = StreamHello {
            from: self.peer_id(),
            to,
            epoch: 0,
            stream,
            pool,
            purpose,
        };
        self.dial_one(&Route::Direct(addr), hello, stream).await
    }

    /// `slot`: the stream's number on a reverse or relayed route.
    async fn dial_one(
        &self,
        route: &Route,
        hello: StreamHello,
        slot: u16,
    ) -> CoreResult<P2PStream> {
        let what = format!("handshaking with peer {} via {route:?}", hello.to);
        let expect = self.expected_key(hello.to)?;
        let tcp = self.open_tcp(route, hello.to, slot, hello.epoch).await?;
        let timeout = self.cfg.handshake_timeout;
        let secret = if self.transport().is_secure() {
            None
        } else {
            self.cfg.secret.as_deref()
        };
        tokio::time::timeout(timeout, async {
            let mut stream = self.transport().dial(tcp, timeout, expect).await?;
            handshake::dial(&mut stream, secret, hello).await?;
            Ok::<_, CoreError>(stream)
        })
        .await
        .map_err(|_| CoreError::PeerConnection(format!("{what}: handshake timed out")))?
    }

    /// Takes the outbound pool for `key`, if it was dialed.
    pub fn take_outbound(&self, key: PoolKey) -> Option<Vec<P2PStream>> {
        self.outbound.lock().unwrap().remove(&key)
    }

    /// Waits (bounded) until the inbound pool `key` is complete, then takes it.
    pub async fn take_inbound(
        &self,
        key: PoolKey,
        timeout: Duration,
    ) -> CoreResult<Vec<P2PStream>> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.inbound_changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut inbound = self.inbound.lock().unwrap();
                if inbound.get(&key).is_some_and(Pool::complete) {
                    let pool = inbound.remove(&key).unwrap();
                    drop(inbound);
                    let streams: Vec<P2PStream> =
                        pool.streams.into_iter().map(Option::unwrap).collect();
                    // Filed before the roster named the peer, perhaps: checked now.
                    for s in &streams {
                        if let Err(why) = self.stream_is(s, key.peer, true) {
                            return Err(CoreError::Identity(format!(
                                "a p2p stream from peer {} was refused: {why}",
                                key.peer
                            )));
                        }
                    }
                    return Ok(streams);
                }
            }
            tokio::select! {
                _ = self.cancel.cancelled() => {
                    return Err(CoreError::Aborted("the p2p node is closing".into()))
                }
                _ = tokio::time::sleep_until(deadline) => {
                    return Err(CoreError::PeerConnection(format!(
                        "peer {} did not open its p2p streams in time", key.peer
                    )))
                }
                _ = notified => {}
            }
        }
    }

    /// Forgets every pool older than `epoch` and refuses streams for it from now on.
    pub fn retain_from_epoch(&self, epoch: u64) {
        *self.min_epoch.lock().unwrap() = epoch;
        self.inbound.lock().unwrap().retain(|k, _| k.epoch >= epoch);
        self.outbound
            .lock()
            .unwrap()
            .retain(|k, _| k.epoch >= epoch);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(id: u64, secret: Option<&[u8]>) -> NodeConfig {
        NodeConfig {
            peer_id: id,
            secret: secret.map(|s| s.to_vec()),
            identity: Identity::ephemeral(),
            handshake_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(2),
            insecure: false,
        }
    }

    /// A test node bound on loopback, knowing every test node's key.
    async fn bound(cfg: NodeConfig) -> Arc<Node> {
        crate::testutil::known_node(cfg, "127.0.0.1:0".parse().unwrap())
            .await
            .unwrap()
    }

    async fn node(id: u64, secret: Option<&[u8]>) -> Arc<Node> {
        bound(cfg(id, secret)).await
    }

    #[tokio::test]
    async fn pools_connect_and_are_filed_on_both_ends() {
        let a = node(1, Some(b"k")).await;
        let b = node(2, Some(b"k")).await;
        a.connect_pool(b.local_addr(), 2, 5, 4, Purpose::Ring)
            .await
            .unwrap();
        let key = PoolKey {
            peer: 1,
            epoch: 5,
            purpose: Purpose::Ring,
        };
        let streams = b.take_inbound(key, Duration::from_secs(2)).await.unwrap();
        assert_eq!(streams.len(), 4);
        let out = a
            .take_outbound(PoolKey {
                peer: 2,
                epoch: 5,
                purpose: Purpose::Ring,
            })
            .unwrap();
        assert_eq!(out.len(), 4);
        a.close().await;
        b.close().await;
    }

    /// Peers 1 (the fetcher) and 2 (the source), with a shared secret.
    async fn fetcher_and_source() -> (Arc<Node>, Arc<Node>) {
        let a = node(1, Some(b"k")).await;
        let b = node(2, Some(b"k")).await;
        (a, b)
    }

    /// Serves `data` under `key` on `node`.
    fn serve_vec(node: &Node, key: &str, data: Vec<u8>) {
        let (ptr, len) = (data.as_ptr(), data.len());
        // SAFETY: the Vec's buffer lives in the keep-alive box, unmodified.
        let served = unsafe { crate::net::transfer::Served::new(ptr, len, Box::new(data)) };
        node.transfers.serve(key.into(), served);
    }

    #[tokio::test]
    async fn transfer_streams_are_kept_for_the_next_fetch_until_dropped() {
        use crate::net::transfer::fetch;
        let (a, b) = fetcher_and_source().await;
        let len = 3000;
        serve_vec(&b, "w", (0..len as u32).map(|i| i as u8).collect());
        let landed = AtomicU64::new(0);
        let mut dst = vec![0u8; len];
        for round in 0..3 {
            let (mut s, reused) = a.take_transfer(b.local_addr(), 2).await.unwrap();
            assert_eq!(reused, round > 0, "round {round}");
            let timeout = Duration::from_secs(2);
            fetch(&mut s, "w", 0, len as u64, &mut dst, timeout, &landed)
                .await
                .unwrap();
            a.put_transfer(b.local_addr(), 2, s);
        }
        assert_eq!(landed.into_inner(), 3 * len as u64);
        a.drop_idle_transfers();
        let (_, reused) = a.take_transfer(b.local_addr(), 2).await.unwrap();
        assert!(!reused);
        a.close().await;
        b.close().await;
    }

    #[tokio::test]
    async fn pipelined_fetches_answer_in_order_and_refusals_keep_the_stream() {
        use crate::hash::{content_hash, root_of_digests};
        use crate::net::transfer::{fetch_many, Wanted};
        let (a, b) = fetcher_and_source().await;
        // A large tensor first, then many small ones with long keys: the requests behind
        // the large reply must not wait for it to be read (nor block it).
        let mut served = vec![("big".to_string(), vec![7u8; 9 << 20])];
        for i in 0..300u32 {
            let key = format!("{i:0>200}");
            served.push((key, (0..1000 + i).map(|j| (i + j) as u8).collect()));
        }
        for (key, data) in &served {
            serve_vec(&b, key, data.clone());
        }
        let mut dsts: Vec<Vec<u8>> = served.iter().map(|(_, d)| vec![0u8; d.len()]).collect();
        dsts.insert(2, vec![0u8; 10]);
        let mut keys: Vec<&str> = served.iter().map(|(k, _)| k.as_str()).collect();
        keys.insert(2, "nobody serves this");
        let mut items: Vec<Wanted<'_>> = keys
            .iter()
            .zip(dsts.iter_mut())
            .map(|(key, dst)| Wanted { key, dst })
            .collect();
        let landed = AtomicU64::new(0);
        let timeout = Duration::from_secs(5);
        let (mut s, _) = a.take_transfer(b.local_addr(), 2).await.unwrap();
        let (results, in_step) = fetch_many(&mut s, &mut items, timeout, &landed).await;
        drop(items);
        assert!(in_step);
        assert!(
            matches!(&results[2], Err(CoreError::PeerConnection(m)) if m.contains("does not serve"))
        );
        let ok: Vec<&Vec<u8>> = results
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != 2)
            .map(|(_, r)| r.as_ref().unwrap())
            .collect();
        let dsts: Vec<&Vec<u8>> = dsts
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != 2)
            .map(|(_, d)| d)
            .collect();
        for ((digests, dst), (_, data)) in ok.iter().zip(&dsts).zip(&served) {
            assert_eq!(*dst, data);
            assert_eq!(
                root_of_digests(digests, data.len()),
                Some(content_hash(data))
            );
        }
        let total: usize = served.iter().map(|(_, d)| d.len()).sum();
        assert_eq!(landed.load(Ordering::Relaxed), total as u64);
        // The stream is still in step: a plain fetch on it works.
        let mut again = vec![0u8; served[1].1.len()];
        crate::net::transfer::fetch(
            &mut s,
            &served[1].0,
            0,
            again.len() as u64,
            &mut again,
            timeout,
            &landed,
        )
        .await
        .unwrap();
        assert_eq!(again, served[1].1);
        // A source that goes away fails the items it had not delivered.
        let (mut s2, _) = a.take_transfer(b.local_addr(), 2).await.unwrap();
        b.close().await;
        let mut d1 = vec![0u8; 9 << 20];
        let mut d2 = vec![0u8; 1000];
        let mut items = vec![
            Wanted {
                key: "big",
                dst: &mut d1,
            },
            Wanted {
                key: &served[1].0,
                dst: &mut d2,
            },
        ];
        let (results, in_step) = fetch_many(&mut s2, &mut items, timeout, &landed).await;
        assert!(!in_step);
        assert!(results.iter().all(|r| r.is_err()));
        a.close().await;
    }

    /// Waits (bounded) for captured records containing `needle` (they are logged by the
    /// listener's tasks, a moment after the dialer saw the outcome).
    async fn logged(needle: &str) -> Vec<crate::py::logging::capture::Entry> {
        for _ in 0..200 {
            let got = crate::py::logging::capture::matching(needle);
            if !got.is_empty() {
                return got;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("nothing was logged containing {needle:?}");
    }

    #[tokio::test]
    async fn wrong_secret_is_refused_and_logged() {
        crate::py::logging::capture::install();
        // Peer ids no other test uses: the captured records are process-wide.
        let a = node(7101, Some(b"x")).await;
        let b = node(7102, Some(b"y")).await;
        let err = a
            .connect_pool(b.local_addr(), 7102, 1, 2, Purpose::Ring)
            .await
            .unwrap_err();
        assert!(matches!(err, CoreError::Authentication(_)));
        // (Of a pool of two, the other stream may just see the dialer hang up.)
        // The encrypted transport's handshake (keyed by the secret) fails first.
        let records = logged("peer 7102: p2p connection from").await;
        assert!(records
            .iter()
            .all(|(level, target, msg)| *level == log::Level::Warn
                && target == "_core::net::node"
                && msg.starts_with("peer 7102: p2p connection from 127.0.0.1:")
                && msg.contains("secure handshake failed")
                && msg.contains("same secret")));
        b.close().await;
        a.close().await;
    }

    #[tokio::test]
    async fn garbage_and_huge_prefix_do_not_disturb_the_listener() {
        use tokio::io::AsyncWriteExt;
        crate::py::logging::capture::install();
        let a = node(7201, None).await;
        let b = node(7202, None).await;
        let mut s = TcpStream::connect(b.local_addr()).await.unwrap();
        s.write_all(&u32::MAX.to_be_bytes()).await.unwrap();
        let mut s2 = TcpStream::connect(b.local_addr()).await.unwrap();
        s2.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        a.connect_pool(b.local_addr(), 7202, 1, 2, Purpose::Ring)
            .await
            .unwrap();
        b.take_inbound(
            PoolKey {
                peer: 7201,
                epoch: 1,
                purpose: Purpose::Ring,
            },
            Duration::from_secs(2),
        )
        .await
        .unwrap();
        // Both strangers were refused out loud, the real streams noted quietly.
        let refused = logged("peer 7202: p2p connection from").await;
        assert!(refused
            .iter()
            .all(|(level, _, _)| *level == log::Level::Warn));
        let accepted = logged("peer 7202: accepted p2p stream").await;
        assert!(accepted
            .iter()
            .all(|(level, _, _)| *level == log::Level::Debug));
        a.close().await;
        b.close().await;
    }

    #[tokio::test]
    async fn streams_are_encrypted_by_default_and_clear_when_both_opt_out() {
        for (insecure, secret) in [(false, Some(&b"k"[..])), (false, None), (true, None)] {
            let mut ca = cfg(1, secret);
            let mut cb = cfg(2, secret);
            (ca.insecure, cb.insecure) = (insecure, insecure);
            let a = bound(ca).await;
            let b = bound(cb).await;
            a.connect_pool(b.local_addr(), 2, 1, 2, Purpose::Ring)
                .await
                .unwrap();
            let key = |peer| PoolKey {
                peer,
                epoch: 1,
                purpose: Purpose::Ring,
            };
            let inbound = b
                .take_inbound(key(1), Duration::from_secs(2))
                .await
                .unwrap();
            let outbound = a.take_outbound(key(2)).unwrap();
            assert!(inbound
                .iter()
                .chain(&outbound)
                .all(|s| s.is_secure() != insecure));
            a.close().await;
            b.close().await;
        }
    }

    #[tokio::test]
    async fn an_insecure_peer_and_an_encrypting_one_fail_at_once_both_ways() {
        for dialer_insecure in [true, false] {
            let mut ca = cfg(1, Some(b"k"));
            ca.insecure = dialer_insecure;
            let mut cb = cfg(2, Some(b"k"));
            cb.insecure = !dialer_insecure;
            // Far longer than the test waits: the mismatch is told, not timed out.
            ca.handshake_timeout = Duration::from_secs(30);
            cb.handshake_timeout = Duration::from_secs(30);
            let a = bound(ca).await;
            let b = bound(cb).await;
            let err = tokio::time::timeout(
                Duration::from_secs(5),
                a.connect_pool(b.local_addr(), 2, 1, 2, Purpose::Ring),
            )
            .await
            .expect("a transport mismatch must not wait for the handshake timeout")
            .unwrap_err();
            match err {
                CoreError::Authentication(m) => assert!(m.contains("clear text"), "{m}"),
                e => panic!("expected an authentication error, got {e:?}"),
            }
            a.close().await;
            b.close().await;
        }
    }

    #[tokio::test]
    async fn take_inbound_times_out() {
        let b = node(2, None).await;
        let key = PoolKey {
            peer: 7,
            epoch: 1,
            purpose: Purpose::Ring,
        };
        let err = b
            .take_inbound(key, Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(matches!(err, CoreError::PeerConnection(_)));
        b.close().await;
    }

    /// Takes the ring pool of `epoch` from `sender` (peer `ids.0`) to `receiver` (peer
    /// `ids.1`) at both ends and checks that data flows through it.
    async fn ring_pool_carries_data(sender: &Node, receiver: &Node, ids: (u64, u64), epoch: u64) {
        let key = |peer| PoolKey {
            peer,
            epoch,
            purpose: Purpose::Ring,
        };
        let inn = receiver
            .take_inbound(key(ids.0), Duration::from_secs(2))
            .await
            .unwrap();
        let out = sender.take_outbound(key(ids.1)).unwrap();
        data_flows(out, inn).await;
    }

    /// Writes `msg` on every stream of `out` and reads it back on the matching stream of
    /// `inn` (the data direction is the pool's, whoever opened the TCP connection).
    async fn data_flows(out: Vec<P2PStream>, inn: Vec<P2PStream>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        assert_eq!(out.len(), inn.len());
        for (mut o, mut i) in out.into_iter().zip(inn) {
            o.write_all(b"through the reverse path").await.unwrap();
            o.flush().await.unwrap();
            let mut got = [0u8; 24];
            i.read_exact(&mut got).await.unwrap();
            assert_eq!(&got, b"through the reverse path");
        }
    }

    #[tokio::test]
    async fn a_reverse_pool_is_dialed_by_the_receiver_and_filed_as_usual() {
        let a = node(1, Some(b"k")).await;
        let b = node(2, Some(b"k")).await;
        let token = [7u8; TOKEN_LEN];
        // The receiver may dial back before the sender asks for the pool: parked.
        let (sent, opened) = tokio::join!(
            async {
                tokio::task::yield_now().await;
                a.connect_pool_via(Route::Reverse(token), 2, 5, 3, Purpose::Ring)
                    .await
            },
            b.open_inbound(Inbound::Reverse(a.local_addr(), token), None),
        );
        sent.unwrap();
        opened.unwrap();
        ring_pool_carries_data(&a, &b, (1, 2), 5).await;
        a.close().await;
        b.close().await;
    }

    #[tokio::test]
    async fn a_reverse_pool_with_the_wrong_token_times_out_as_a_peer_error() {
        let mut c = cfg(1, Some(b"k"));
        c.connect_timeout = Duration::from_millis(200);
        c.handshake_timeout = Duration::from_millis(300);
        let a = bound(c).await;
        let b = node(2, Some(b"k")).await;
        let (sent, opened) = tokio::join!(
            a.connect_pool_via(Route::Reverse([1; TOKEN_LEN]), 2, 5, 1, Purpose::Ring),
            b.open_inbound(Inbound::Reverse(a.local_addr(), [2; TOKEN_LEN]), None),
        );
        assert!(
            matches!(sent.unwrap_err(), CoreError::PeerConnection(m) if m.contains("dial back"))
        );
        assert!(opened.is_err());
        a.close().await;
        b.close().await;
    }

    /// A connection to `node`'s listener that opened the master's reachability check.
    async fn reach_probe(node: &Node, token: [u8; TOKEN_LEN]) -> TcpStream {
        let mut tcp = TcpStream::connect(node.local_addr()).await.unwrap();
        let mut probe = REACH_MAGIC.to_vec();
        probe.extend_from_slice(&token);
        write_frame(&mut tcp, &probe).await.unwrap();
        tcp
    }

    #[tokio::test]
    async fn the_listener_echoes_a_reachability_token() {
        use crate::net::secure::secure_dial_as;
        use tokio::io::AsyncReadExt;
        let b = node(2, Some(b"k")).await;
        // The master asks for the key peer 2 proved on its control connection; a
        // listener holding another key fails the handshake instead of echoing.
        for (expect, echoed) in [(b.public_key(), true), ([3u8; 32], false)] {
            let tcp = reach_probe(&b, [9u8; TOKEN_LEN]).await;
            let master = Auth {
                identity: Identity::ephemeral(),
                psk: Some(crate::net::secure::psk_from_secret(b"k")),
                also: Vec::new(),
                group: crate::net::identity::GROUP_PEER,
                expect: Some(expect),
            };
            let dialed = secure_dial_as(tcp, &master, REACH_PROLOGUE, Duration::from_secs(5)).await;
            if !echoed {
                assert!(matches!(dialed, Err(CoreError::Identity(_))), "{dialed:?}");
                continue;
            }
            let mut s = dialed.unwrap();
            let mut got = [0u8; TOKEN_LEN];
            s.read_exact(&mut got).await.unwrap();
            assert_eq!(got, [9u8; TOKEN_LEN]);
        }
        b.close().await;
        // In clear text, the token comes back in clear.
        let mut c = cfg(3, None);
        c.insecure = true;
        let clear = bound(c).await;
        let mut tcp = reach_probe(&clear, [7u8; TOKEN_LEN]).await;
        let mut got = Vec::new();
        assert!(crate::net::frame::read_frame(&mut tcp, &mut got, 64)
            .await
            .unwrap());
        assert_eq!(got, [7u8; TOKEN_LEN]);
        clear.close().await;
    }

    #[tokio::test]
    async fn the_roster_forgets_the_keys_learned_longest_ago_past_its_bound() {
        let n = node(2, Some(b"k")).await;
        let many: Vec<_> = (100..100 + MAX_ROSTER as u64 + 10)
            .map(|id| (id, [id as u8; 32]))
            .collect();
        n.set_peer_keys(&many).unwrap();
        assert_eq!(n.keys.lock().unwrap().keys.len(), MAX_ROSTER);
        // The first learned are gone (the test roster's ids among them), the last kept.
        assert!(matches!(n.expected_key(1), Err(CoreError::Identity(_))));
        assert!(matches!(n.expected_key(100), Err(CoreError::Identity(_))));
        let last = 100 + MAX_ROSTER as u64 + 9;
        assert_eq!(n.expected_key(last).unwrap(), Some([last as u8; 32]));
        n.close().await;
    }

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn strangers_fill_only_the_early_area_and_a_wanted_token_still_parks() {
        let now = Instant::now();
        let mut lot = ParkingLot::new();
        let mine = [1u8; TOKEN_LEN];
        lot.want(mine);
        // One source gets its share, then is refused; many sources fill the area.
        let mut kept = 0;
        for i in 0..(MAX_EARLY_PER_SOURCE + 5) {
            let token = [0, 0, 0, (i + 1) as u8].repeat(4).try_into().unwrap();
            match lot.offer(token, 0, i, ip(1), now) {
                Ok(Placed::Early(until)) => {
                    assert_eq!(until, now + EARLY_KEEP);
                    kept += 1;
                }
                Err((_, why)) => assert_eq!(why, Refusal::SourceFull),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(kept, MAX_EARLY_PER_SOURCE);
        for i in 0..2 * MAX_EARLY {
            let token: [u8; TOKEN_LEN] = [(i >> 8) as u8 + 1, i as u8, 7, 7]
                .repeat(4)
                .try_into()
                .unwrap();
            match lot.offer(token, 1, i, ip(2 + (i / MAX_EARLY_PER_SOURCE) as u8), now) {
                Ok(Placed::Early(_)) => {}
                Err((_, why)) => assert_eq!(why, Refusal::Full),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(lot.counts(), (0, MAX_EARLY));
        // Nothing was evicted for the newcomers, and the wanted token is kept anyway.
        for slot in 0..MAX_POOL {
            assert_eq!(
                lot.offer(mine, slot, 1000, ip(1), now).unwrap(),
                Placed::Parked
            );
        }
        assert_eq!(lot.counts(), (MAX_POOL as usize, MAX_EARLY));
        assert_eq!(lot.take(&mine, 3), Some(1000));
        assert_eq!(lot.take(&mine, 3), None);
    }

    #[test]
    fn a_repeated_token_and_stream_is_refused_and_the_first_stays() {
        let now = Instant::now();
        let mut lot = ParkingLot::new();
        let (early, wanted) = ([2u8; TOKEN_LEN], [3u8; TOKEN_LEN]);
        lot.want(wanted);
        assert!(lot.offer(early, 0, "first", ip(1), now).is_ok());
        assert!(lot.offer(wanted, 0, "first", ip(1), now).is_ok());
        for token in [early, wanted] {
            let (back, why) = lot.offer(token, 0, "second", ip(9), now).unwrap_err();
            assert_eq!((back, why), ("second", Refusal::Duplicate));
        }
        // The early one, moved when its token is wanted, stays the first as well.
        lot.want(early);
        assert_eq!(lot.counts(), (2, 0));
        assert_eq!(
            lot.offer(early, 0, "third", ip(1), now).unwrap_err().1,
            Refusal::Duplicate
        );
        assert_eq!(lot.take(&early, 0), Some("first"));
        assert_eq!(lot.take(&wanted, 0), Some("first"));
        // Stream numbers no link uses are refused.
        for slot in [MAX_POOL, PUNCH_SLOT - 1, PUNCH_SLOT + 2, u16::MAX] {
            assert_eq!(
                lot.offer(wanted, slot, "x", ip(1), now).unwrap_err().1,
                Refusal::BadSlot
            );
        }
        for slot in [PUNCH_SLOT, PUNCH_SLOT + 1] {
            assert_eq!(
                lot.offer(wanted, slot, "x", ip(1), now).unwrap(),
                Placed::Parked
            );
        }
    }

    #[test]
    fn early_streams_expire_and_unwanted_leftovers_are_dropped() {
        let now = Instant::now();
        let mut lot = ParkingLot::new();
        for i in 0..4u8 {
            lot.offer([i; TOKEN_LEN], 0, i, ip(i), now).unwrap();
        }
        lot.purge(now + EARLY_KEEP - Duration::from_millis(1));
        assert_eq!(lot.counts(), (0, 4));
        lot.purge(now + EARLY_KEEP);
        assert_eq!(lot.counts(), (0, 0));
        // An expired one no longer blocks the same key, and space is free again.
        let later = now + EARLY_KEEP;
        lot.offer([0; TOKEN_LEN], 0, 10, ip(0), now).unwrap();
        assert!(lot.offer([0; TOKEN_LEN], 0, 11, ip(0), later).is_ok());
        assert_eq!(lot.take(&[0; TOKEN_LEN], 0), Some(11));
        // Two waiters for one token: the streams stay until the last one is done.
        let token = [5u8; TOKEN_LEN];
        lot.want(token);
        lot.want(token);
        lot.offer(token, 0, 50, ip(5), later).unwrap();
        lot.offer(token, 1, 51, ip(5), later).unwrap();
        assert!(lot.unwant(token).is_empty());
        let mut left = lot.unwant(token);
        left.sort();
        assert_eq!(left, vec![50, 51]);
        assert!(lot.unwant(token).is_empty()); // one too many: harmless
                                               // Not wanted any more: a stream for it waits early again (and expires).
        assert!(matches!(
            lot.offer(token, 0, 52, ip(5), later),
            Ok(Placed::Early(_))
        ));
        lot.clear();
        assert_eq!(lot.counts(), (0, 0));
    }

    /// Opens `n` connections to `addr` that each send a reverse frame with a random
    /// token, and keeps them open.
    async fn strangers(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
        let mut conns = Vec::with_capacity(n);
        for _ in 0..n {
            let mut tcp = TcpStream::connect(addr).await.unwrap();
            let token: [u8; TOKEN_LEN] = rand::random();
            write_frame(&mut tcp, &route_frame(REVERSE_MAGIC, &token, 0))
                .await
                .unwrap();
            conns.push(tcp);
        }
        conns
    }

    /// Waits (bounded) until `node`'s parking lot holds `want` (see `parked_counts`).
    async fn parked_become(node: &Node, want: (usize, usize)) {
        for _ in 0..500 {
            if node.parked_counts() == want {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("parked {:?}, never {want:?}", node.parked_counts());
    }

    #[tokio::test]
    async fn a_refused_early_dial_back_is_dialed_again_and_taken_once_wanted() {
        crate::py::logging::capture::install();
        let a = node(7301, Some(b"k")).await;
        let b = node(7302, Some(b"k")).await;
        // Strangers from our address hold all of its share of the early area.
        let flood = strangers(a.local_addr(), 3 * MAX_EARLY_PER_SOURCE).await;
        parked_become(&a, (0, MAX_EARLY_PER_SOURCE)).await;
        let token = [7u8; TOKEN_LEN];
        let (sent, opened) = tokio::join!(
            async {
                // Only once b's early stream was refused (after the strangers' surplus)
                // does a ask for the link.
                let refusals = || {
                    crate::py::logging::capture::matching("peer 7301: reverse p2p stream from")
                        .len()
                };
                for _ in 0..500 {
                    if refusals() > 2 * MAX_EARLY_PER_SOURCE {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                assert!(refusals() > 2 * MAX_EARLY_PER_SOURCE);
                a.connect_pool_via(Route::Reverse(token), 7302, 5, 2, Purpose::Ring)
                    .await
            },
            b.open_inbound(Inbound::Reverse(a.local_addr(), token), None),
        );
        sent.unwrap();
        opened.unwrap();
        ring_pool_carries_data(&a, &b, (7301, 7302), 5).await;
        assert_eq!(a.parked_counts(), (0, MAX_EARLY_PER_SOURCE));
        drop(flood);
        a.close().await;
        assert_eq!(a.parked_counts(), (0, 0));
        b.close().await;
    }
}
