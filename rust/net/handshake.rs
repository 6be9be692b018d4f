//! The p2p stream hello: who dials whom, for which epoch, slot and purpose. It runs
//! inside the transport (`secure/`); encrypted, the MACs are zeros and not checked
//! (the transport's handshake proved the dialer's key, and the node checks that the
//! key is the one the roster names for `from`). In clear text (`insecure`) with a
//! shared secret, it is a mutual HMAC-SHA256 challenge-response.
//!
//! ```text
//! listener -> dialer : MAGIC | version u16 | nonce_l[16]
//! dialer -> listener : MAGIC | version u16 | from u64 | to u64 | epoch u64 | stream u16
//!                      | pool u16 | purpose u8 | nonce_d[16] | mac_d[32]
//! listener -> dialer : status u8 | mac_l[32]
//! mac_d = HMAC(secret, "pccl-p2p-dialer"   | nonce_l | dialer fields before mac_d)
//! mac_l = HMAC(secret, "pccl-p2p-listener" | nonce_d | nonce_l)
//! ```
//! Without a secret both MACs are all zeros and are not checked. Each message is one
//! frame (see `frame.rs`), capped at `MAX_HANDSHAKE_FRAME` bytes.

use crate::error::{CoreError, CoreResult};
use crate::net::frame::{read_frame, write_frame};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncWrite};

pub const MAGIC: &[u8; 8] = b"PCCLP2P\x01";
pub const VERSION: u16 = 1;
pub const MAX_HANDSHAKE_FRAME: usize = 128;
const NONCE: usize = 16;
const MAC: usize = 32;
const DIALER_FIELDS: usize = 8 + 2 + 8 + 8 + 8 + 2 + 2 + 1 + NONCE;

pub const STATUS_OK: u8 = 0;
pub const STATUS_AUTH_FAILED: u8 = 1;
pub const STATUS_WRONG_PEER: u8 = 2;

/// What a stream is for; the listener files accepted streams by it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Purpose {
    Ring = 0,
    Transfer = 1,
    Probe = 2,
    /// The links of the mesh all-reduce (`crate::ring::mesh`), besides the ring's.
    Mesh = 3,
}

impl Purpose {
    fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Purpose::Ring),
            1 => Some(Purpose::Transfer),
            2 => Some(Purpose::Probe),
            3 => Some(Purpose::Mesh),
            _ => None,
        }
    }
}

/// The identity a dialer claims for one stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamHello {
    pub from: u64,
    pub to: u64,
    pub epoch: u64,
    pub stream: u16,
    pub pool: u16,
    pub purpose: Purpose,
}

fn mac(secret: Option<&[u8]>, label: &[u8], parts: &[&[u8]]) -> [u8; MAC] {
    let mut out = [0u8; MAC];
    if let Some(secret) = secret {
        let mut m = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
        m.update(label);
        for p in parts {
            m.update(p);
        }
        out.copy_from_slice(&m.finalize().into_bytes());
    }
    out
}

fn verify(secret: &[u8], label: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
    let mut m = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
    m.update(label);
    for p in parts {
        m.update(p);
    }
    m.verify_slice(tag).is_ok()
}

fn nonce() -> [u8; NONCE] {
    rand::random()
}

/// Dialer side. Returns once the listener accepted the stream.
pub async fn dial<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: Option<&[u8]>,
    hello: StreamHello,
) -> CoreResult<()> {
    let mut buf = Vec::with_capacity(MAX_HANDSHAKE_FRAME);
    if !read_frame(stream, &mut buf, MAX_HANDSHAKE_FRAME).await? {
        return Err(CoreError::PeerConnection(
            "peer closed the connection before the handshake".into(),
        ));
    }
    if buf.len() != 8 + 2 + NONCE || &buf[..8] != MAGIC {
        return Err(CoreError::Protocol(
            "the remote end does not speak the pccl p2p protocol".into(),
        ));
    }
    let version = u16::from_be_bytes([buf[8], buf[9]]);
    if version != VERSION {
        return Err(CoreError::Protocol(format!(
            "p2p protocol version mismatch: ours {VERSION}, theirs {version}"
        )));
    }
    let nonce_l: [u8; NONCE] = buf[10..].try_into().unwrap();
    let nonce_d = nonce();

    let mut msg = Vec::with_capacity(DIALER_FIELDS + MAC);
    msg.extend_from_slice(MAGIC);
    msg.extend_from_slice(&VERSION.to_be_bytes());
    msg.extend_from_slice(&hello.from.to_be_bytes());
    msg.extend_from_slice(&hello.to.to_be_bytes());
    msg.extend_from_slice(&hello.epoch.to_be_bytes());
    msg.extend_from_slice(&hello.stream.to_be_bytes());
    msg.extend_from_slice(&hello.pool.to_be_bytes());
    msg.push(hello.purpose as u8);
    msg.extend_from_slice(&nonce_d);
    let tag = mac(secret, b"pccl-p2p-dialer", &[&nonce_l, &msg]);
    msg.extend_from_slice(&tag);
    write_frame(stream, &msg).await?;

    if !read_frame(stream, &mut buf, MAX_HANDSHAKE_FRAME).await? {
        return Err(CoreError::Authentication(
            "peer closed the connection during the handshake (wrong or missing secret?)".into(),
        ));
    }
    if buf.len() != 1 + MAC {
        return Err(CoreError::Protocol("malformed handshake reply".into()));
    }
    match buf[0] {
        STATUS_OK => {}
        STATUS_AUTH_FAILED => {
            return Err(CoreError::Authentication(
                "peer rejected our p2p credentials: the shared secrets differ".into(),
            ))
        }
        STATUS_WRONG_PEER => {
            return Err(CoreError::PeerConnection(format!(
                "the address of peer {} now belongs to another peer",
                hello.to
            )))
        }
        s => return Err(CoreError::Protocol(format!("unknown handshake status {s}"))),
    }
    if let Some(secret) = secret {
        if !verify(
            secret,
            b"pccl-p2p-listener",
            &[&nonce_d, &nonce_l],
            &buf[1..],
        ) {
            return Err(CoreError::Authentication(
                "peer could not prove it knows the shared secret".into(),
            ));
        }
    }
    Ok(())
}

