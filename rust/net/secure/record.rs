//! The record layer: each direction's nonce counter and key, the plaintext written
//! sealed into records, the records read opened (in the caller's buffer when a whole
//! record fits, see `DirKey`), and the authenticated end of stream.

use super::{Cipher, Provider, Role, Suite, MAX_PLAINTEXT, MAX_RECORD, TAG_LEN};
use snow::{HandshakeState, StatelessTransportState};
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The first nonce of either direction after the handshake: the handshake itself
/// sends no transport message.
pub const FIRST_NONCE: u64 = 0;

/// One direction's AES-256-GCM key, for suites whose records this module seals and
/// opens itself (`ReadState` then reads a record's ciphertext straight into the
/// caller's buffer and decrypts it there, with no copy). The records are the very Noise
/// transport messages snow would make: nonce `0^32 || n` big-endian, no AD; and
/// `rekey()` is Noise's REKEY (the first 32 bytes of the encryption of 32 zero bytes
/// under nonce 2^64 - 1), the same as snow's `rekey_outgoing` / `rekey_incoming`.
///
/// Two implementations of the same AES-256-GCM, byte for byte (see [`Aead`]): ring's,
/// and AWS-LC's where the CPU has AVX-512 with VAES and VPCLMULQDQ (its code for them
/// is about twice ring's VAES-AVX2 code on such a CPU; without them it is slower than
/// ring). Each end picks for itself: the two interoperate.
pub enum DirKey {
    Ring(Box<ring::aead::LessSafeKey>),
    AwsLc(Box<aws_lc_rs::aead::LessSafeKey>),
}

/// (sending, receiving) keys of one end, for `Suite { AesGcm, Ring }`.
pub(super) type Keys = Option<(DirKey, DirKey)>;

/// Which AES-GCM code seals and opens records in this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Aead {
    /// ring (BoringSSL's code): VAES-AVX2 where the CPU has it, AES-NI otherwise.
    Ring,
    /// AWS-LC: its AVX-512 VAES code.
    AwsLc,
}

impl Aead {
    /// AWS-LC where the CPU runs its AVX-512 VAES code, else ring. `PCCL_AEAD=ring` or
    /// `PCCL_AEAD=aws-lc` overrides it (for measuring one against the other); read once.
    pub fn chosen() -> Aead {
        static CHOSEN: std::sync::OnceLock<Aead> = std::sync::OnceLock::new();
        *CHOSEN.get_or_init(|| match std::env::var("PCCL_AEAD").as_deref() {
            Ok("ring") => Aead::Ring,
            Ok("aws-lc") => Aead::AwsLc,
            _ if Aead::cpu_has_wide_vaes() => Aead::AwsLc,
            _ => Aead::Ring,
        })
    }

    fn cpu_has_wide_vaes() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vl")
                && std::arch::is_x86_feature_detected!("vaes")
                && std::arch::is_x86_feature_detected!("vpclmulqdq")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }
}

fn nonce_bytes(nonce: u64) -> [u8; 12] {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&nonce.to_be_bytes());
    n
}

impl DirKey {
    fn new(raw: &[u8]) -> Option<DirKey> {
        DirKey::with(Aead::chosen(), raw)
    }

    /// A key of `raw` bytes sealed and opened by `aead`'s code.
    pub fn with(aead: Aead, raw: &[u8]) -> Option<DirKey> {
        match aead {
            Aead::Ring => ring::aead::UnboundKey::new(&ring::aead::AES_256_GCM, raw)
                .ok()
                .map(|k| DirKey::Ring(Box::new(ring::aead::LessSafeKey::new(k)))),
            Aead::AwsLc => aws_lc_rs::aead::UnboundKey::new(&aws_lc_rs::aead::AES_256_GCM, raw)
                .ok()
                .map(|k| DirKey::AwsLc(Box::new(aws_lc_rs::aead::LessSafeKey::new(k)))),
        }
    }

    /// The code this key runs.
    pub fn aead(&self) -> Aead {
        match self {
            DirKey::Ring(_) => Aead::Ring,
            DirKey::AwsLc(_) => Aead::AwsLc,
        }
    }

