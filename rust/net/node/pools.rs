//! Pools of authenticated streams, by peer, epoch and purpose: dialing them (over any
//! route), filing accepted ones, handing them out, dropping old epochs; and the
//! transfer streams of shared-state fetches, kept idle between fetches from a source.

use super::routes::Route;
use super::{Node, LOG, MAX_POOL, TOKEN_LEN};
use crate::error::{CoreError, CoreResult};
use crate::net::handshake::{self, Purpose, StreamHello};
use crate::net::stream::P2PStream;
use std::net::SocketAddr;
use std::time::Duration;

/// How transfer streams reach a holder behind NAT: (relay, token, streams so far).
pub(super) type TransferRelay = (SocketAddr, [u8; TOKEN_LEN], u16);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PoolKey {
    pub peer: u64,
    pub epoch: u64,
    pub purpose: Purpose,
}

/// Streams of one pool, indexed by stream number.
pub(super) struct Pool {
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

/// Most idle transfer streams kept per source.
const MAX_IDLE_TRANSFERS: usize = 16;

impl Node {
    /// Files an accepted stream; on refusal, why and how loudly to say so (the lock is
    /// released by then: never log under it).
    pub(super) fn file_inbound(
        &self,
        h: StreamHello,
        stream: P2PStream,
    ) -> Result<(), (log::Level, String)> {
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
                            target: LOG,
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
                            target: LOG,
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
            target: LOG,
            "peer {}: {n} p2p stream(s) open to peer {to} via {route:?} ({purpose:?}, epoch \
             {epoch})",
            self.peer_id()
        );
        Ok(())
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
}
