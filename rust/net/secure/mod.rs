//! An encrypted, authenticated byte stream over any tokio stream: a Noise handshake
//! (the `snow` crate) followed by a record layer. Every p2p stream runs over it (`net/stream.rs`).
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
//!
//! The parts: `handshake.rs` (the handshake as a state machine without I/O: the hello
//! and its secret offer, the status replies, the verdict, who the other end proved to
//! be), `noise.rs` (snow's setup for it: the Noise pattern, X25519 that refuses
//! low-order points, the PSK of a secret and the ids a hello offers it by), `record.rs`
//! (the record layer: each direction's nonce and key, sealing and opening records) and
//! `stream.rs` (dialing and accepting over a tokio stream; the stream and its halves).
//! What the rest of the crate uses is re-exported here.

mod handshake;
mod noise;
mod record;
mod stream;
#[cfg(test)]
mod tests;

pub use handshake::{Auth, Handshake, HandshakeFailure, STATUS_REFUSED, STATUS_TRANSPORT_MISMATCH};
pub use noise::{psk_from_secret, psk_id};
pub use record::{Aead, DirKey, FIRST_NONCE};
pub use stream::{
    secure_accept, secure_accept_first, secure_dial, secure_dial_as, secure_dial_split,
    secure_split_with, Joined, SecureReadHalf, SecureStream, SecureWriteHalf, SplitIo,
};

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

#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Dialer,
    Acceptor,
}
