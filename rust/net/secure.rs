//! An encrypted, authenticated byte stream over any tokio stream: a Noise handshake
//! (the `snow` crate) followed by a record layer. Every p2p stream runs over it (`stream.rs`).
//!
//! ```text
//! dialer   -> acceptor : HELLO_MAGIC[8] | n u8 | cipher u8 | n x psk id[4] | noise msg 1 (-> e)
//! acceptor -> dialer   : status u8 | chosen u8 | noise msg 2   (<- e, ee, s, es; its certificate)
//! dialer   -> acceptor : status u8 | noise msg 3   (-> s, se, [psk]; its certificate)
//! acceptor -> dialer   : status u8 [| reason]      (the verdict)
//! then both ways       : records, u32 BE length | Noise transport message
//! ```
//! Each handshake message is one frame (`frame.rs`, capped at `MAX_HANDSHAKE_FRAME`).
//! The pattern is `Noise_XXpsk3_25519_<cipher>_SHA256` with a pre-shared key (from the
//! group secret, mixed in last; a captured handshake gives only the 4-byte PSK ids of the
//! hello to test guesses of a secret against, hence secrets of 128 random bits or more),
//! `Noise_XX_25519_<cipher>_SHA256` without. Each end proves its static key (its node
//! identity, `identity.rs`) and checks the other's as its `Auth` says: the key it
//! expects (a dialer that knows whom it dials), and the certificate in the payload when
//! the node trusts run keys. A refusal is `STATUS_REFUSED` and a reason, raised at the
//! other end as `CoreError::Identity`. Status bytes are not authenticated: what they say
//! is reported as "the peer, or something on the path, says ...". A Diffie-Hellman
//! result of all zeros (a low-order point) fails the handshake (`CheckedDh25519`). The
//! prologue (`PROLOGUE_LABEL`, then the caller's context) is hashed into the handshake,
//! so peers with different contexts fail it. Message 3 confirms the keys to the
//! acceptor; the acceptor's first record confirms them (and the PSK) to the dialer.
//!
//! A node may hold several secrets while the run's secret is rotated (`Auth::also`):
//! the dialer offers the ids of all of them (`psk_id`, its current one first), the
//! acceptor takes the first offered one it holds too and says which (`chosen`), and both
//! mix that one in at message 3. So a node that already has the new secret and one that
//! still has only the old one agree on the old one, without a second try. An id is a
//! hash keyed by the PSK and bound to the hello's ephemeral key (`psk_id`). `n` is 0
//! without a secret.
//!
//! Records carry at most `MAX_PLAINTEXT` bytes; the nonce of each direction is a
//! counter kept by the half that uses it (no lock between the halves), so a modified,
//! truncated, reordered, injected, dropped or replayed record fails decryption and the
//! stream fails for good with an `InvalidData` I/O error saying "integrity check failed"
//! (`CoreError::io` makes it `PeerConnection`). The writer ends the stream with an
//! authenticated empty record (`shutdown()`); an end of stream without it is an error
//! (`UnexpectedEof`), so a cut cannot pass for the end.
//!
//! A peer configured for clear text (`insecure`, see `net/stream.rs`) dials with the
//! one frame `CLEAR_HELLO` instead; an encrypting acceptor answers it, and a clear
//! acceptor answers a `HELLO_MAGIC` hello, with the one status byte
//! `STATUS_TRANSPORT_MISMATCH`, so both ends fail at once with `CoreError::Authentication`
//! instead of waiting for each other.
//!
//! Writes are buffered into records like a `BufWriter`: call `flush()` when a message is
//! complete and the peer should see it.
//!
//! Reads with room for a whole record take its ciphertext straight into the caller's
//! buffer and, with the default suite, open it there with ring (`DirKey`: each
//! direction's key from the handshake's split), so a received byte is copied once, by
//! the kernel. A record that one read does not bring whole is finished in the stream's
//! own buffer. The default suite seals with ring too, and each direction changes its
//! key every `REKEY_INTERVAL` records (Noise REKEY). Either way the records on the wire
//! are Noise transport messages, as snow would make them.

use crate::error::{CoreError, CoreResult};
use crate::net::frame::{read_frame, write_frame};
use crate::net::identity::{self, fingerprint_hex, Identity, PublicKey, Remote};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use snow::{HandshakeState, StatelessTransportState};
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// First bytes of the dialer's first handshake frame.
pub const HELLO_MAGIC: &[u8; 8] = b"PCCLSEC\x03";
/// The whole first frame of a dialer that does not encrypt (`insecure`).
pub const CLEAR_HELLO: &[u8; 8] = b"PCCLCLR\x01";
/// Hashed into every handshake before the caller's prologue.
pub const PROLOGUE_LABEL: &[u8] = b"pccl secure transport v2";
/// Messages 2 and 3 carry a certificate (`identity::MAX_CERT`) besides the keys.
pub const MAX_HANDSHAKE_FRAME: usize = 1024;
/// Longest reason text a refusal (`STATUS_REFUSED`) carries.
const MAX_REASON: usize = 400;
/// Largest Noise message, and so the largest record body (ciphertext and tag).
pub const MAX_RECORD: usize = 65535;
pub const TAG_LEN: usize = 16;
/// Largest plaintext of one record.
pub const MAX_PLAINTEXT: usize = MAX_RECORD - TAG_LEN;
const PSK_SALT: &[u8] = b"pccl secure transport psk v1";
/// Secrets one node holds at most: its current one and those still accepted while the
/// run's secret is rotated.
pub const MAX_PSKS: usize = 4;
/// Bytes of a PSK's id in the hello.
pub const PSK_ID_LEN: usize = 4;

const STATUS_OK: u8 = 0;
const STATUS_AUTH_FAILED: u8 = 1;
const STATUS_MODE_MISMATCH: u8 = 2;
const STATUS_CIPHER_MISMATCH: u8 = 3;
/// One end encrypts, the other runs in clear text (`insecure`).
pub const STATUS_TRANSPORT_MISMATCH: u8 = 4;
/// The other end's identity was refused; a UTF-8 reason follows the status byte.
pub const STATUS_REFUSED: u8 = 5;
/// The acceptor holds none of the secrets the dialer offered.
const STATUS_NO_COMMON_SECRET: u8 = 6;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cipher {
    AesGcm,
    ChaChaPoly,
}

impl Cipher {
    fn noise_name(self) -> &'static str {
        match self {
            Cipher::AesGcm => "AESGCM",
            Cipher::ChaChaPoly => "ChaChaPoly",
        }
    }

    fn wire(self) -> u8 {
        match self {
            Cipher::AesGcm => 1,
            Cipher::ChaChaPoly => 2,
        }
    }
}

/// The cipher of every session. `secure_bench`, 1 GiB over loopback TCP on a 2-core x86
/// VM with AES-NI/VAES: clear 4000 MB/s, AESGCM 1300-1450 MB/s (ring; 870 RustCrypto),
/// ChaChaPoly 1070 MB/s (ring; 830 RustCrypto). ChaChaPoly wins only without AES hardware.
pub const CIPHER: Cipher = Cipher::AesGcm;

/// Which implementation of the cipher: only `secure_bench` picks anything but `Ring`.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Provider {
    /// ring's assembly, falling back to pure Rust for what ring lacks (X25519).
    Ring,
    /// RustCrypto's `aes-gcm` / `chacha20poly1305` (snow's default resolver).
    RustCrypto,
}

#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Suite {
    pub cipher: Cipher,
    pub provider: Provider,
    /// Records per direction between two REKEYs (only for the suite whose records are
    /// sealed here: `AesGcm` with `Ring`; the others never rekey).
    pub rekey_every: u64,
}

/// Each direction of a stream changes its key every this many records (Noise REKEY):
/// 2^24 records, at most 1 TiB under one key.
pub const REKEY_INTERVAL: u64 = 1 << 24;

pub const SUITE: Suite = Suite {
    cipher: CIPHER,
    provider: Provider::Ring,
    rekey_every: REKEY_INTERVAL,
};

/// The 32-byte Noise PSK for a shared secret of any length: HKDF-SHA256 (RFC 5869) with
/// a fixed salt and an empty info.
pub fn psk_from_secret(secret: &[u8]) -> [u8; 32] {
    hkdf_sha256_32(PSK_SALT, secret, b"")
}

/// The id by which a dialer offers a PSK in a hello whose ephemeral key is `e`: keyed
/// by the PSK and bound to `e`, so ids do not link connections, and none can be
/// computed ahead. (An id does let whoever sees it test guesses of the secret offline;
/// that is why secrets must be keys of 128 random bits or more, `check_secret`.)
pub fn psk_id(psk: &[u8; 32], e: &[u8]) -> [u8; PSK_ID_LEN] {
    let h = hkdf_sha256_32(b"pccl secure transport psk id v1", psk, e);
    [h[0], h[1], h[2], h[3]]
}

