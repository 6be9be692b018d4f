//! Dialing and accepting the secure channel over a tokio stream (the handshake under a
//! timeout, then the record layer), and the encrypted stream with its owned halves.

use super::handshake::{Auth, Handshake, HandshakeFailure};
use super::record::{Keys, ReadState, WriteState, FIRST_NONCE};
use super::{Role, Suite, MAX_HANDSHAKE_FRAME, SUITE};
use crate::error::{CoreError, CoreResult};
use crate::net::frame::{read_frame, write_frame};
use crate::net::identity::Remote;
use snow::StatelessTransportState;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

async fn read_hs<R: AsyncRead + Unpin>(r: &mut R, buf: &mut Vec<u8>) -> CoreResult<()> {
    match read_frame(r, buf, MAX_HANDSHAKE_FRAME).await {
        Ok(true) => Ok(()),
        Ok(false) => Err(CoreError::PeerConnection(
            "the peer closed the connection during the secure handshake".into(),
        )),
        Err(CoreError::Protocol(m)) => Err(CoreError::PeerConnection(format!(
            "garbage during the secure handshake: {m}"
        ))),
        Err(e) => Err(e),
    }
}

/// A read half and a write half used as one stream (for the handshake, and for
/// `SecureStream::into_split` over streams that come split already).
#[derive(Debug)]
pub struct Joined<R, W> {
    pub read: R,
    pub write: W,
}

impl<R: AsyncRead + Unpin, W: Unpin> AsyncRead for Joined<R, W> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().read).poll_read(cx, buf)
    }
}

impl<R: Unpin, W: AsyncWrite + Unpin> AsyncWrite for Joined<R, W> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().write).poll_write(cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().write).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().write).poll_shutdown(cx)
    }
}

async fn run_handshake<T: AsyncRead + AsyncWrite + Unpin>(
    io: &mut T,
    role: Role,
    auth: &Auth,
    prologue: &[u8],
    suite: Suite,
    first: Option<Vec<u8>>,
) -> CoreResult<(StatelessTransportState, Keys, Remote)> {
    let mut hs = Handshake::new(role == Role::Dialer, auth.clone(), prologue, suite)?;
    if role == Role::Dialer {
        let hello = hs.hello()?;
        write_frame(io, &hello).await?;
    }
    let mut pending = first;
    let mut frame = Vec::with_capacity(MAX_HANDSHAKE_FRAME);
    while !hs.is_done() {
        match pending.take() {
            Some(f) => frame = f,
            None => read_hs(io, &mut frame).await?,
        }
        match hs.on_frame(&frame) {
            Ok(Some(out)) => write_frame(io, &out).await?,
            Ok(None) => {}
            Err(HandshakeFailure { reply, error }) => {
                if let Some(reply) = reply {
                    // Best effort: the peer may be gone.
                    let _ = write_frame(io, &reply).await;
                }
                return Err(error);
            }
        }
    }
    Ok(hs.into_parts().expect("the handshake is done"))
}

async fn handshake<T: AsyncRead + AsyncWrite + Unpin>(
    io: &mut T,
    role: Role,
    auth: &Auth,
    prologue: &[u8],
    timeout: Duration,
    suite: Suite,
    first: Option<Vec<u8>>,
) -> CoreResult<(ReadState, WriteState, Remote)> {
    let (transport, key, remote) = tokio::time::timeout(
        timeout,
        run_handshake(io, role, auth, prologue, suite, first),
    )
    .await
    .map_err(|_| {
        CoreError::PeerConnection(format!(
            "the secure handshake did not finish within {timeout:?}"
        ))
    })??;
    let cipher = Arc::new(transport);
    let (send, recv) = match key {
        Some((s, r)) => (Some(s), Some(r)),
        None => (None, None),
    };
    let every = suite.rekey_every.max(1);
    Ok((
        ReadState::new(cipher.clone(), FIRST_NONCE).with_key(recv, every),
        WriteState::new(cipher, FIRST_NONCE).with_key(send, every),
        remote,
    ))
}

/// Dials the secure channel over a connected `stream` (the side that opened it), as a
/// fresh node that takes any peer (tests, benches): `secure_dial_as` says who.
/// `psk`: `Some(psk_from_secret(secret))` to authenticate the peer by a shared secret.
/// `prologue`: the context both sides must agree on (protocol label, version, ...).
pub async fn secure_dial<S: AsyncRead + AsyncWrite + Unpin>(
    stream: S,
    psk: Option<&[u8; 32]>,
    prologue: &[u8],
    timeout: Duration,
) -> CoreResult<SecureStream<S>> {
    secure_dial_as(stream, &Auth::ephemeral(psk), prologue, timeout).await
}

/// `secure_dial` as the node `auth` says, checking the other end as it says.
pub async fn secure_dial_as<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    auth: &Auth,
    prologue: &[u8],
    timeout: Duration,
) -> CoreResult<SecureStream<S>> {
    let (r, w, remote) = handshake(
        &mut stream,
        Role::Dialer,
        auth,
        prologue,
        timeout,
        SUITE,
        None,
    )
    .await?;
    Ok(SecureStream::new(stream, r, w, remote))
}

/// The accepting side of `secure_dial`.
pub async fn secure_accept<S: AsyncRead + AsyncWrite + Unpin>(
    stream: S,
    psk: Option<&[u8; 32]>,
    prologue: &[u8],
    timeout: Duration,
) -> CoreResult<SecureStream<S>> {
    secure_accept_first(stream, None, &Auth::ephemeral(psk), prologue, timeout).await
}

