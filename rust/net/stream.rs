//! `P2PStream`: what every p2p stream between peers is once dialed or accepted: encrypted
//! and integrity-protected by `secure/` (the default), or clear TCP when the node was
//! configured `insecure` (both ends must agree; see `node/`).
//!
//! Writes are buffered on the secure variant: `flush()` after every complete message.

use crate::error::{CoreError, CoreResult};
use crate::net::frame::{read_frame, write_frame};
use crate::net::identity::{Identity, PublicKey, Remote, GROUP_PEER};
use crate::net::secure::{self, Auth, SecureReadHalf, SecureStream, SecureWriteHalf};
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

/// One p2p stream, encrypted (default) or clear (`insecure`).
#[derive(Debug)]
pub enum P2PStream {
    Clear(TcpStream),
    Secure(Box<SecureStream<TcpStream>>),
}

/// The receiving half of a `P2PStream`.
#[derive(Debug)]
pub enum P2PReadHalf {
    Clear(OwnedReadHalf),
    Secure(SecureReadHalf<OwnedReadHalf>),
}

/// The sending half of a `P2PStream`.
#[derive(Debug)]
pub enum P2PWriteHalf {
    Clear(OwnedWriteHalf),
    Secure(SecureWriteHalf<OwnedWriteHalf>),
}

impl P2PStream {
    /// Independent halves (no lock between them).
    pub fn into_split(self) -> (P2PReadHalf, P2PWriteHalf) {
        match self {
            P2PStream::Clear(s) => {
                let (r, w) = s.into_split();
                (P2PReadHalf::Clear(r), P2PWriteHalf::Clear(w))
            }
            P2PStream::Secure(s) => {
                let (r, w) = (*s).into_split();
                (P2PReadHalf::Secure(r), P2PWriteHalf::Secure(w))
            }
        }
    }

    pub fn is_secure(&self) -> bool {
        matches!(self, P2PStream::Secure(_))
    }

    /// Who the other end proved to be (None in clear text).
    pub fn remote(&self) -> Option<&Remote> {
        match self {
            P2PStream::Clear(_) => None,
            P2PStream::Secure(s) => Some(s.remote()),
        }
    }

    /// The TCP stream underneath.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            P2PStream::Clear(s) => s,
            P2PStream::Secure(s) => s.get_ref(),
        }
    }
}

macro_rules! delegate_read {
    ($ty:ident) => {
        impl AsyncRead for $ty {
            fn poll_read(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &mut ReadBuf<'_>,
            ) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    $ty::Clear(s) => Pin::new(s).poll_read(cx, buf),
                    $ty::Secure(s) => Pin::new(s).poll_read(cx, buf),
                }
            }
        }
    };
}

macro_rules! delegate_write {
    ($ty:ident) => {
        impl AsyncWrite for $ty {
            fn poll_write(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &[u8],
            ) -> Poll<io::Result<usize>> {
                match self.get_mut() {
                    $ty::Clear(s) => Pin::new(s).poll_write(cx, buf),
                    $ty::Secure(s) => Pin::new(s).poll_write(cx, buf),
                }
            }
            fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    $ty::Clear(s) => Pin::new(s).poll_flush(cx),
                    $ty::Secure(s) => Pin::new(s).poll_flush(cx),
                }
            }
            fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    $ty::Clear(s) => Pin::new(s).poll_shutdown(cx),
                    $ty::Secure(s) => Pin::new(s).poll_shutdown(cx),
                }
            }
        }
    };
}

delegate_read!(P2PStream);
delegate_write!(P2PStream);
delegate_read!(P2PReadHalf);
delegate_write!(P2PWriteHalf);

/// Hashed into every p2p secure handshake (after `secure::PROLOGUE_LABEL`).
pub const PROLOGUE: &[u8] = b"pccl p2p v2";
/// Hashed into the master's reachability check (`node/accept.rs`, `REACH_MAGIC`).
pub const REACH_PROLOGUE: &[u8] = b"pccl reach v1";

/// How the node's streams are protected: derived once from the node config.
#[derive(Clone, Debug)]
pub enum Transport {
    /// Noise XX (XXpsk3 with the shared secret's PSK) as the node's identity; every
    /// other end must be a peer (by certificate, where the node checks them).
    Secure(Box<Auth>),
    /// Clear text (`insecure`): the peer must be configured the same.
    Clear,
}

impl Transport {
    pub fn new(secret: Option<&[u8]>, insecure: bool, identity: Arc<Identity>) -> Self {
        if insecure {
            Transport::Clear
        } else {
            Transport::Secure(Box::new(Auth {
                identity,
                psk: secret.map(secure::psk_from_secret),
                also: Vec::new(),
                group: GROUP_PEER,
                expect: None,
            }))
        }
    }