/// Length of the dialer's ephemeral key at the front of Noise message 1.
const EPHEMERAL_LEN: usize = 32;

fn hkdf_sha256_32(salt: &[u8], ikm: &[u8], info: &[u8]) -> [u8; 32] {
    let mut extract = <Hmac<Sha256> as Mac>::new_from_slice(salt).expect("any key length");
    extract.update(ikm);
    let prk = extract.finalize().into_bytes();
    let mut expand = <Hmac<Sha256> as Mac>::new_from_slice(&prk).expect("any key length");
    expand.update(info);
    expand.update(&[1]);
    expand.finalize().into_bytes().into()
}

// ---------------------------------------------------------------------------------------
// Handshake

#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Dialer,
    Acceptor,
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

fn noise_params(psk: bool, cipher: Cipher) -> snow::params::NoiseParams {
    let pattern = if psk { "XXpsk3" } else { "XX" };
    format!("Noise_{pattern}_25519_{}_SHA256", cipher.noise_name())
        .parse()
        .expect("a valid Noise protocol name")
}

/// X25519 for snow that refuses a low-order peer point (`identity::x25519`).
#[derive(Default)]
struct CheckedDh25519 {
    secret: [u8; 32],
    public: [u8; 32],
    /// The node's static key pair, known already: `set` with its secret takes its
    /// public half from here instead of a scalar multiplication per handshake.
    known: Option<([u8; 32], [u8; 32])>,
}

impl snow::types::Dh for CheckedDh25519 {
    fn name(&self) -> &'static str {
        "25519"
    }
    fn pub_len(&self) -> usize {
        32
    }
    fn priv_len(&self) -> usize {
        32
    }
    fn set(&mut self, privkey: &[u8]) {
        self.secret.copy_from_slice(&privkey[..32]);
        self.public = match self.known {
            Some((secret, public)) if secret == self.secret => public,
            _ => identity::x25519_public(&self.secret),
        };
    }
    fn generate(&mut self, rng: &mut dyn snow::types::Random) -> Result<(), snow::Error> {
        let mut secret = [0u8; 32];
        rng.try_fill_bytes(&mut secret)?;
        self.set(&secret);
        secret.fill(0);
        Ok(())
    }
    fn pubkey(&self) -> &[u8] {
        &self.public
    }
    fn privkey(&self) -> &[u8] {
        &self.secret
    }
    fn dh(&self, pubkey: &[u8], out: &mut [u8]) -> Result<(), snow::Error> {
        let public: [u8; 32] = pubkey
            .get(..32)
            .and_then(|p| p.try_into().ok())
            .ok_or(snow::Error::Dh)?;
        let shared = identity::x25519(&self.secret, &public).ok_or(snow::Error::Dh)?;
        out[..32].copy_from_slice(&shared);
        Ok(())
    }
}

impl Drop for CheckedDh25519 {
    fn drop(&mut self) {
        self.secret.fill(0);
        if let Some((secret, _)) = &mut self.known {
            secret.fill(0);
        }
    }
}

/// snow's resolver for the suite, with `CheckedDh25519` for the Diffie-Hellman (told
/// the node's static key pair).
struct Resolver(snow::resolvers::BoxedCryptoResolver, ([u8; 32], [u8; 32]));

impl Drop for Resolver {
    fn drop(&mut self) {
        self.1 .0.fill(0);
    }
}

impl snow::resolvers::CryptoResolver for Resolver {
    fn resolve_rng(&self) -> Option<Box<dyn snow::types::Random>> {
        self.0.resolve_rng()
    }
    fn resolve_dh(&self, choice: &snow::params::DHChoice) -> Option<Box<dyn snow::types::Dh>> {
        match choice {
            snow::params::DHChoice::Curve25519 => Some(Box::new(CheckedDh25519 {
                known: Some(self.1),
                ..Default::default()
            })),
            _ => None,
        }
    }
    fn resolve_hash(
        &self,
        choice: &snow::params::HashChoice,
    ) -> Option<Box<dyn snow::types::Hash>> {
        self.0.resolve_hash(choice)
    }
    fn resolve_cipher(
        &self,
        choice: &snow::params::CipherChoice,
    ) -> Option<Box<dyn snow::types::Cipher>> {
        self.0.resolve_cipher(choice)
    }
}

fn build_state(
    role: Role,
    auth: &Auth,
    prologue: &[u8],
    suite: Suite,
) -> CoreResult<HandshakeState> {
    use snow::resolvers::{DefaultResolver, FallbackResolver, RingResolver};
    let params = noise_params(auth.psk.is_some(), suite.cipher);
    let inner: snow::resolvers::BoxedCryptoResolver = match suite.provider {
        Provider::Ring => Box::new(FallbackResolver::new(
            Box::new(RingResolver),
            Box::new(DefaultResolver),
        )),
        Provider::RustCrypto => Box::new(DefaultResolver),
    };
    let key = auth.identity.key();
    let resolver = Resolver(inner, (*key.secret(), *key.public()));
    let mut builder = snow::Builder::with_resolver(params, Box::new(resolver))
        .prologue(prologue)
        .map_err(noise_setup)?
        .local_private_key(auth.identity.key().secret())
        .map_err(noise_setup)?;
    if let Some(psk) = &auth.psk {
        builder = builder.psk(3, psk).map_err(noise_setup)?;
    }
    match role {
        Role::Dialer => builder.build_initiator(),
        Role::Acceptor => builder.build_responder(),
    }
    .map_err(noise_setup)
}

fn noise_setup(e: snow::Error) -> CoreError {
    CoreError::InvalidUsage(format!("setting up the Noise handshake failed: {e}"))
}

fn full_prologue(prologue: &[u8]) -> Vec<u8> {
    let mut p = Vec::with_capacity(PROLOGUE_LABEL.len() + 4 + prologue.len());
    p.extend_from_slice(PROLOGUE_LABEL);
    p.extend_from_slice(&(prologue.len() as u32).to_be_bytes());
    p.extend_from_slice(prologue);
    p
}

fn auth_failed(what: &str) -> CoreError {
    CoreError::Authentication(format!(
        "secure handshake failed: {what} (different shared secrets or session contexts, \
         or the handshake was tampered with)"
    ))
}

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

/// Who a handshake speaks as and what it asks of the other end.
#[derive(Clone)]
pub struct Auth {
    /// This node's static key and certificate, and what it trusts.
    pub identity: Arc<Identity>,
    /// The pre-shared key from the group secret, mixed in last (`XXpsk3`).
    pub psk: Option<[u8; 32]>,
    /// More PSKs this node still holds while the secret is rotated (older ones): offered
    /// after `psk` and accepted like it. Only with `psk`; at most `MAX_PSKS - 1` count.
    pub also: Vec<[u8; 32]>,
    /// The group the other end's certificate must name (when certificates are checked).
    pub group: &'static str,
    /// The static key the other end must have (a dialer that knows whom it dials).
    pub expect: Option<PublicKey>,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("identity", &self.identity)
            .field("psk", &self.psk.map(|_| "<redacted>"))
            .field("also", &self.also.len())
            .field("group", &self.group)
            .field("expect", &self.expect.map(|k| fingerprint_hex(&k)))
            .finish()
    }
}

impl Auth {
    /// A fresh key, no certificates, any peer: what tests and benches use.
    pub fn ephemeral(psk: Option<&[u8; 32]>) -> Auth {
        Auth {
            identity: Identity::ephemeral(),
            psk: psk.copied(),
            also: Vec::new(),
            group: identity::GROUP_PEER,
            expect: None,
        }
    }

    /// The PSKs this node offers and accepts, its current one first (none without one).
    pub fn psks(&self) -> Vec<[u8; 32]> {
        match self.psk {
            None => Vec::new(),
            Some(k) => std::iter::once(k)
                .chain(self.also.iter().copied().filter(|o| *o != k))
                .take(MAX_PSKS)
                .collect(),
        }
    }

    /// Checks the other end's static key and certificate (`payload`).
    fn check(&self, remote_static: Option<&[u8]>, payload: &[u8]) -> CoreResult<Remote> {
        let key = remote_static.ok_or_else(|| {
            CoreError::Protocol("secure handshake: the peer sent no static key".into())
        })?;
        if let Some(expect) = &self.expect {
            if key != expect {
                return Err(CoreError::Identity(format!(
                    "the peer presents key {}, not key {} that the roster names for it (a \
                     relay, or something on the path, tried to stand in for it)",
                    fingerprint_hex(key),
                    fingerprint_hex(expect)
                )));
            }
        }
        self.identity.check_remote(key, payload, self.group)
    }
}