    /// From the handshake's split (`k1` protects dialer -> acceptor, `k2` the reverse),
    /// for `Suite { AesGcm, Ring }` only: (sending, receiving).
    pub(super) fn from_split(hs: &mut HandshakeState, role: Role, suite: Suite) -> Keys {
        if suite.cipher != Cipher::AesGcm || suite.provider != Provider::Ring {
            return None;
        }
        let (mut k1, mut k2) = hs.dangerously_get_raw_split();
        let (send, recv) = match role {
            Role::Dialer => (DirKey::new(&k1), DirKey::new(&k2)),
            Role::Acceptor => (DirKey::new(&k2), DirKey::new(&k1)),
        };
        k1.fill(0);
        k2.fill(0);
        Some((send?, recv?))
    }

    /// Decrypts the record `in_out` (ciphertext and tag) in place; the plaintext length.
    pub fn open(&self, nonce: u64, in_out: &mut [u8]) -> Option<usize> {
        let n = nonce_bytes(nonce);
        match self {
            DirKey::Ring(k) => k
                .open_in_place(
                    ring::aead::Nonce::assume_unique_for_key(n),
                    ring::aead::Aad::empty(),
                    in_out,
                )
                .ok()
                .map(|p| p.len()),
            DirKey::AwsLc(k) => k
                .open_in_place(
                    aws_lc_rs::aead::Nonce::assume_unique_for_key(n),
                    aws_lc_rs::aead::Aad::empty(),
                    in_out,
                )
                .ok()
                .map(|p| p.len()),
        }
    }

    /// Encrypts `payload` into `out` (which has room for it and the tag); the record's
    /// length.
    pub fn seal(&self, nonce: u64, payload: &[u8], out: &mut [u8]) -> Option<usize> {
        let len = payload.len();
        out[..len].copy_from_slice(payload);
        let n = nonce_bytes(nonce);
        let text = &mut out[..len];
        match self {
            DirKey::Ring(k) => {
                let tag = k
                    .seal_in_place_separate_tag(
                        ring::aead::Nonce::assume_unique_for_key(n),
                        ring::aead::Aad::empty(),
                        text,
                    )
                    .ok()?;
                out[len..len + TAG_LEN].copy_from_slice(tag.as_ref());
            }
            DirKey::AwsLc(k) => {
                let tag = k
                    .seal_in_place_separate_tag(
                        aws_lc_rs::aead::Nonce::assume_unique_for_key(n),
                        aws_lc_rs::aead::Aad::empty(),
                        text,
                    )
                    .ok()?;
                out[len..len + TAG_LEN].copy_from_slice(tag.as_ref());
            }
        }
        Some(len + TAG_LEN)
    }

    /// Noise's REKEY: the next key of this direction, by the same code.
    pub fn rekey(&mut self) {
        let mut next = [0u8; 32];
        let zeros = [0u8; 32];
        let mut out = [0u8; 32 + TAG_LEN];
        if self.seal(u64::MAX, &zeros, &mut out).is_some() {
            next.copy_from_slice(&out[..32]);
            if let Some(k) = DirKey::with(self.aead(), &next) {
                *self = k;
            }
        }
        next.fill(0);
        out.fill(0);
    }
}

fn integrity_error(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("secure stream: integrity check failed ({what})"),
    )
}

/// Receiving side of one direction: the record being read and the plaintext not yet
/// handed out.
pub(super) struct ReadState {
    cipher: Arc<StatelessTransportState>,
    nonce: u64,
    header: [u8; 4],
    header_got: usize,
    record: Vec<u8>,
    record_len: usize,
    record_got: usize,
    plain: Vec<u8>,
    plain_pos: usize,
    plain_len: usize,
    /// Authenticated end of stream received.
    closed: bool,
    failed: Option<(io::ErrorKind, String)>,
    /// Opens records here instead of through snow (see [`DirKey`]).
    key: Option<DirKey>,
    rekey_every: u64,
}

impl ReadState {
    pub(super) fn with_key(self, key: Option<DirKey>, rekey_every: u64) -> Self {
        ReadState {
            key,
            rekey_every,
            ..self
        }
    }

    /// One record opened: the next nonce, and the next key at each rekey boundary.
    fn advance(&mut self) {
        self.nonce += 1;
        if let Some(key) = &mut self.key {
            if self.nonce.is_multiple_of(self.rekey_every) {
                key.rekey();
            }
        }
    }