    /// The same transport with the secrets of a rotation: `secret` dialed with, `also`
    /// (older ones) still accepted. A secret cannot be added or taken away this way, nor
    /// clear text changed.
    pub fn with_secrets(&self, secret: Option<&[u8]>, also: &[Vec<u8>]) -> CoreResult<Self> {
        match self {
            Transport::Secure(auth) if auth.psk.is_some() == secret.is_some() => {
                Ok(Transport::Secure(Box::new(Auth {
                    psk: secret.map(secure::psk_from_secret),
                    also: also.iter().map(|s| secure::psk_from_secret(s)).collect(),
                    ..(**auth).clone()
                })))
            }
            _ => Err(CoreError::InvalidUsage(
                "the secrets of a running node can be rotated, not added, removed or \
                 turned into clear text"
                    .into(),
            )),
        }
    }

    pub fn is_secure(&self) -> bool {
        matches!(self, Transport::Secure(_))
    }

    /// The dialing side over a connected `tcp` stream; `expect`: the static key the
    /// other end must prove it holds (the roster's key of the peer dialed).
    pub async fn dial(
        &self,
        tcp: TcpStream,
        timeout: Duration,
        expect: Option<PublicKey>,
    ) -> CoreResult<P2PStream> {
        match self {
            Transport::Secure(auth) => {
                let auth = Auth {
                    expect,
                    ..(**auth).clone()
                };
                Ok(P2PStream::Secure(Box::new(
                    secure::secure_dial_as(tcp, &auth, PROLOGUE, timeout).await?,
                )))
            }
            Transport::Clear => {
                let mut tcp = tcp;
                let clear = async {
                    write_frame(&mut tcp, secure::CLEAR_HELLO).await?;
                    let mut buf = Vec::new();
                    if !read_frame(&mut tcp, &mut buf, secure::MAX_HANDSHAKE_FRAME).await? {
                        return Err(CoreError::PeerConnection(
                            "the peer closed the connection before accepting a clear-text \
                             stream"
                                .into(),
                        ));
                    }
                    match buf.as_slice() {
                        [0] => Ok(()),
                        [secure::STATUS_TRANSPORT_MISMATCH] => Err(CoreError::Authentication(
                            "the peer, or something on the path, says it encrypts its p2p \
                             streams and we run in clear text (insecure=True); every peer \
                             must use the same `insecure` setting"
                                .into(),
                        )),
                        _ => Err(CoreError::Protocol(
                            "the remote end does not speak the pccl p2p protocol".into(),
                        )),
                    }
                };
                tokio::time::timeout(timeout, clear).await.map_err(|_| {
                    CoreError::PeerConnection(format!(
                        "the clear-text transport hello got no answer within {timeout:?}"
                    ))
                })??;
                Ok(P2PStream::Clear(tcp))
            }
        }
    }

    /// The accepting side.
    pub async fn accept(&self, mut tcp: TcpStream, timeout: Duration) -> CoreResult<P2PStream> {
        let first = tokio::time::timeout(timeout, read_first_frame(&mut tcp))
            .await
            .map_err(|_| {
                CoreError::PeerConnection(format!("no transport hello within {timeout:?}"))
            })??;
        self.accept_first(tcp, first, timeout).await
    }

    /// The accepting side when the dialer's first frame has been read already.
    pub async fn accept_first(
        &self,
        mut tcp: TcpStream,
        first: Vec<u8>,
        timeout: Duration,
    ) -> CoreResult<P2PStream> {
        match self {
            Transport::Secure(auth) => Ok(P2PStream::Secure(Box::new(
                secure::secure_accept_first(tcp, Some(first), auth, PROLOGUE, timeout).await?,
            ))),
            Transport::Clear => {
                let clear = async {
                    if first.as_slice() == secure::CLEAR_HELLO {
                        write_frame(&mut tcp, &[0]).await
                    } else if first.starts_with(secure::HELLO_MAGIC) {
                        let _ = write_frame(&mut tcp, &[secure::STATUS_TRANSPORT_MISMATCH]).await;
                        Err(CoreError::Authentication(
                            "the peer encrypts its p2p streams and we run in clear text \
                             (insecure=True); every peer must use the same `insecure` setting"
                                .into(),
                        ))
                    } else {
                        Err(CoreError::Protocol(
                            "garbage instead of a p2p hello (not a pccl peer)".into(),
                        ))
                    }
                };
                tokio::time::timeout(timeout, clear).await.map_err(|_| {
                    CoreError::PeerConnection(format!(
                        "no clear-text transport hello within {timeout:?}"
                    ))
                })??;
                Ok(P2PStream::Clear(tcp))
            }
        }
    }
}

/// The first frame a dialer sends on a p2p port (any of the hellos), capped at
/// `secure::MAX_HANDSHAKE_FRAME`.
pub async fn read_first_frame(tcp: &mut TcpStream) -> CoreResult<Vec<u8>> {
    let mut buf = Vec::new();
    match read_frame(tcp, &mut buf, secure::MAX_HANDSHAKE_FRAME).await {
        Ok(true) => Ok(buf),
        Ok(false) => Err(CoreError::PeerConnection(
            "the peer closed the connection before its hello".into(),
        )),
        Err(CoreError::Protocol(m)) => Err(CoreError::PeerConnection(format!(
            "garbage instead of a p2p hello: {m}"
        ))),
        Err(e) => Err(e),
    }
}