/// A handshake step that failed: the frame to send the peer first (a status byte that
/// tells it why, when it should know), and the error.
#[derive(Debug)]
pub struct HandshakeFailure {
    pub reply: Option<Vec<u8>>,
    pub error: CoreError,
}

impl HandshakeFailure {
    fn quiet(error: CoreError) -> Self {
        HandshakeFailure { reply: None, error }
    }
    fn status(status: u8, error: CoreError) -> Self {
        HandshakeFailure {
            reply: Some(vec![status]),
            error,
        }
    }
    /// Refuses the other end's identity and tells it why (`STATUS_REFUSED` + text).
    fn refused(error: CoreError) -> Self {
        let mut reply = vec![STATUS_REFUSED];
        let text = error.to_string();
        let mut cut = text.len().min(MAX_REASON);
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        reply.extend_from_slice(&text.as_bytes()[..cut]);
        HandshakeFailure {
            reply: Some(reply),
            error,
        }
    }
}

/// The other end's refusal (`STATUS_REFUSED` + text) as our error. The text is not
/// authenticated: anything on the path could have sent it.
fn refusal(frame: &[u8]) -> CoreError {
    let text = String::from_utf8_lossy(&frame[1..frame.len().min(1 + MAX_REASON)]);
    let text: String = text.chars().filter(|c| !c.is_control()).collect();
    CoreError::Identity(format!(
        "the peer, or something on the path, refused our identity: {text}"
    ))
}

enum HsState {
    /// Noise messages still to exchange (the dialer before its hello is sent, or waiting
    /// for the reply; the acceptor waiting for the hello or the dialer's identity).
    Noise(Box<HandshakeState>),
    /// The acceptor answered the hello and waits for the dialer's identity (message 3).
    Identity(Box<HandshakeState>),
    /// The dialer sent its identity and waits for the acceptor's verdict.
    Verdict(StatelessTransportState, Keys),
    Done(StatelessTransportState, Keys),
    Failed,
}

/// One direction's AES-256-GCM key, for suites whose records this module seals and
/// opens itself with ring (`ReadState` then reads a record's ciphertext straight into
/// the caller's buffer and decrypts it there, with no copy). The records are the very
/// Noise transport messages snow would make: nonce `0^32 || n` big-endian, no AD; and
/// `rekey()` is Noise's REKEY (the first 32 bytes of the encryption of 32 zero bytes
/// under nonce 2^64 - 1), the same as snow's `rekey_outgoing` / `rekey_incoming`.
pub struct DirKey(Box<ring::aead::LessSafeKey>);

/// (sending, receiving) keys of one end, for `Suite { AesGcm, Ring }`.
type Keys = Option<(DirKey, DirKey)>;

fn ring_nonce(nonce: u64) -> ring::aead::Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&nonce.to_be_bytes());
    ring::aead::Nonce::assume_unique_for_key(n)
}

impl DirKey {
    fn new(raw: &[u8]) -> Option<DirKey> {
        ring::aead::UnboundKey::new(&ring::aead::AES_256_GCM, raw)
            .ok()
            .map(|k| DirKey(Box::new(ring::aead::LessSafeKey::new(k))))
    }

    /// From the handshake's split (`k1` protects dialer -> acceptor, `k2` the reverse),
    /// for `Suite { AesGcm, Ring }` only: (sending, receiving).
    fn from_split(hs: &mut HandshakeState, role: Role, suite: Suite) -> Keys {
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
    fn open(&self, nonce: u64, in_out: &mut [u8]) -> Option<usize> {
        self.0
            .open_in_place(ring_nonce(nonce), ring::aead::Aad::empty(), in_out)
            .ok()
            .map(|p| p.len())
    }

    /// Encrypts `payload` into `out` (which has room for it and the tag); the record's
    /// length.
    fn seal(&self, nonce: u64, payload: &[u8], out: &mut [u8]) -> Option<usize> {
        let n = payload.len();
        out[..n].copy_from_slice(payload);
        let tag = self
            .0
            .seal_in_place_separate_tag(ring_nonce(nonce), ring::aead::Aad::empty(), &mut out[..n])
            .ok()?;
        out[n..n + TAG_LEN].copy_from_slice(tag.as_ref());
        Some(n + TAG_LEN)
    }

    /// Noise's REKEY: the next key of this direction.
    fn rekey(&mut self) {
        let mut next = [0u8; 32];
        let sealed = self.0.seal_in_place_separate_tag(
            ring_nonce(u64::MAX),
            ring::aead::Aad::empty(),
            &mut next,
        );
        if sealed.is_ok() {
            if let Some(k) = DirKey::new(&next) {
                *self = k;
            }
        }
        next.fill(0);
    }
}

/// The secure handshake as a state machine without I/O: frames in, frames out. The
/// async functions below drive it over a tokio stream; `py::secure` drives it from
/// asyncio for the control plane. Either way the bytes on the wire are the same.
///
/// Dialer: `hello()`, then `on_frame(msg 2)` gives msg 3 to send, `on_frame(verdict)`
/// gives nothing, and it is done. Acceptor: `on_frame(hello)` gives msg 2,
/// `on_frame(msg 3)` gives the verdict to send, and it is done. A failure poisons the
/// handshake. `remote()` then says who the other end proved to be.
pub struct Handshake {
    role: Role,
    auth: Auth,
    suite: Suite,
    state: HsState,
    hello_sent: bool,
    remote: Option<Remote>,
}

fn noise_err(e: snow::Error) -> CoreError {
    CoreError::PeerConnection(format!("secure handshake: {e}"))
}

impl Handshake {
    /// `prologue`: the caller's context; `PROLOGUE_LABEL` is put in front here.
    pub fn new(dial: bool, auth: Auth, prologue: &[u8], suite: Suite) -> CoreResult<Self> {
        let role = if dial { Role::Dialer } else { Role::Acceptor };
        let hs = build_state(role, &auth, &full_prologue(prologue), suite)?;
        Ok(Handshake {
            role,
            auth,
            suite,
            state: HsState::Noise(Box::new(hs)),
            hello_sent: false,
            remote: None,
        })
    }

    pub fn is_done(&self) -> bool {
        matches!(self.state, HsState::Done(..))
    }

    /// Who the other end proved to be (its static key; its certificate when this node
    /// checks them), once its identity was checked.
    pub fn remote(&self) -> Option<&Remote> {
        self.remote.as_ref()
    }

    /// The session keys, once done.
    pub fn into_transport(self) -> Option<StatelessTransportState> {
        self.into_parts().map(|(t, _, _)| t)
    }

    /// The session keys, the receiving key for opening records directly and the other
    /// end's identity, once done.
    fn into_parts(self) -> Option<(StatelessTransportState, Keys, Remote)> {
        match (self.state, self.remote) {
            (HsState::Done(t, k), Some(r)) => Some((t, k, r)),
            _ => None,
        }
    }

    /// This node's certificate (or nothing), the payload of its identity message.
    fn own_cert(&self) -> &[u8] {
        self.auth.identity.cert().unwrap_or(&[])
    }

    /// The dialer's first frame.
    pub fn hello(&mut self) -> CoreResult<Vec<u8>> {
        let HsState::Noise(hs) = &mut self.state else {
            return Err(CoreError::InvalidUsage(
                "secure handshake: hello out of turn".into(),
            ));
        };
        if self.role != Role::Dialer || self.hello_sent {
            return Err(CoreError::InvalidUsage(
                "secure handshake: hello out of turn".into(),
            ));
        }
        let mut msg = [0u8; MAX_HANDSHAKE_FRAME];
        let n = hs.write_message(&[], &mut msg).map_err(noise_err)?;
        self.hello_sent = true;
        let offered = self.auth.psks();
        let mut hello = Vec::with_capacity(10 + PSK_ID_LEN * offered.len() + n);
        hello.extend_from_slice(HELLO_MAGIC);
        hello.push(offered.len() as u8);
        hello.push(self.suite.cipher.wire());
        for psk in &offered {
            hello.extend_from_slice(&psk_id(psk, &msg[..EPHEMERAL_LEN.min(n)]));
        }
        hello.extend_from_slice(&msg[..n]);
        Ok(hello)
    }

