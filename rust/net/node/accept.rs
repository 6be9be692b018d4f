//! The listener's side: each accepted connection's first frame says what it is (a
//! p2p stream, the master's reachability check, a reverse or punched stream for a link
//! here, or garbage); p2p streams run the accepting handshakes and are filed into their
//! pools, refusals are logged at a level that says whose fault they likely are.

use super::routes::frame_token;
use super::{
    Node, LOG, MAX_PROBE_BYTES, PUNCH_MAGIC, PUNCH_SLOT, REACH_MAGIC, REVERSE_MAGIC, TOKEN_LEN,
};
use crate::error::{CoreError, CoreResult};
use crate::net::frame::write_frame;
use crate::net::handshake::{self, Purpose};
use crate::net::identity::GROUP_MASTER;
use crate::net::secure::{secure_accept_first, Auth};
use crate::net::stream::{read_first_frame, Transport, REACH_PROLOGUE};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::time::Instant;

impl Node {
    pub(super) async fn handle_incoming(self: Arc<Self>, mut tcp: TcpStream, remote: SocketAddr) {
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
                    target: LOG,
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
                    target: LOG,
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
            target: LOG,
            level,
            "peer {}: p2p connection from {remote} refused: {e}{hint}",
            self.peer_id()
        );
    }

    /// The accepting side of one stream over `tcp`, whoever opened it: the transport
    /// and p2p handshakes (bounded), then the stream goes where its purpose says.
    /// `first`: the dialer's first frame when already read. Returns the size of the pool
    /// the stream belongs to.
    pub(super) async fn accept_stream(
        &self,
        tcp: TcpStream,
        first: Option<Vec<u8>>,
    ) -> CoreResult<u16> {
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
                    target: LOG,
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
                    target: LOG,
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
                    target: LOG,
                    "peer {}: accepted p2p stream {index} of {pool} from peer {from} (epoch \
                     {epoch})",
                    self.peer_id()
                );
                Ok(pool)
            }
            Err((level, msg)) => {
                log::log!(
                    target: LOG,
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
}