    /// The zero-copy path: a record's ciphertext read straight into the caller's
    /// buffer (which has room for it) and opened there. Only what one call reads can
    /// stay there (the next call may bring another buffer): a record not complete by
    /// then is moved to `self.record` and finished the usual way. `Ready(Ok(true))`:
    /// the record is in `buf`; `Ready(Ok(false))`: go on with `self.record`.
    fn poll_direct<R: AsyncRead + Unpin>(
        &mut self,
        io: &mut R,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<bool>> {
        let len = self.record_len;
        let dst = buf.initialize_unfilled_to(len);
        let mut got = 0;
        let mut pending = false;
        while got < len {
            let mut rb = ReadBuf::new(&mut dst[got..]);
            match Pin::new(&mut *io).poll_read(cx, &mut rb) {
                Poll::Ready(Ok(())) if rb.filled().is_empty() => break,
                Poll::Ready(Ok(())) => got += rb.filled().len(),
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {
                    pending = true;
                    break;
                }
            }
        }
        if got == len {
            if self.nonce == u64::MAX {
                return Poll::Ready(Err(integrity_error("nonce exhausted")));
            }
            let key = self.key.as_ref().expect("direct reads need the key");
            match key.open(self.nonce, &mut dst[..len]) {
                Some(n) if n == len - TAG_LEN => {}
                _ => {
                    dst[..len].fill(0);
                    return Poll::Ready(Err(integrity_error("a record did not authenticate")));
                }
            }
            self.advance();
            self.header_got = 0;
            self.record_len = 0;
            buf.advance(len - TAG_LEN);
            return Poll::Ready(Ok(true));
        }
        if self.record.len() < MAX_RECORD {
            self.record.resize(MAX_RECORD, 0);
        }
        self.record[..got].copy_from_slice(&dst[..got]);
        self.record_got = got;
        if pending {
            return Poll::Pending;
        }
        // The connection ended inside the record: the usual path reports it.
        Poll::Ready(Ok(false))
    }
    pub(super) fn new(cipher: Arc<StatelessTransportState>, nonce: u64) -> Self {
        ReadState {
            cipher,
            nonce,
            header: [0; 4],
            header_got: 0,
            record: Vec::new(),
            record_len: 0,
            record_got: 0,
            plain: Vec::new(),
            plain_pos: 0,
            plain_len: 0,
            closed: false,
            failed: None,
            key: None,
            rekey_every: u64::MAX,
        }
    }

    fn fail(&mut self, e: io::Error) -> Poll<io::Result<()>> {
        self.failed = Some((e.kind(), e.to_string()));
        Poll::Ready(Err(e))
    }

    pub(super) fn poll_read<R: AsyncRead + Unpin>(
        &mut self,
        io: &mut R,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if let Some((kind, msg)) = &self.failed {
            return Poll::Ready(Err(io::Error::new(*kind, msg.clone())));
        }
        loop {
            if self.plain_pos < self.plain_len {
                let n = (self.plain_len - self.plain_pos).min(buf.remaining());
                buf.put_slice(&self.plain[self.plain_pos..self.plain_pos + n]);
                self.plain_pos += n;
                return Poll::Ready(Ok(()));
            }
            if self.closed || buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            while self.header_got < 4 {
                let mut rb = ReadBuf::new(&mut self.header[self.header_got..]);
                if let Err(e) = ready!(Pin::new(&mut *io).poll_read(cx, &mut rb)) {
                    return self.fail(e);
                }
                let got = rb.filled().len();
                if got == 0 {
                    let what = if self.header_got == 0 {
                        "the connection ended without the end-of-stream record: the stream \
                         may have been truncated"
                    } else {
                        "the connection ended inside a record header"
                    };
                    return self.fail(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("secure stream: {what}"),
                    ));
                }
                self.header_got += got;
            }
            if self.record_len == 0 {
                let len = u32::from_be_bytes(self.header) as usize;
                if !(TAG_LEN..=MAX_RECORD).contains(&len) {
                    return self.fail(integrity_error("bad record length"));
                }
                self.record_len = len;
                self.record_got = 0;
                if self.key.is_some() && len > TAG_LEN && buf.remaining() >= len {
                    match self.poll_direct(io, cx, buf) {
                        Poll::Ready(Ok(true)) => return Poll::Ready(Ok(())),
                        Poll::Ready(Ok(false)) => {}
                        Poll::Ready(Err(e)) => return self.fail(e),
                        Poll::Pending => return Poll::Pending,
                    }
                }
                if self.record.len() < len {
                    self.record.resize(MAX_RECORD, 0);
                }
            }
            while self.record_got < self.record_len {
                let mut rb = ReadBuf::new(&mut self.record[self.record_got..self.record_len]);
                if let Err(e) = ready!(Pin::new(&mut *io).poll_read(cx, &mut rb)) {
                    return self.fail(e);
                }
                let got = rb.filled().len();
                if got == 0 {
                    return self.fail(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "secure stream: integrity check failed (the connection ended inside \
                         a record)",
                    ));
                }
                self.record_got += got;
            }
            let len = self.record_len;
            self.header_got = 0;
            self.record_len = 0;
            if self.nonce == u64::MAX {
                return self.fail(integrity_error("nonce exhausted"));
            }
            let nonce = self.nonce;
            let plain_len = len - TAG_LEN;
            // Big reads decrypt straight into the caller's buffer (ring wants room for
            // the tag too, or it decrypts into a temporary and copies).
            let direct = plain_len > 0 && buf.remaining() >= len;
            let out = if direct {
                buf.initialize_unfilled_to(len)
            } else {
                if self.plain.len() < len {
                    self.plain.resize(MAX_RECORD, 0);
                }
                &mut self.plain[..len]
            };
            let opened = match &self.key {
                Some(key) => {
                    // (A copy, then the record is opened in place, as snow would.)
                    out[..len].copy_from_slice(&self.record[..len]);
                    key.open(nonce, &mut out[..len])
                }
                None => self
                    .cipher
                    .read_message(nonce, &self.record[..len], out)
                    .ok(),
            };
            match opened {
                Some(n) if n == plain_len => {}
                _ => {
                    // Whatever a failed decryption left there is no one's business.
                    out.fill(0);
                    return self.fail(integrity_error("a record did not authenticate"));
                }
            }
            self.advance();
            if plain_len == 0 {
                self.closed = true;
                return Poll::Ready(Ok(()));
            }
            if direct {
                buf.advance(plain_len);
                return Poll::Ready(Ok(()));
            }
            self.plain_pos = 0;
            self.plain_len = plain_len;
        }
    }
}