    /// Takes the peer's next frame; returns the frame to answer with, if any.
    pub fn on_frame(&mut self, frame: &[u8]) -> Result<Option<Vec<u8>>, HandshakeFailure> {
        let state = std::mem::replace(&mut self.state, HsState::Failed);
        let (next, out) = match (self.role, state) {
            (Role::Dialer, HsState::Noise(hs)) if self.hello_sent => {
                self.dialer_reply(*hs, frame)?
            }
            (Role::Dialer, HsState::Verdict(t, k)) => (dialer_verdict(t, k, frame)?, None),
            (Role::Acceptor, HsState::Noise(hs)) => self.acceptor_hello(*hs, frame)?,
            (Role::Acceptor, HsState::Identity(hs)) => self.acceptor_identity(*hs, frame)?,
            _ => {
                return Err(HandshakeFailure::quiet(CoreError::InvalidUsage(
                    "secure handshake: a frame out of turn".into(),
                )))
            }
        };
        self.state = next;
        Ok(out)
    }

    fn dialer_reply(
        &mut self,
        mut hs: HandshakeState,
        frame: &[u8],
    ) -> Result<(HsState, Option<Vec<u8>>), HandshakeFailure> {
        let fail = |e| Err(HandshakeFailure::quiet(e));
        match frame.first().copied() {
            Some(STATUS_OK) => {}
            Some(STATUS_AUTH_FAILED) => {
                return fail(auth_failed(
                    "the peer, or something on the path, says it could not authenticate us",
                ))
            }
            Some(STATUS_MODE_MISMATCH) => {
                return fail(CoreError::Authentication(if self.auth.psk.is_some() {
                    "secure handshake failed: we use a shared secret and the peer, or \
                     something on the path, says it has none"
                        .into()
                } else {
                    "secure handshake failed: the peer, or something on the path, says it \
                     requires a shared secret and we have none"
                        .into()
                }))
            }
            Some(STATUS_TRANSPORT_MISMATCH) => {
                return fail(CoreError::Authentication(
                    "secure handshake failed: the peer, or something on the path, says it \
                     runs in clear text; we encrypt, and will not talk to it in clear text"
                        .into(),
                ))
            }
            Some(STATUS_CIPHER_MISMATCH) => {
                return fail(CoreError::Protocol(
                    "secure handshake failed: the peer, or something on the path, says it \
                     uses another cipher (another pccl version?)"
                        .into(),
                ))
            }
            Some(STATUS_REFUSED) => return fail(refusal(frame)),
            Some(STATUS_NO_COMMON_SECRET) => {
                return fail(CoreError::Authentication(
                    "secure handshake failed: the peer, or something on the path, says it \
                     holds none of the shared secrets we offered (a different secret, or ours \
                     was rotated out of the run)"
                        .into(),
                ))
            }
            _ => {
                return fail(CoreError::PeerConnection(
                    "garbage during the secure handshake (bad status)".into(),
                ))
            }
        }
        // The PSK the acceptor chose of those offered: mixed in at message 3.
        let offered = self.auth.psks();
        let chosen = frame.get(1).map(|&c| c as usize);
        match (chosen, offered.is_empty()) {
            (Some(0), true) => {}
            (Some(c), false) if c < offered.len() => {
                hs.set_psk(3, &offered[c])
                    .map_err(|e| HandshakeFailure::quiet(noise_err(e)))?;
            }
            _ => {
                return fail(CoreError::PeerConnection(
                    "garbage during the secure handshake (no such secret offered)".into(),
                ))
            }
        }
        let remote = self.read_identity(&mut hs, &frame[2..], "handshake reply")?;
        let mut msg = [0u8; MAX_HANDSHAKE_FRAME];
        let n = hs
            .write_message(self.own_cert(), &mut msg)
            .map_err(|e| HandshakeFailure::quiet(noise_err(e)))?;
        let (transport, key) = self.session_keys(hs)?;
        self.remote = Some(remote);
        let mut out = Vec::with_capacity(1 + n);
        out.push(STATUS_OK);
        out.extend_from_slice(&msg[..n]);
        Ok((HsState::Verdict(transport, key), Some(out)))
    }

    /// Reads the message in which the other end proves its static key (message 2 for
    /// the dialer, 3 for the acceptor) and checks that key and the certificate it
    /// carries, as `auth` says. `what`: the message, for the error.
    fn read_identity(
        &self,
        hs: &mut HandshakeState,
        body: &[u8],
        what: &str,
    ) -> Result<Remote, HandshakeFailure> {
        let mut payload = [0u8; MAX_HANDSHAKE_FRAME];
        let n = hs.read_message(body, &mut payload).map_err(|_| {
            HandshakeFailure::status(
                STATUS_AUTH_FAILED,
                auth_failed(&format!("the peer's {what} did not authenticate")),
            )
        })?;
        self.auth
            .check(hs.get_remote_static(), &payload[..n])
            .map_err(HandshakeFailure::refused)
    }

    /// The session keys of a finished Noise exchange (and ring's, for this suite).
    fn session_keys(
        &self,
        mut hs: HandshakeState,
    ) -> Result<(StatelessTransportState, Keys), HandshakeFailure> {
        let key = DirKey::from_split(&mut hs, self.role, self.suite);
        let transport = hs
            .into_stateless_transport_mode()
            .map_err(|e| HandshakeFailure::quiet(noise_err(e)))?;
        Ok((transport, key))
    }

    fn acceptor_hello(
        &self,
        mut hs: HandshakeState,
        frame: &[u8],
    ) -> Result<(HsState, Option<Vec<u8>>), HandshakeFailure> {
        if frame == CLEAR_HELLO {
            return Err(HandshakeFailure::status(
                STATUS_TRANSPORT_MISMATCH,
                CoreError::Authentication(
                    "secure handshake failed: the peer dials in clear text (insecure=True); \
                     we encrypt and refuse it (that peer must drop insecure=True)"
                        .into(),
                ),
            ));
        }
        if frame.len() < 10 || &frame[..8] != HELLO_MAGIC {
            return Err(HandshakeFailure::quiet(CoreError::PeerConnection(
                "garbage during the secure handshake (not a pccl secure hello)".into(),
            )));
        }
        let (offered, their_cipher) = (frame[8] as usize, frame[9]);
        let body_at = 10 + PSK_ID_LEN * offered;
        if offered > MAX_PSKS || frame.len() < body_at + EPHEMERAL_LEN {
            return Err(HandshakeFailure::quiet(CoreError::PeerConnection(
                "garbage during the secure handshake (bad secret offer)".into(),
            )));
        }
        let their_psk = offered > 0;
        if their_psk != self.auth.psk.is_some() {
            let m = if self.auth.psk.is_some() {
                "secure handshake failed: we require a shared secret and the peer has none"
            } else {
                "secure handshake failed: the peer uses a shared secret and we have none"
            };
            return Err(HandshakeFailure::status(
                STATUS_MODE_MISMATCH,
                CoreError::Authentication(m.into()),
            ));
        }
        if their_cipher != self.suite.cipher.wire() {
            return Err(HandshakeFailure::status(
                STATUS_CIPHER_MISMATCH,
                CoreError::Protocol(format!(
                    "secure handshake failed: the peer uses cipher {their_cipher}, we use {:?} \
                     (another pccl version?)",
                    self.suite.cipher
                )),
            ));
        }
        // The first secret offered that this node holds too (the dialer's order: its
        // current one first).
        let mine = self.auth.psks();
        let mut chosen = 0u8;
        if their_psk {
            let e = &frame[body_at..body_at + EPHEMERAL_LEN];
            let found = frame[10..body_at]
                .chunks(PSK_ID_LEN)
                .enumerate()
                .find_map(|(i, id)| mine.iter().find(|k| psk_id(k, e) == id).map(|k| (i, k)));
            let Some((i, psk)) = found else {
                return Err(HandshakeFailure::status(
                    STATUS_NO_COMMON_SECRET,
                    CoreError::Authentication(format!(
                        "secure handshake failed: none of the {offered} shared secret(s) the \
                         peer offered is one of ours (different secrets, or one rotated out \
                         of this run)"
                    )),
                ));
            };
            hs.set_psk(3, psk)
                .map_err(|e| HandshakeFailure::quiet(noise_err(e)))?;
            chosen = i as u8;
        }
        let mut scratch = [0u8; MAX_HANDSHAKE_FRAME];
        if hs.read_message(&frame[body_at..], &mut scratch).is_err() {
            // (With a PSK the hello's empty payload is authenticated under the prologue;
            // the PSK itself is mixed in only at message 3, so nothing here can be
            // used to guess it offline.)
            return Err(HandshakeFailure::status(
                STATUS_AUTH_FAILED,
                auth_failed("the peer's hello did not authenticate"),
            ));
        }
        let mut msg = [0u8; MAX_HANDSHAKE_FRAME];
        let n = hs
            .write_message(self.own_cert(), &mut msg)
            .map_err(|e| HandshakeFailure::quiet(noise_err(e)))?;
        let mut reply = Vec::with_capacity(2 + n);
        reply.push(STATUS_OK);
        reply.push(chosen);
        reply.extend_from_slice(&msg[..n]);
        Ok((HsState::Identity(Box::new(hs)), Some(reply)))
    }

