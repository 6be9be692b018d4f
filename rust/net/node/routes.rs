//! How a ring edge's TCP streams are opened when the sender cannot simply dial the
//! receiver: the master's `Route` for the sending side and `Inbound` for the receiving
//! one (reverse dials, the relay on the master's port, hole punching with the relay as
//! the fallback), and the route frames that open such streams.

use super::{
    hung_up, reusable_socket, zero_linger, Node, LOG, PUNCH_MAGIC, PUNCH_PORTS, PUNCH_SLOT,
    PUNCH_TIMEOUT, REDIAL_PAUSE, REDIAL_PAUSE_MAX, RELAY_MAGIC, REVERSE_MAGIC, TOKEN_LEN,
};
use crate::error::{CoreError, CoreResult};
use crate::net::frame::write_frame;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::time::Instant;

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
pub(super) fn frame_token(frame: &[u8]) -> [u8; TOKEN_LEN] {
    parse_token(&frame[8..8 + TOKEN_LEN]).expect("a checked route frame")
}

pub(super) fn route_frame(magic: &[u8; 8], token: &[u8; TOKEN_LEN], stream: u16) -> Vec<u8> {
    let mut f = Vec::with_capacity(8 + TOKEN_LEN + 2);
    f.extend_from_slice(magic);
    f.extend_from_slice(token);
    f.extend_from_slice(&stream.to_be_bytes());
    f
}

impl Node {
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
                            target: LOG,
                            "peer {}: hole punched a ring link from {remote}",
                            self.peer_id()
                        );
                        return self.accept_stream(tcp, None).await.map(|_| ());
                    }
                    Err(e) => {
                        log::warn!(
                            target: LOG,
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
    pub(super) async fn open_tcp(
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
}