/// Listener side. `own_id` is the peer id this listener answers for.
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: Option<&[u8]>,
    own_id: u64,
) -> CoreResult<StreamHello> {
    let nonce_l = nonce();
    let mut first = Vec::with_capacity(8 + 2 + NONCE);
    first.extend_from_slice(MAGIC);
    first.extend_from_slice(&VERSION.to_be_bytes());
    first.extend_from_slice(&nonce_l);
    write_frame(stream, &first).await?;

    let mut buf = Vec::with_capacity(MAX_HANDSHAKE_FRAME);
    if !read_frame(stream, &mut buf, MAX_HANDSHAKE_FRAME).await? {
        return Err(CoreError::Protocol(
            "connection closed during the handshake".into(),
        ));
    }
    if buf.len() != DIALER_FIELDS + MAC || &buf[..8] != MAGIC {
        return Err(CoreError::Protocol("malformed p2p handshake".into()));
    }
    let u64_at = |i: usize| u64::from_be_bytes(buf[i..i + 8].try_into().unwrap());
    let u16_at = |i: usize| u16::from_be_bytes(buf[i..i + 2].try_into().unwrap());
    if u16_at(8) != VERSION {
        return Err(CoreError::Protocol(format!(
            "p2p protocol version mismatch: ours {VERSION}, theirs {}",
            u16_at(8)
        )));
    }
    let purpose = Purpose::from_u8(buf[38])
        .ok_or_else(|| CoreError::Protocol(format!("unknown stream purpose {}", buf[38])))?;
    let hello = StreamHello {
        from: u64_at(10),
        to: u64_at(18),
        epoch: u64_at(26),
        stream: u16_at(34),
        pool: u16_at(36),
        purpose,
    };
    let nonce_d: [u8; NONCE] = buf[39..39 + NONCE].try_into().unwrap();
    let (fields, tag) = buf.split_at(DIALER_FIELDS);
    let status = match secret {
        Some(s) if !verify(s, b"pccl-p2p-dialer", &[&nonce_l, fields], tag) => STATUS_AUTH_FAILED,
        _ if hello.to != own_id => STATUS_WRONG_PEER,
        _ => STATUS_OK,
    };
    let mut reply = Vec::with_capacity(1 + MAC);
    reply.push(status);
    if status == STATUS_OK {
        reply.extend_from_slice(&mac(secret, b"pccl-p2p-listener", &[&nonce_d, &nonce_l]));
    } else {
        reply.extend_from_slice(&[0u8; MAC]);
    }
    write_frame(stream, &reply).await?;
    match status {
        STATUS_OK => Ok(hello),
        STATUS_AUTH_FAILED => Err(CoreError::Authentication(format!(
            "p2p stream from claimed peer {} failed authentication",
            hello.from
        ))),
        _ => Err(CoreError::PeerConnection(format!(
            "p2p stream addressed to peer {} reached peer {own_id}",
            hello.to
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> StreamHello {
        StreamHello {
            from: 1,
            to: 2,
            epoch: 3,
            stream: 0,
            pool: 4,
            purpose: Purpose::Ring,
        }
    }

    async fn run(
        dial_secret: Option<&[u8]>,
        accept_secret: Option<&[u8]>,
        own: u64,
    ) -> (CoreResult<()>, CoreResult<StreamHello>) {
        let (mut a, mut b) = tokio::io::duplex(4096);
        tokio::join!(
            dial(&mut a, dial_secret, hello()),
            accept(&mut b, accept_secret, own)
        )
    }

    #[tokio::test]
    async fn matching_secrets_succeed() {
        let (d, a) = run(Some(b"s3cret"), Some(b"s3cret"), 2).await;
        d.unwrap();
        assert_eq!(a.unwrap(), hello());
    }

    #[tokio::test]
    async fn no_secret_on_either_side_succeeds() {
        let (d, a) = run(None, None, 2).await;
        d.unwrap();
        a.unwrap();
    }

    #[tokio::test]
    async fn wrong_secret_fails_both_sides() {
        let (d, a) = run(Some(b"a"), Some(b"b"), 2).await;
        assert!(matches!(d, Err(CoreError::Authentication(_))));
        assert!(matches!(a, Err(CoreError::Authentication(_))));
    }

    #[tokio::test]
    async fn missing_secret_on_dialer_fails() {
        let (d, a) = run(None, Some(b"b"), 2).await;
        assert!(matches!(d, Err(CoreError::Authentication(_))));
        assert!(a.is_err());
    }

    #[tokio::test]
    async fn listener_without_secret_cannot_fool_a_dialer_with_one() {
        let (d, _) = run(Some(b"a"), None, 2).await;
        assert!(matches!(d, Err(CoreError::Authentication(_))));
    }

    #[tokio::test]
    async fn wrong_target_is_refused() {
        let (d, a) = run(None, None, 9).await;
        assert!(matches!(d, Err(CoreError::PeerConnection(_))));
        assert!(a.is_err());
    }
}