/// Sending side of one direction: plaintext gathered for the next record, and the
/// sealed record being written out.
pub(super) struct WriteState {
    cipher: Arc<StatelessTransportState>,
    nonce: u64,
    plain: Vec<u8>,
    out: Vec<u8>,
    out_pos: usize,
    out_len: usize,
    /// The end-of-stream record has been sealed.
    closed: bool,
    failed: Option<(io::ErrorKind, String)>,
    /// Seals records here instead of through snow (see [`DirKey`]).
    key: Option<DirKey>,
    rekey_every: u64,
}

impl WriteState {
    pub(super) fn new(cipher: Arc<StatelessTransportState>, nonce: u64) -> Self {
        WriteState {
            cipher,
            nonce,
            plain: Vec::new(),
            out: Vec::new(),
            out_pos: 0,
            out_len: 0,
            closed: false,
            failed: None,
            key: None,
            rekey_every: u64::MAX,
        }
    }

    pub(super) fn with_key(self, key: Option<DirKey>, rekey_every: u64) -> Self {
        WriteState {
            key,
            rekey_every,
            ..self
        }
    }

    fn check(&self) -> io::Result<()> {
        match &self.failed {
            Some((kind, msg)) => Err(io::Error::new(*kind, msg.clone())),
            None => Ok(()),
        }
    }

    fn fail<T>(&mut self, e: io::Error) -> Poll<io::Result<T>> {
        self.failed = Some((e.kind(), e.to_string()));
        Poll::Ready(Err(e))
    }