/// The accepting side when the dialer's first frame has been read already (by a
/// listener that looks at it to tell secure, clear and other hellos apart).
pub async fn secure_accept_first<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    first: Option<Vec<u8>>,
    auth: &Auth,
    prologue: &[u8],
    timeout: Duration,
) -> CoreResult<SecureStream<S>> {
    let (r, w, remote) = handshake(
        &mut stream,
        Role::Acceptor,
        auth,
        prologue,
        timeout,
        SUITE,
        first,
    )
    .await?;
    Ok(SecureStream::new(stream, r, w, remote))
}

/// `secure_dial` over a stream split already (e.g. `TcpStream::into_split()`).
pub async fn secure_dial_split<R, W>(
    read: R,
    write: W,
    psk: Option<&[u8; 32]>,
    prologue: &[u8],
    timeout: Duration,
) -> CoreResult<(SecureReadHalf<R>, SecureWriteHalf<W>)>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    secure_split_with(Joined { read, write }, true, psk, prologue, timeout, SUITE).await
}

/// Either side with an explicit suite (for `secure_bench`).
#[doc(hidden)]
pub async fn secure_split_with<R, W>(
    mut io: Joined<R, W>,
    dial: bool,
    psk: Option<&[u8; 32]>,
    prologue: &[u8],
    timeout: Duration,
    suite: Suite,
) -> CoreResult<(SecureReadHalf<R>, SecureWriteHalf<W>)>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let role = if dial { Role::Dialer } else { Role::Acceptor };
    let auth = Auth::ephemeral(psk);
    let (r, w, _) = handshake(&mut io, role, &auth, prologue, timeout, suite, None).await?;
    Ok((
        SecureReadHalf {
            io: io.read,
            state: r,
        },
        SecureWriteHalf {
            io: io.write,
            state: w,
        },
    ))
}

/// An encrypted stream after `secure_dial` / `secure_accept`.
pub struct SecureStream<S> {
    io: S,
    read: ReadState,
    write: WriteState,
    remote: Remote,
}

impl<S> SecureStream<S> {
    fn new(io: S, read: ReadState, write: WriteState, remote: Remote) -> Self {
        SecureStream {
            io,
            read,
            write,
            remote,
        }
    }

    /// Who the other end proved to be in the handshake.
    pub fn remote(&self) -> &Remote {
        &self.remote
    }

    pub fn get_ref(&self) -> &S {
        &self.io
    }
}

impl<S> std::fmt::Debug for SecureStream<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecureStream").finish_non_exhaustive()
    }
}

/// Streams that split into owned halves, for `SecureStream::into_split`.
pub trait SplitIo {
    type Read: AsyncRead + Unpin;
    type Write: AsyncWrite + Unpin;
    fn split_io(self) -> (Self::Read, Self::Write);
}

impl SplitIo for tokio::net::TcpStream {
    type Read = tokio::net::tcp::OwnedReadHalf;
    type Write = tokio::net::tcp::OwnedWriteHalf;
    fn split_io(self) -> (Self::Read, Self::Write) {
        self.into_split()
    }
}

impl SplitIo for tokio::io::DuplexStream {
    type Read = tokio::io::ReadHalf<tokio::io::DuplexStream>;
    type Write = tokio::io::WriteHalf<tokio::io::DuplexStream>;
    fn split_io(self) -> (Self::Read, Self::Write) {
        tokio::io::split(self)
    }
}

impl<R: AsyncRead + Unpin, W: AsyncWrite + Unpin> SplitIo for Joined<R, W> {
    type Read = R;
    type Write = W;
    fn split_io(self) -> (R, W) {
        (self.read, self.write)
    }
}

impl<S: SplitIo> SecureStream<S> {
    /// Independent halves, each with its own cipher direction and nonce (no lock).
    /// Buffered plaintext and a half-written record go with their half.
    pub fn into_split(self) -> (SecureReadHalf<S::Read>, SecureWriteHalf<S::Write>) {
        let (r, w) = self.io.split_io();
        (
            SecureReadHalf {
                io: r,
                state: self.read,
            },
            SecureWriteHalf {
                io: w,
                state: self.write,
            },
        )
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for SecureStream<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.read.poll_read(&mut this.io, cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for SecureStream<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.write.poll_write(&mut this.io, cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.write.poll_flush(&mut this.io, cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.write.poll_shutdown(&mut this.io, cx)
    }
}

/// The receiving half of a secure stream.
pub struct SecureReadHalf<R> {
    io: R,
    state: ReadState,
}

/// The sending half of a secure stream. Call `shutdown()` to end the stream: the peer
/// takes an end without it for a truncation.
pub struct SecureWriteHalf<W> {
    io: W,
    state: WriteState,
}

impl<R> SecureReadHalf<R> {
    pub fn get_ref(&self) -> &R {
        &self.io
    }
}

impl<W> SecureWriteHalf<W> {
    pub fn get_ref(&self) -> &W {
        &self.io
    }
}

impl<R> std::fmt::Debug for SecureReadHalf<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecureReadHalf").finish_non_exhaustive()
    }
}

impl<W> std::fmt::Debug for SecureWriteHalf<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecureWriteHalf").finish_non_exhaustive()
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for SecureReadHalf<R> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.state.poll_read(&mut this.io, cx, buf)
    }
}

impl<W: AsyncWrite + Unpin> AsyncWrite for SecureWriteHalf<W> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.state.poll_write(&mut this.io, cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.state.poll_flush(&mut this.io, cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.state.poll_shutdown(&mut this.io, cx)
    }
}