    /// The dialer's message 3: its static key and certificate (and the PSK's proof).
    fn acceptor_identity(
        &mut self,
        mut hs: HandshakeState,
        frame: &[u8],
    ) -> Result<(HsState, Option<Vec<u8>>), HandshakeFailure> {
        match frame.first().copied() {
            Some(STATUS_OK) => {}
            Some(STATUS_AUTH_FAILED) => {
                return Err(HandshakeFailure::quiet(auth_failed(
                    "the peer, or something on the path, says it could not authenticate us",
                )))
            }
            Some(STATUS_REFUSED) => return Err(HandshakeFailure::quiet(refusal(frame))),
            _ => {
                return Err(HandshakeFailure::quiet(CoreError::PeerConnection(
                    "garbage during the secure handshake (bad status)".into(),
                )))
            }
        }
        let remote = self.read_identity(&mut hs, &frame[1..], "identity message")?;
        let (transport, key) = self.session_keys(hs)?;
        self.remote = Some(remote);
        Ok((HsState::Done(transport, key), Some(vec![STATUS_OK])))
    }
}

fn dialer_verdict(
    transport: StatelessTransportState,
    key: Keys,
    frame: &[u8],
) -> Result<HsState, HandshakeFailure> {
    match frame.first().copied() {
        Some(STATUS_OK) if frame.len() == 1 => Ok(HsState::Done(transport, key)),
        Some(STATUS_AUTH_FAILED) => Err(HandshakeFailure::quiet(auth_failed(
            "the peer, or something on the path, says it could not authenticate us",
        ))),
        Some(STATUS_REFUSED) => Err(HandshakeFailure::quiet(refusal(frame))),
        _ => Err(HandshakeFailure::quiet(CoreError::PeerConnection(
            "garbage during the secure handshake (bad status)".into(),
        ))),
    }
}

/// The first nonce of either direction after the handshake: the handshake itself
/// sends no transport message.
pub const FIRST_NONCE: u64 = 0;

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

// ---------------------------------------------------------------------------------------
// Record layer

fn integrity_error(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("secure stream: integrity check failed ({what})"),
    )
}