    /// Seals `payload` (from `self.plain` when `None`) into `out`, which must be empty.
    pub(super) fn seal(&mut self, payload: Option<&[u8]>) -> io::Result<()> {
        debug_assert_eq!(self.out_pos, self.out_len);
        if self.nonce == u64::MAX {
            return Err(io::Error::other("secure stream: nonce exhausted"));
        }
        if self.out.len() < 4 + MAX_RECORD {
            self.out.resize(4 + MAX_RECORD, 0);
        }
        let payload = payload.unwrap_or(&self.plain);
        let n = match &mut self.key {
            Some(key) => key
                .seal(self.nonce, payload, &mut self.out[4..])
                .ok_or_else(|| io::Error::other("secure stream: encryption failed"))?,
            None => self
                .cipher
                .write_message(self.nonce, payload, &mut self.out[4..])
                .map_err(|e| io::Error::other(format!("secure stream: encryption failed: {e}")))?,
        };
        self.nonce += 1;
        if let Some(key) = &mut self.key {
            if self.nonce.is_multiple_of(self.rekey_every) {
                key.rekey();
            }
        }
        self.out[..4].copy_from_slice(&(n as u32).to_be_bytes());
        self.out_pos = 0;
        self.out_len = 4 + n;
        self.plain.clear();
        Ok(())
    }

    /// Writes out the sealed record.
    fn poll_drain<W: AsyncWrite + Unpin>(
        &mut self,
        io: &mut W,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        while self.out_pos < self.out_len {
            match ready!(Pin::new(&mut *io).poll_write(cx, &self.out[self.out_pos..self.out_len])) {
                Ok(0) => return self.fail(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.out_pos += n,
                Err(e) => return self.fail(e),
            }
        }
        Poll::Ready(Ok(()))
    }

    pub(super) fn poll_write<W: AsyncWrite + Unpin>(
        &mut self,
        io: &mut W,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.check()?;
        if self.closed {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "secure stream: write after shutdown",
            )));
        }
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        loop {
            let draining = self.out_pos < self.out_len;
            if draining {
                match self.poll_drain(io, cx) {
                    Poll::Ready(Ok(())) => {}
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    // Keep gathering while the socket is busy, up to one record.
                    Poll::Pending if self.plain.len() < MAX_PLAINTEXT => {}
                    Poll::Pending => return Poll::Pending,
                }
            }
            let out_empty = self.out_pos == self.out_len;
            if out_empty && self.plain.is_empty() && buf.len() >= MAX_PLAINTEXT {
                // A whole record straight from the caller's buffer: one copy less.
                if let Err(e) = self.seal(Some(&buf[..MAX_PLAINTEXT])) {
                    return self.fail(e);
                }
                return Poll::Ready(Ok(MAX_PLAINTEXT));
            }
            if self.plain.len() == MAX_PLAINTEXT {
                if !out_empty {
                    continue; // drained above unless pending (returned then)
                }
                if let Err(e) = self.seal(None) {
                    return self.fail(e);
                }
                continue;
            }
            if self.plain.capacity() < MAX_PLAINTEXT {
                self.plain.reserve_exact(MAX_PLAINTEXT - self.plain.len());
            }
            let n = (MAX_PLAINTEXT - self.plain.len()).min(buf.len());
            self.plain.extend_from_slice(&buf[..n]);
            if self.plain.len() == MAX_PLAINTEXT && out_empty {
                if let Err(e) = self.seal(None) {
                    return self.fail(e);
                }
            }
            return Poll::Ready(Ok(n));
        }
    }

    pub(super) fn poll_flush<W: AsyncWrite + Unpin>(
        &mut self,
        io: &mut W,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        self.check()?;
        loop {
            ready!(self.poll_drain(io, cx))?;
            if self.plain.is_empty() {
                break;
            }
            if let Err(e) = self.seal(None) {
                return self.fail(e);
            }
        }
        match ready!(Pin::new(&mut *io).poll_flush(cx)) {
            Ok(()) => Poll::Ready(Ok(())),
            Err(e) => self.fail(e),
        }
    }

    pub(super) fn poll_shutdown<W: AsyncWrite + Unpin>(
        &mut self,
        io: &mut W,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.closed {
            ready!(self.poll_flush(io, cx))?;
            if let Err(e) = self.seal(Some(&[])) {
                return self.fail(e);
            }
            self.closed = true;
        }
        self.check()?;
        ready!(self.poll_drain(io, cx))?;
        match ready!(Pin::new(&mut *io).poll_shutdown(cx)) {
            Ok(()) => Poll::Ready(Ok(())),
            Err(e) => self.fail(e),
        }
    }
}