/// Receiving side of one direction: the record being read and the plaintext not yet
/// handed out.
struct ReadState {
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
    fn with_key(self, key: Option<DirKey>, rekey_every: u64) -> Self {
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
    fn new(cipher: Arc<StatelessTransportState>, nonce: u64) -> Self {
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

    fn poll_read<R: AsyncRead + Unpin>(
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
struct WriteState {
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
    fn new(cipher: Arc<StatelessTransportState>, nonce: u64) -> Self {
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

    fn with_key(self, key: Option<DirKey>, rekey_every: u64) -> Self {
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
    fn seal(&mut self, payload: Option<&[u8]>) -> io::Result<()> {
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

    fn poll_write<W: AsyncWrite + Unpin>(
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

    fn poll_flush<W: AsyncWrite + Unpin>(
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

    fn poll_shutdown<W: AsyncWrite + Unpin>(
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

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, RngCore, SeedableRng};
    use std::future::Future;
    use std::sync::Mutex;
    use tokio::io::{duplex, AsyncReadExt, AsyncWriteExt, DuplexStream};
    use tokio::net::{TcpListener, TcpStream};

    const HS_TIMEOUT: Duration = Duration::from_secs(10);
    const PROLOGUE: &[u8] = b"pccl-test p2p v1";

    /// Every test runs under this limit.
    async fn within<F: Future>(f: F) -> F::Output {
        tokio::time::timeout(Duration::from_secs(120), f)
            .await
            .expect("test timed out")
    }

    fn random_bytes(rng: &mut StdRng, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        rng.fill_bytes(&mut v);
        v
    }

    async fn handshake_pair(
        dial_psk: Option<[u8; 32]>,
        accept_psk: Option<[u8; 32]>,
        dial_prologue: &[u8],
        accept_prologue: &[u8],
    ) -> (
        CoreResult<SecureStream<DuplexStream>>,
        CoreResult<SecureStream<DuplexStream>>,
    ) {
        let (a, b) = duplex(1 << 16);
        tokio::join!(
            secure_dial(a, dial_psk.as_ref(), dial_prologue, HS_TIMEOUT),
            secure_accept(b, accept_psk.as_ref(), accept_prologue, HS_TIMEOUT),
        )
    }

    /// Writes `data` in random chunks with random flushes, then ends the stream.
    async fn send_all<W: AsyncWrite + Unpin>(mut w: W, data: Vec<u8>, seed: u64) -> W {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut pos = 0;
        while pos < data.len() {
            let max = if rng.random_bool(0.5) { 100 } else { 3 << 20 };
            let n = rng.random_range(1..=max).min(data.len() - pos);
            w.write_all(&data[pos..pos + n]).await.unwrap();
            pos += n;
            if rng.random_bool(0.3) {
                w.flush().await.unwrap();
            }
        }
        w.shutdown().await.unwrap();
        w
    }

    /// Reads to the authenticated end of stream in random-size reads.
    async fn recv_all<R: AsyncRead + Unpin>(mut r: R, seed: u64) -> io::Result<Vec<u8>> {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut out = Vec::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = rng.random_range(1..=buf.len());
            let got = r.read(&mut buf[..n]).await?;
            if got == 0 {
                return Ok(out);
            }
            out.extend_from_slice(&buf[..got]);
        }
    }

    /// Random payload of 1 byte, a few bytes, and several MiB.
    fn payload(seed: u64) -> Vec<u8> {
        let mut rng = StdRng::seed_from_u64(seed);
        let n = match seed % 3 {
            0 => 1,
            1 => rng.random_range(1..70_000),
            _ => rng.random_range(3 << 20..6 << 20),
        };
        random_bytes(&mut rng, n)
    }

    async fn exchange<R1, W1, R2, W2>(
        (r1, w1): (SecureReadHalf<R1>, SecureWriteHalf<W1>),
        (r2, w2): (SecureReadHalf<R2>, SecureWriteHalf<W2>),
        seed: u64,
    ) where
        R1: AsyncRead + Unpin,
        W1: AsyncWrite + Unpin,
        R2: AsyncRead + Unpin,
        W2: AsyncWrite + Unpin,
    {
        let (to2, to1) = (payload(seed), payload(seed + 1));
        let (_, _, got2, got1) = tokio::join!(
            send_all(w1, to2.clone(), seed + 2),
            send_all(w2, to1.clone(), seed + 3),
            recv_all(r2, seed + 4),
            recv_all(r1, seed + 5),
        );
        assert!(got2.unwrap() == to2, "1 -> 2 differs");
        assert!(got1.unwrap() == to1, "2 -> 1 differs");
    }

    #[tokio::test]
    async fn round_trip_random_sizes_both_ways_on_split_halves_over_duplex() {
        within(async {
            for seed in [1u64, 10, 20] {
                let psk = psk_from_secret(b"hunter2");
                let (d, a) = handshake_pair(Some(psk), Some(psk), PROLOGUE, PROLOGUE).await;
                exchange(d.unwrap().into_split(), a.unwrap().into_split(), seed).await;
            }
            // Single bytes, and without a PSK.
            let (d, a) = handshake_pair(None, None, PROLOGUE, PROLOGUE).await;
            let (mut d, mut a) = (d.unwrap(), a.unwrap());
            d.write_all(b"x").await.unwrap();
            d.flush().await.unwrap();
            let mut one = [0u8; 1];
            a.read_exact(&mut one).await.unwrap();
            assert_eq!(&one, b"x");
            a.write_all(b"y").await.unwrap();
            a.shutdown().await.unwrap();
            d.read_exact(&mut one).await.unwrap();
            assert_eq!(&one, b"y");
            assert_eq!(
                d.read(&mut one).await.unwrap(),
                0,
                "authenticated end of stream"
            );
        })
        .await
    }

    /// Records arriving 100 bytes at a time: every attempt to read one straight into the
    /// caller's (large) buffer gets part of it, moves that into the stream's own buffer
    /// and finishes it there.
    #[tokio::test]
    async fn records_trickling_in_are_read_whole_into_large_buffers() {
        within(async {
            let psk = psk_from_secret(b"trickle");
            let (a, b) = duplex(100);
            let (d, acc) = tokio::join!(
                secure_dial(a, Some(&psk), PROLOGUE, HS_TIMEOUT),
                secure_accept(b, Some(&psk), PROLOGUE, HS_TIMEOUT),
            );
            let (mut d, mut acc) = (d.unwrap(), acc.unwrap());
            let data = random_bytes(&mut StdRng::seed_from_u64(9), 300_000);
            let sent = data.clone();
            let writer = tokio::spawn(async move {
                d.write_all(&sent).await.unwrap();
                d.shutdown().await.unwrap();
                d
            });
            let mut got = vec![0u8; data.len()];
            acc.read_exact(&mut got).await.unwrap();
            assert!(got == data, "the bytes differ");
            let mut rest = vec![0u8; MAX_RECORD + 1];
            assert_eq!(acc.read(&mut rest).await.unwrap(), 0, "authenticated end");
            drop(writer.await.unwrap());
        })
        .await
    }

    #[tokio::test]
    async fn round_trip_over_loopback_tcp() {
        within(async {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let psk = psk_from_secret(b"a shared secret");
            let accept = async {
                let (s, _) = listener.accept().await.unwrap();
                secure_accept(s, Some(&psk), PROLOGUE, HS_TIMEOUT)
                    .await
                    .unwrap()
                    .into_split()
            };
            let dial = async {
                let s = TcpStream::connect(addr).await.unwrap();
                let (r, w) = s.into_split();
                secure_dial_split(r, w, Some(&psk), PROLOGUE, HS_TIMEOUT)
                    .await
                    .unwrap()
            };
            let (a, d) = tokio::join!(accept, dial);
            exchange(d, a, 77).await;
        })
        .await
    }

    #[test]
    fn rekey_is_noises_and_matches_snows() {
        let mut d = Handshake::new(true, Auth::ephemeral(None), PROLOGUE, SUITE).unwrap();
        let mut a = Handshake::new(false, Auth::ephemeral(None), PROLOGUE, SUITE).unwrap();
        let m2 = a.on_frame(&d.hello().unwrap()).unwrap().unwrap();
        let m3 = d.on_frame(&m2).unwrap().unwrap();
        let verdict = a.on_frame(&m3).unwrap().unwrap();
        assert!(d.on_frame(&verdict).unwrap().is_none());
        let (_, keys, _) = d.into_parts().unwrap();
        let (mut snow_side, _, _) = a.into_parts().unwrap();
        let (mut send, _) = keys.unwrap();
        let mut record = [0u8; 64];
        let mut out = [0u8; 64];
        for n in 0..5u64 {
            let len = send.seal(n, b"records", &mut record).unwrap();
            let got = snow_side.read_message(n, &record[..len], &mut out).unwrap();
            assert_eq!(&out[..got], b"records");
            send.rekey();
            snow_side.rekey_incoming();
        }
        // Without the other end's rekey, the next record does not open.
        let len = send.seal(5, b"records", &mut record).unwrap();
        send.rekey();
        let len2 = send.seal(6, b"records", &mut record[..]).unwrap();
        assert_eq!(len, len2);
        assert!(snow_side
            .read_message(5, &record[..len2], &mut out)
            .is_err());
    }

    #[tokio::test]
    async fn every_cipher_and_provider_round_trips() {
        within(async {
            for cipher in [Cipher::AesGcm, Cipher::ChaChaPoly] {
                for provider in [Provider::Ring, Provider::RustCrypto] {
                    // (A key change every 3 records, where this module seals them.)
                    let suite = Suite {
                        cipher,
                        provider,
                        rekey_every: 3,
                    };
                    let (a, b) = duplex(1 << 16);
                    let ((ar, aw), (br, bw)) = (tokio::io::split(a), tokio::io::split(b));
                    let psk = psk_from_secret(b"s");
                    let (d, a) = tokio::join!(
                        secure_split_with(
                            Joined {
                                read: ar,
                                write: aw
                            },
                            true,
                            Some(&psk),
                            PROLOGUE,
                            HS_TIMEOUT,
                            suite
                        ),
                        secure_split_with(
                            Joined {
                                read: br,
                                write: bw
                            },
                            false,
                            Some(&psk),
                            PROLOGUE,
                            HS_TIMEOUT,
                            suite
                        ),
                    );
                    exchange(d.unwrap(), a.unwrap(), 5).await;
                }
            }
        })
        .await
    }

    fn assert_auth(r: CoreResult<SecureStream<DuplexStream>>, side: &str) {
        match r {
            Err(CoreError::Authentication(m)) => assert!(m.contains("secure handshake"), "{m}"),
            other => panic!("{side}: expected an authentication error, got {other:?}"),
        }
    }

    /// A run key, and identities it certified (or not) for tests.
    struct Run {
        seed: [u8; 32],
    }

    impl Run {
        fn new() -> Run {
            Run {
                seed: rand::random(),
            }
        }
        fn anchors(&self) -> Vec<PublicKey> {
            vec![identity::run_public(&self.seed)]
        }
        /// A node certified by `by`, trusting it, for `groups`, valid in `window`
        /// (seconds around now).
        fn node(&self, by: &Run, groups: &[&str], window: (i64, i64)) -> Arc<Identity> {
            let key = identity::NodeKey::generate();
            let now = identity::now_secs() as i64;
            let groups: Vec<String> = groups.iter().map(|g| g.to_string()).collect();
            let cert = identity::Cert::sign(
                &by.seed,
                *key.public(),
                "test",
                &groups,
                (now + window.0) as u64,
                (now + window.1) as u64,
            )
            .unwrap();
            Identity::new(key, Some(cert), by.anchors()).unwrap()
        }
    }

    fn auth(id: &Arc<Identity>, group: &'static str, expect: Option<PublicKey>) -> Auth {
        Auth {
            identity: id.clone(),
            psk: Some(psk_from_secret(b"0123456789abcdef0123456789abcdef")),
            also: Vec::new(),
            group,
            expect,
        }
    }

    async fn pair_as(
        dialer: Auth,
        acceptor: Auth,
    ) -> (
        CoreResult<SecureStream<DuplexStream>>,
        CoreResult<SecureStream<DuplexStream>>,
    ) {
        let (a, b) = duplex(1 << 16);
        tokio::join!(
            secure_dial_as(a, &dialer, PROLOGUE, HS_TIMEOUT),
            secure_accept_first(b, None, &acceptor, PROLOGUE, HS_TIMEOUT),
        )
    }

    fn identity_refused(r: CoreResult<SecureStream<DuplexStream>>, needle: &str, side: &str) {
        match r {
            Err(CoreError::Identity(m)) => assert!(m.contains(needle), "{side}: {m}"),
            other => panic!("{side}: expected an identity error, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn certified_nodes_learn_each_other_and_carry_data() {
        within(async {
            let run = Run::new();
            let peer = run.node(&run, &["peer"], (-10, 3600));
            let master = run.node(&run, &["master"], (-10, 3600));
            let (d, a) = pair_as(
                auth(&peer, identity::GROUP_MASTER, Some(*master.key().public())),
                auth(&master, identity::GROUP_PEER, None),
            )
            .await;
            let (d, a) = (d.unwrap(), a.unwrap());
            assert_eq!(&d.remote().key, master.key().public());
            assert_eq!(&a.remote().key, peer.key().public());
            assert_eq!(
                a.remote().cert.as_ref().unwrap().groups,
                vec!["peer".to_string()]
            );
            exchange(d.into_split(), a.into_split(), 11).await;
        })
        .await
    }

    #[tokio::test]
    async fn wrong_identities_are_refused_naming_the_fingerprint_on_both_sides() {
        within(async {
            let run = Run::new();
            let other_run = Run::new();
            let good = run.node(&run, &["peer"], (-10, 3600));
            // The dialer pins a key the acceptor does not hold (someone stands in).
            let stand_in = run.node(&run, &["peer"], (-10, 3600));
            let (d, a) = pair_as(
                auth(&good, identity::GROUP_PEER, Some(*good.key().public())),
                auth(&stand_in, identity::GROUP_PEER, None),
            )
            .await;
            let fp = fingerprint_hex(stand_in.key().public());
            identity_refused(d, &fp, "dialer");
            identity_refused(a, "refused our identity", "acceptor");
            // Certified by another run (self-signed, as far as this run knows), expired,
            // for the wrong group, revoked: the acceptor refuses, the dialer hears why.
            let foreign = {
                let key = identity::NodeKey::generate();
                let now = identity::now_secs();
                let cert = identity::Cert::sign(
                    &other_run.seed,
                    *key.public(),
                    "intruder",
                    &["peer".to_string()],
                    now - 10,
                    now + 3600,
                )
                .unwrap();
                // (It checks nobody: it is the one being refused.)
                Identity::new(key, Some(cert), Vec::new()).unwrap()
            };
            let expired = run.node(&run, &["peer"], (-7200, -3600));
            let master = run.node(&run, &["master"], (-10, 3600));
            for (who, needle) in [
                (&foreign, "not trusted"),
                (&expired, "expired"),
                (&master, "not as a peer"),
            ] {
                let (d, a) = pair_as(
                    auth(who, identity::GROUP_PEER, None),
                    auth(&good, identity::GROUP_PEER, None),
                )
                .await;
                let fp = fingerprint_hex(who.key().public());
                identity_refused(a, &fp, "acceptor");
                identity_refused(d, needle, "dialer");
            }
            let list = identity::Denylist::sign(
                &run.seed,
                1,
                identity::now_secs(),
                &[identity::fingerprint(stand_in.key().public())],
            )
            .unwrap();
            assert!(good.install_denylist(&list).unwrap());
            let (d, a) = pair_as(
                auth(&stand_in, identity::GROUP_PEER, None),
                auth(&good, identity::GROUP_PEER, None),
            )
            .await;
            identity_refused(a, "revoked", "acceptor");
            identity_refused(d, "revoked", "dialer");
        })
        .await
    }

    #[test]
    fn a_low_order_ephemeral_key_fails_the_handshake() {
        for point in [[0u8; 32], {
            let mut one = [0u8; 32];
            one[0] = 1;
            one
        }] {
            let mut acceptor =
                Handshake::new(false, Auth::ephemeral(None), PROLOGUE, SUITE).unwrap();
            let mut hello = HELLO_MAGIC.to_vec();
            hello.extend_from_slice(&[0, SUITE.cipher.wire()]);
            hello.extend_from_slice(&point);
            let err = acceptor.on_frame(&hello).unwrap_err();
            assert!(
                matches!(err.error, CoreError::PeerConnection(_)),
                "{:?}",
                err.error
            );
        }
    }

    #[tokio::test]
    async fn wrong_psk_is_an_authentication_error_on_both_sides() {
        within(async {
            let (d, a) = handshake_pair(
                Some(psk_from_secret(b"one")),
                Some(psk_from_secret(b"two")),
                PROLOGUE,
                PROLOGUE,
            )
            .await;
            assert_auth(d, "dialer");
            assert_auth(a, "acceptor");
        })
        .await
    }

    /// A handshake between a dialer holding `dial` secrets and an acceptor holding
    /// `accept` (each: the current one first, then older ones of a rotation); then one
    /// message each way over the session.
    async fn rotation_pair(dial: &[&[u8]], accept: &[&[u8]]) -> (CoreResult<()>, CoreResult<()>) {
        let auth = |s: &[&[u8]]| Auth {
            also: s[1..].iter().map(|x| psk_from_secret(x)).collect(),
            ..Auth::ephemeral(Some(&psk_from_secret(s[0])))
        };
        let (a, b) = duplex(1 << 16);
        let (dial, accept) = (auth(dial), auth(accept));
        let (d, acc) = tokio::join!(
            secure_dial_as(a, &dial, PROLOGUE, HS_TIMEOUT),
            secure_accept_first(b, None, &accept, PROLOGUE, HS_TIMEOUT),
        );
        match (d, acc) {
            (Ok(mut d), Ok(mut acc)) => {
                d.write_all(b"ping").await.unwrap();
                d.flush().await.unwrap();
                let mut got = [0u8; 4];
                acc.read_exact(&mut got).await.unwrap();
                assert_eq!(&got, b"ping");
                (Ok(()), Ok(()))
            }
            (d, acc) => (d.map(|_| ()), acc.map(|_| ())),
        }
    }

    #[tokio::test]
    async fn during_a_rotation_any_secret_both_hold_is_agreed_on() {
        within(async {
            let (old, new): (&[u8], &[u8]) = (b"the old secret", b"the new secret");
            for (dial, accept) in [
                (vec![new, old], vec![old]), // rotated dialer, not yet rotated acceptor
                (vec![old], vec![new, old]), // the other way round
                (vec![new, old], vec![new, old]), // both rotated: the new one
                (vec![new], vec![new, old]), // the old one retired at the dialer
            ] {
                let (d, a) = rotation_pair(&dial, &accept).await;
                assert!(d.is_ok() && a.is_ok(), "{d:?} {a:?}");
            }
            // No secret in common: an authentication error at both ends, by name.
            let (d, a) = rotation_pair(&[new], &[old]).await;
            match d {
                Err(CoreError::Authentication(m)) => {
                    assert!(m.contains("none of the shared secrets we offered"), "{m}")
                }
                other => panic!("{other:?}"),
            }
            match a {
                Err(CoreError::Authentication(m)) => {
                    assert!(m.contains("none of the 1 shared secret(s)"), "{m}")
                }
                other => panic!("{other:?}"),
            }
        })
        .await
    }

    #[test]
    fn a_hello_offering_more_secrets_than_allowed_is_garbage() {
        let psk = psk_from_secret(b"k");
        for count in [MAX_PSKS as u8 + 1, 3] {
            let mut acceptor =
                Handshake::new(false, Auth::ephemeral(Some(&psk)), PROLOGUE, SUITE).unwrap();
            let mut hello = HELLO_MAGIC.to_vec();
            hello.extend_from_slice(&[count, SUITE.cipher.wire()]);
            hello.extend_from_slice(&[0u8; PSK_ID_LEN]); // fewer ids than the count says
            let err = acceptor.on_frame(&hello).unwrap_err();
            assert!(
                matches!(err.error, CoreError::PeerConnection(_)),
                "{:?}",
                err.error
            );
        }
    }

    #[tokio::test]
    async fn psk_on_one_side_only_fails_on_both_sides() {
        within(async {
            let psk = Some(psk_from_secret(b"one"));
            for (dp, ap) in [(psk, None), (None, psk)] {
                let (d, a) = handshake_pair(dp, ap, PROLOGUE, PROLOGUE).await;
                assert_auth(d, "dialer");
                assert_auth(a, "acceptor");
            }
        })
        .await
    }

    #[tokio::test]
    async fn different_prologue_fails_the_handshake() {
        within(async {
            for psk in [Some(psk_from_secret(b"one")), None] {
                let (d, a) = handshake_pair(psk, psk, b"pccl p2p v1", b"pccl p2p v2").await;
                assert_auth(d, "dialer");
                assert_auth(a, "acceptor");
            }
        })
        .await
    }

    #[tokio::test]
    async fn garbage_and_silence_fail_the_handshake() {
        within(async {
            let (mut a, b) = duplex(1 << 16);
            a.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .unwrap();
            match secure_accept(b, None, PROLOGUE, HS_TIMEOUT).await {
                Err(CoreError::PeerConnection(m)) => assert!(m.contains("garbage"), "{m}"),
                other => panic!("{other:?}"),
            }
            let (_a, b) = duplex(1 << 16);
            let t = std::time::Instant::now();
            match secure_accept(b, None, PROLOGUE, Duration::from_millis(200)).await {
                Err(CoreError::PeerConnection(m)) => assert!(m.contains("did not finish"), "{m}"),
                other => panic!("{other:?}"),
            }
            assert!(t.elapsed() < Duration::from_secs(5));
        })
        .await
    }

    #[test]
    fn psk_from_secret_is_hkdf_sha256() {
        // RFC 5869, test case 1 (first 32 bytes of the OKM).
        let ikm = [0x0bu8; 22];
        let salt: Vec<u8> = (0x00..=0x0c).collect();
        let info: Vec<u8> = (0xf0..=0xf9).collect();
        let okm = hkdf_sha256_32(&salt, &ikm, &info);
        let hex: String = okm.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf"
        );
        assert_ne!(psk_from_secret(b"a"), psk_from_secret(b"b"));
        assert_eq!(psk_from_secret(b"a"), psk_from_secret(b"a"));
    }

    // -----------------------------------------------------------------------------------
    // A man in the middle that relays frames (handshake frames and records share the
    // u32 length prefix) and may tamper with them.

    enum Act {
        Frame(Vec<u8>),
        Raw(Vec<u8>),
        Close,
    }

    type Tamper = Box<dyn FnMut(usize, Vec<u8>) -> Vec<Act> + Send>;

    fn pass() -> Tamper {
        Box::new(|_, f| vec![Act::Frame(f)])
    }

    async fn relay<R, W>(mut r: R, mut w: W, mut tamper: Tamper, seen: Arc<Mutex<Vec<u8>>>)
    where
        R: AsyncRead + Unpin,
        W: AsyncWrite + Unpin,
    {
        let mut i = 0;
        'frames: loop {
            let mut h = [0u8; 4];
            if r.read_exact(&mut h).await.is_err() {
                break;
            }
            let mut body = vec![0u8; u32::from_be_bytes(h) as usize];
            if r.read_exact(&mut body).await.is_err() {
                break;
            }
            {
                let mut s = seen.lock().unwrap();
                s.extend_from_slice(&h);
                s.extend_from_slice(&body);
            }
            for act in tamper(i, body) {
                let ok = match act {
                    Act::Frame(f) => {
                        let mut bytes = (f.len() as u32).to_be_bytes().to_vec();
                        bytes.extend_from_slice(&f);
                        w.write_all(&bytes).await.is_ok()
                    }
                    Act::Raw(b) => w.write_all(&b).await.is_ok(),
                    Act::Close => break 'frames,
                };
                if !ok {
                    break 'frames;
                }
            }
            i += 1;
        }
        let _ = w.shutdown().await;
    }

    /// Dialer and acceptor connected through a relay; `to_acceptor` sees the dialer's
    /// frames: 0 and 1 are handshake frames, records start at 2.
    async fn through_mitm(
        to_acceptor: Tamper,
    ) -> (
        SecureStream<DuplexStream>,
        SecureStream<DuplexStream>,
        Arc<Mutex<Vec<u8>>>,
    ) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (d, m1) = duplex(1 << 20);
        let (m2, a) = duplex(1 << 20);
        let ((m1r, m1w), (m2r, m2w)) = (tokio::io::split(m1), tokio::io::split(m2));
        tokio::spawn(relay(m1r, m2w, to_acceptor, seen.clone()));
        tokio::spawn(relay(m2r, m1w, pass(), seen.clone()));
        let psk = psk_from_secret(b"secret");
        let (d, a) = tokio::join!(
            secure_dial(d, Some(&psk), PROLOGUE, HS_TIMEOUT),
            secure_accept(a, Some(&psk), PROLOGUE, HS_TIMEOUT),
        );
        (d.unwrap(), a.unwrap(), seen)
    }

    /// Sends 8 records of 1000 bytes each through a tampering relay; the acceptor must
    /// fail (and keep failing) with `expect` in the message, never see a wrong byte.
    /// Twice: reading 1000 bytes at a time (each record through the stream's own
    /// buffer), and with room for whole records (each one read and opened in the
    /// caller's buffer).
    async fn tampered(tamper: impl Fn() -> Tamper, expect: &str) {
        for read_size in [1000, MAX_RECORD + 1] {
            tampered_with(tamper(), expect, read_size).await;
        }
    }

    async fn tampered_with(tamper: Tamper, expect: &str, read_size: usize) {
        let (mut d, mut a, _) = through_mitm(tamper).await;
        let data: Vec<u8> = (0..8000u32).map(|i| (i % 251) as u8).collect();
        let writer = tokio::spawn(async move {
            for chunk in data.chunks(1000) {
                if d.write_all(chunk).await.is_err() || d.flush().await.is_err() {
                    return;
                }
            }
            let _ = d.shutdown().await;
            // Keep the dialer open until the acceptor is done.
            let mut sink = Vec::new();
            let _ = d.read_to_end(&mut sink).await;
        });
        let mut got = Vec::new();
        let mut buf = vec![0u8; read_size];
        let err = loop {
            match a.read(&mut buf).await {
                Ok(0) => panic!("tampering went unnoticed ({} bytes read)", got.len()),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => break e,
            }
        };
        let expected: Vec<u8> = (0..got.len() as u32).map(|i| (i % 251) as u8).collect();
        assert_eq!(
            got, expected,
            "bytes before the error must be the sent ones"
        );
        assert!(err.to_string().contains(expect), "{err}");
        let core = CoreError::io("reading from peer", err);
        assert!(matches!(core, CoreError::PeerConnection(_)), "{core:?}");
        // The stream stays failed.
        let again = a.read(&mut buf).await.unwrap_err();
        assert!(again.to_string().contains(expect), "{again}");
        drop(a);
        writer.await.unwrap();
    }

    const INTEGRITY: &str = "integrity check failed";

    #[tokio::test]
    async fn flipped_bit_in_a_record_is_an_integrity_error() {
        within(tampered(
            || {
                Box::new(|i, mut f| {
                    if i == 4 {
                        let mid = f.len() / 2;
                        f[mid] ^= 0x10;
                    }
                    vec![Act::Frame(f)]
                })
            },
            INTEGRITY,
        ))
        .await
    }

    #[tokio::test]
    async fn replayed_record_is_an_integrity_error() {
        within(tampered(
            || {
                let mut prev = Vec::new();
                Box::new(move |i, f| {
                    let out = if i == 4 {
                        vec![Act::Frame(f.clone()), Act::Frame(prev.clone())]
                    } else {
                        vec![Act::Frame(f.clone())]
                    };
                    prev = f;
                    out
                })
            },
            INTEGRITY,
        ))
        .await
    }

    #[tokio::test]
    async fn dropped_record_is_an_integrity_error() {
        within(tampered(
            || Box::new(|i, f| if i == 4 { vec![] } else { vec![Act::Frame(f)] }),
            INTEGRITY,
        ))
        .await
    }

    #[tokio::test]
    async fn reordered_records_are_an_integrity_error() {
        within(tampered(
            || {
                let mut held = None;
                Box::new(move |i, f| match i {
                    3 => {
                        held = Some(f);
                        vec![]
                    }
                    4 => vec![Act::Frame(f), Act::Frame(held.take().unwrap())],
                    _ => vec![Act::Frame(f)],
                })
            },
            INTEGRITY,
        ))
        .await
    }

    #[tokio::test]
    async fn injected_record_is_an_integrity_error() {
        within(tampered(
            || {
                Box::new(|i, f| {
                    if i == 4 {
                        vec![Act::Frame(vec![0x5a; 1016]), Act::Frame(f)]
                    } else {
                        vec![Act::Frame(f)]
                    }
                })
            },
            INTEGRITY,
        ))
        .await
    }

    #[tokio::test]
    async fn truncated_record_is_an_error() {
        within(tampered(
            || {
                Box::new(|i, f| {
                    if i == 4 {
                        let mut raw = (f.len() as u32).to_be_bytes().to_vec();
                        raw.extend_from_slice(&f[..f.len() / 2]);
                        vec![Act::Raw(raw), Act::Close]
                    } else {
                        vec![Act::Frame(f)]
                    }
                })
            },
            INTEGRITY,
        ))
        .await
    }

    #[tokio::test]
    async fn cut_between_records_is_an_error_not_an_end() {
        within(tampered(
            || {
                Box::new(|i, f| {
                    if i == 4 {
                        vec![Act::Close]
                    } else {
                        vec![Act::Frame(f)]
                    }
                })
            },
            "truncated",
        ))
        .await
    }

    /// Whether `seen` holds 16 bytes of the counter pattern (4 consecutive big-endian
    /// u32 counters below `n`), or 16 bytes of 0xA5.
    fn leaks(seen: &[u8], n: u32) -> bool {
        if seen.windows(16).any(|w| w.iter().all(|&b| b == 0xA5)) {
            return true;
        }
        seen.windows(16).any(|w| {
            let c: Vec<u32> = w
                .chunks(4)
                .map(|c| u32::from_be_bytes(c.try_into().unwrap()))
                .collect();
            c[0] < n && c[1] == c[0] + 1 && c[2] == c[0] + 2 && c[3] == c[0] + 3
        })
    }

    #[tokio::test]
    async fn known_plaintext_never_appears_on_the_wire() {
        within(async {
            let (mut d, mut a, seen) = through_mitm(pass()).await;
            let n = (1u32 << 20) / 4;
            let mut data = vec![0xA5u8; 1 << 20];
            data.extend((0..n).flat_map(|i| i.to_be_bytes()));
            assert!(leaks(&data[..1 << 20], n) && leaks(&data[1 << 20..], n));
            let sent = data.clone();
            let writer = tokio::spawn(async move {
                d.write_all(&sent).await.unwrap();
                d.shutdown().await.unwrap();
                d
            });
            let mut got = Vec::new();
            a.read_to_end(&mut got).await.unwrap();
            let _d = writer.await.unwrap();
            assert!(got == data);
            let seen = seen.lock().unwrap();
            assert!(seen.len() > data.len());
            assert!(!leaks(&seen, n), "plaintext visible on the wire");
        })
        .await
    }
}
