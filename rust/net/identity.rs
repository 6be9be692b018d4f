//! Node identities: who a handshake proves the other end to be.
//!
//! Every node (peer or master) has a static X25519 key, the `s` of its Noise handshakes
//! (`secure/`). It is either loaded from the node's key file, with a certificate the
//! operator signed for it, or made fresh for the process (a node without one: then the
//! master's roster is what binds a key to a peer id).
//!
//! The operator holds a **run key** (Ed25519) offline. Its public half is the trust
//! anchor every node is configured with. A certificate says "this X25519 key belongs to
//! node NAME, in GROUPS (`peer`, `master`), from NOT_BEFORE until NOT_AFTER", signed by
//! the run key; a signed, versioned **denylist** names revoked keys by fingerprint. With
//! anchors configured, every handshake checks the other end's certificate (issuer among
//! the anchors, signature, its key is the handshake's static key, in its validity
//! window, in the group asked for, not on the denylist): the master can route and relay
//! streams but cannot mint an identity, and a revoked node is refused everywhere.
//!
//! ```text
//! certificate: CERT_MAGIC[8] | issuer[32] | node_key[32] | not_before u64 | not_after u64
//!              | name_len u8 | name | n_groups u8 | (len u8 | group)* | signature[64]
//! denylist:    DENY_MAGIC[8] | issuer[32] | version u64 | issued_at u64 | count u32
//!              | fingerprint[16]* | signature[64]
//! ```
//! Integers big-endian, text UTF-8, the signature Ed25519 (ring) over everything before
//! it. A key's fingerprint is the first 16 bytes of SHA-256 of the public key, in hex.

use crate::error::{CoreError, CoreResult};
use ring::signature::{Ed25519KeyPair, KeyPair, UnparsedPublicKey, ED25519};
use sha2::{Digest, Sha256};
use std::collections::HashSet;
use std::sync::{Arc, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

pub const CERT_MAGIC: &[u8; 8] = b"PCCLCRT1";
pub const DENY_MAGIC: &[u8; 8] = b"PCCLDNY1";
pub const KEY_LEN: usize = 32;
pub const SIG_LEN: usize = 64;
pub const FP_LEN: usize = 16;
pub const MAX_NAME: usize = 64;
pub const MAX_GROUPS: usize = 8;
pub const MAX_GROUP: usize = 32;
/// The largest certificate (it travels inside a handshake message).
pub const MAX_CERT: usize =
    8 + 2 * KEY_LEN + 16 + 1 + MAX_NAME + 1 + MAX_GROUPS * (1 + MAX_GROUP) + SIG_LEN;
/// The most fingerprints a denylist may name.
pub const MAX_DENIED: usize = 1 << 16;
/// Clocks of two nodes may disagree by this much around a certificate's window.
pub const CLOCK_SKEW_SECS: u64 = 300;
/// The group a peer's certificate must name, and a master's.
pub const GROUP_PEER: &str = "peer";
pub const GROUP_MASTER: &str = "master";

pub type PublicKey = [u8; KEY_LEN];
pub type Fingerprint = [u8; FP_LEN];

pub fn fingerprint(key: &[u8]) -> Fingerprint {
    let digest = Sha256::digest(key);
    digest[..FP_LEN].try_into().expect("16 of 32 bytes")
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn fingerprint_hex(key: &[u8]) -> String {
    hex(&fingerprint(key))
}

pub fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The X25519 public key of a (clamped on use) private key.
pub fn x25519_public(secret: &[u8; KEY_LEN]) -> PublicKey {
    curve25519_dalek::MontgomeryPoint::mul_base_clamped(*secret).to_bytes()
}

/// X25519 that refuses a result of all zeros (the peer sent a low-order point, so the
/// "shared" secret would be known to anyone): RFC 7748 section 6.1's check.
pub fn x25519(secret: &[u8; KEY_LEN], public: &[u8; KEY_LEN]) -> Option<[u8; KEY_LEN]> {
    let out = curve25519_dalek::MontgomeryPoint(*public)
        .mul_clamped(*secret)
        .to_bytes();
    if out.iter().fold(0u8, |acc, b| acc | b) == 0 {
        None
    } else {
        Some(out)
    }
}

/// A node's static key pair. `Debug` never shows the private half.
#[derive(Clone)]
pub struct NodeKey {
    secret: [u8; KEY_LEN],
    public: PublicKey,
}

impl std::fmt::Debug for NodeKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NodeKey({})", fingerprint_hex(&self.public))
    }
}

impl Drop for NodeKey {
    fn drop(&mut self) {
        self.secret.fill(0);
    }
}

impl NodeKey {
    pub fn generate() -> Self {
        Self::from_secret(rand::random())
    }

    pub fn from_secret(secret: [u8; KEY_LEN]) -> Self {
        NodeKey {
            public: x25519_public(&secret),
            secret,
        }
    }

    pub fn secret(&self) -> &[u8; KEY_LEN] {
        &self.secret
    }

    pub fn public(&self) -> &PublicKey {
        &self.public
    }
}

// ---------------------------------------------------------------------------------------
// Run keys, certificates, denylists

fn run_keypair(seed: &[u8; KEY_LEN]) -> Ed25519KeyPair {
    Ed25519KeyPair::from_seed_unchecked(seed).expect("any 32-byte seed is an Ed25519 key")
}

/// The public half of a run key given by its 32-byte seed.
pub fn run_public(seed: &[u8; KEY_LEN]) -> PublicKey {
    run_keypair(seed)
        .public_key()
        .as_ref()
        .try_into()
        .expect("32 bytes")
}

fn sign(seed: &[u8; KEY_LEN], body: &[u8]) -> [u8; SIG_LEN] {
    run_keypair(seed)
        .sign(body)
        .as_ref()
        .try_into()
        .expect("64 bytes")
}

fn signature_ok(issuer: &PublicKey, body: &[u8], sig: &[u8]) -> bool {
    UnparsedPublicKey::new(&ED25519, issuer)
        .verify(body, sig)
        .is_ok()
}

fn bad(what: &str) -> CoreError {
    CoreError::InvalidArgument(format!("not a pccl {what}"))
}

/// A bounded reader over untrusted bytes.
struct Reader<'a>(&'a [u8], &'static str);

impl<'a> Reader<'a> {
    /// A signed object of at most `max` bytes: a reader past its magic, the signed
    /// body (magic included) and the signature.
    fn signed(
        raw: &'a [u8],
        magic: &[u8; 8],
        max: usize,
        what: &'static str,
    ) -> CoreResult<(Reader<'a>, &'a [u8], &'a [u8])> {
        if raw.len() > max || raw.len() < SIG_LEN {
            return Err(bad(what));
        }
        let (body, sig) = raw.split_at(raw.len() - SIG_LEN);
        let mut r = Reader(body, what);
        if r.take(8)? != magic {
            return Err(bad(what));
        }
        Ok((r, body, sig))
    }

    fn take(&mut self, n: usize) -> CoreResult<&'a [u8]> {
        if self.0.len() < n {
            return Err(bad(self.1));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self) -> CoreResult<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> CoreResult<u32> {
        Ok(u32::from_be_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> CoreResult<u64> {
        Ok(u64::from_be_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn key(&mut self) -> CoreResult<PublicKey> {
        Ok(self.take(KEY_LEN)?.try_into().unwrap())
    }
    fn text(&mut self, max: usize) -> CoreResult<String> {
        let n = self.u8()? as usize;
        if n > max {
            return Err(bad(self.1));
        }
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| bad(self.1))
    }
}

fn valid_text(s: &str, max: usize) -> bool {
    s.len() <= max && s.chars().all(|c| !c.is_control())
}

/// What a certificate says (its signature checked against its own issuer field only:
/// whether that issuer is trusted is `Trust`'s question).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cert {
    pub issuer: PublicKey,
    pub node_key: PublicKey,
    pub not_before: u64,
    pub not_after: u64,
    pub name: String,
    pub groups: Vec<String>,
}

impl Cert {
    fn body(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(MAX_CERT);
        b.extend_from_slice(CERT_MAGIC);
        b.extend_from_slice(&self.issuer);
        b.extend_from_slice(&self.node_key);
        b.extend_from_slice(&self.not_before.to_be_bytes());
        b.extend_from_slice(&self.not_after.to_be_bytes());
        b.push(self.name.len() as u8);
        b.extend_from_slice(self.name.as_bytes());
        b.push(self.groups.len() as u8);
        for g in &self.groups {
            b.push(g.len() as u8);
            b.extend_from_slice(g.as_bytes());
        }
        b
    }

    /// Signs a certificate with the run key `seed` (its issuer field is that key's).
    pub fn sign(
        seed: &[u8; KEY_LEN],
        node_key: PublicKey,
        name: &str,
        groups: &[String],
        not_before: u64,
        not_after: u64,
    ) -> CoreResult<Vec<u8>> {
        if !valid_text(name, MAX_NAME) {
            return Err(CoreError::InvalidArgument(format!(
                "a node name is at most {MAX_NAME} bytes of printable text"
            )));
        }
        if groups.is_empty()
            || groups.len() > MAX_GROUPS
            || groups
                .iter()
                .any(|g| g.is_empty() || !valid_text(g, MAX_GROUP))
        {
            return Err(CoreError::InvalidArgument(format!(
                "a certificate names 1 to {MAX_GROUPS} groups of at most {MAX_GROUP} bytes"
            )));
        }
        if not_after <= not_before {
            return Err(CoreError::InvalidArgument(
                "a certificate's not_after must come after its not_before".into(),
            ));
        }
        let cert = Cert {
            issuer: run_public(seed),
            node_key,
            not_before,
            not_after,
            name: name.into(),
            groups: groups.to_vec(),
        };
        let mut raw = cert.body();
        raw.extend_from_slice(&sign(seed, &raw));
        Ok(raw)
    }

    /// Parses (bounded) and checks the signature against the issuer it names.
    pub fn parse(raw: &[u8]) -> CoreResult<Cert> {
        let (mut r, body, sig) = Reader::signed(raw, CERT_MAGIC, MAX_CERT, "certificate")?;
        let issuer = r.key()?;
        let node_key = r.key()?;
        let not_before = r.u64()?;
        let not_after = r.u64()?;
        let name = r.text(MAX_NAME)?;
        let n = r.u8()? as usize;
        if n > MAX_GROUPS {
            return Err(bad("certificate"));
        }
        let groups = (0..n)
            .map(|_| r.text(MAX_GROUP))
            .collect::<CoreResult<Vec<_>>>()?;
        if !r.0.is_empty() {
            return Err(bad("certificate"));
        }
        if !signature_ok(&issuer, body, sig) {
            return Err(CoreError::Identity(format!(
                "the certificate of key {} does not carry a valid signature",
                fingerprint_hex(&node_key)
            )));
        }
        Ok(Cert {
            issuer,
            node_key,
            not_before,
            not_after,
            name,
            groups,
        })
    }
}

/// A signed list of revoked key fingerprints; a higher version replaces a lower one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Denylist {
    pub issuer: PublicKey,
    pub version: u64,
    pub issued_at: u64,
    pub denied: HashSet<Fingerprint>,
    pub raw: Vec<u8>,
}

impl Denylist {
    pub fn sign(
        seed: &[u8; KEY_LEN],
        version: u64,
        issued_at: u64,
        denied: &[Fingerprint],
    ) -> CoreResult<Vec<u8>> {
        if denied.len() > MAX_DENIED {
            return Err(CoreError::InvalidArgument(format!(
                "a denylist names at most {MAX_DENIED} keys"
            )));
        }
        let mut raw = Vec::with_capacity(60 + denied.len() * FP_LEN + SIG_LEN);
        raw.extend_from_slice(DENY_MAGIC);
        raw.extend_from_slice(&run_public(seed));
        raw.extend_from_slice(&version.to_be_bytes());
        raw.extend_from_slice(&issued_at.to_be_bytes());
        raw.extend_from_slice(&(denied.len() as u32).to_be_bytes());
        for fp in denied {
            raw.extend_from_slice(fp);
        }
        let sig = sign(seed, &raw);
        raw.extend_from_slice(&sig);
        Ok(raw)
    }

    pub fn parse(raw: &[u8]) -> CoreResult<Denylist> {
        let max = 60 + MAX_DENIED * FP_LEN + SIG_LEN;
        let (mut r, body, sig) = Reader::signed(raw, DENY_MAGIC, max, "denylist")?;
        let issuer = r.key()?;
        let version = r.u64()?;
        let issued_at = r.u64()?;
        let count = r.u32()? as usize;
        if count > MAX_DENIED || r.0.len() != count * FP_LEN {
            return Err(bad("denylist"));
        }
        let denied =
            r.0.chunks_exact(FP_LEN)
                .map(|c| c.try_into().unwrap())
                .collect();
        if !signature_ok(&issuer, body, sig) {
            return Err(CoreError::Identity(
                "the denylist does not carry a valid signature".into(),
            ));
        }
        Ok(Denylist {
            issuer,
            version,
            issued_at,
            denied,
            raw: raw.to_vec(),
        })
    }
}

// ---------------------------------------------------------------------------------------
// What a node trusts, and what it learned of the other end

/// Who the other end of a handshake proved to be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Remote {
    pub key: PublicKey,
    /// Its certificate, when this node checks certificates.
    pub cert: Option<Cert>,
}

impl Remote {
    pub fn fingerprint(&self) -> String {
        fingerprint_hex(&self.key)
    }
}

/// A node's own key and certificate, the run keys it trusts and the newest denylist it
/// has seen. Shared by its control-plane connections and its p2p node.
pub struct Identity {
    key: NodeKey,
    cert: Option<Vec<u8>>,
    anchors: Vec<PublicKey>,
    denylist: RwLock<Option<Arc<Denylist>>>,
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identity")
            .field("key", &self.key)
            .field("cert", &self.cert.is_some())
            .field("anchors", &self.anchors.len())
            .finish()
    }
}

impl Identity {
    /// A fresh key, no certificate, no anchors: the identity of a node the operator did
    /// not give one (its key then means only what the master's roster says).
    pub fn ephemeral() -> Arc<Identity> {
        Arc::new(Identity {
            key: NodeKey::generate(),
            cert: None,
            anchors: Vec::new(),
            denylist: RwLock::new(None),
        })
    }

    /// `cert` must be for `key` and signed by one of `anchors` (checked here, so a
    /// misconfigured node fails at start, not at its first handshake).
    pub fn new(
        key: NodeKey,
        cert: Option<Vec<u8>>,
        anchors: Vec<PublicKey>,
    ) -> CoreResult<Arc<Identity>> {
        if let Some(raw) = &cert {
            let c = Cert::parse(raw)?;
            if &c.node_key != key.public() {
                return Err(CoreError::InvalidArgument(format!(
                    "the certificate is for key {}, not for this node's key {}",
                    fingerprint_hex(&c.node_key),
                    fingerprint_hex(key.public())
                )));
            }
            if !anchors.is_empty() && !anchors.contains(&c.issuer) {
                return Err(CoreError::InvalidArgument(format!(
                    "this node's certificate is signed by run key {}, which is not among \
                     the run keys it trusts",
                    fingerprint_hex(&c.issuer)
                )));
            }
        }
        if !anchors.is_empty() && cert.is_none() {
            return Err(CoreError::InvalidArgument(
                "a node that checks certificates (trusts a run key) needs one of its own".into(),
            ));
        }
        Ok(Arc::new(Identity {
            key,
            cert,
            anchors,
            denylist: RwLock::new(None),
        }))
    }

    pub fn key(&self) -> &NodeKey {
        &self.key
    }

    pub fn cert(&self) -> Option<&[u8]> {
        self.cert.as_deref()
    }

    pub fn anchors(&self) -> &[PublicKey] {
        &self.anchors
    }

    /// Whether the other end must present a certificate signed by an anchor.
    pub fn checks_certs(&self) -> bool {
        !self.anchors.is_empty()
    }

    pub fn denylist(&self) -> Option<Arc<Denylist>> {
        self.denylist.read().unwrap().clone()
    }

    /// Installs a denylist signed by a trusted run key, if newer than the one held.
    /// Returns whether it was installed (an older or equal version is ignored).
    pub fn install_denylist(&self, raw: &[u8]) -> CoreResult<bool> {
        if self.anchors.is_empty() {
            return Err(CoreError::InvalidUsage(
                "a denylist needs a trusted run key to check it against".into(),
            ));
        }
        let list = Denylist::parse(raw)?;
        if !self.anchors.contains(&list.issuer) {
            return Err(CoreError::Identity(format!(
                "the denylist is signed by run key {}, which this node does not trust",
                fingerprint_hex(&list.issuer)
            )));
        }
        let mut held = self.denylist.write().unwrap();
        if held.as_ref().is_some_and(|h| h.version >= list.version) {
            return Ok(false);
        }
        *held = Some(Arc::new(list));
        Ok(true)
    }

    pub fn is_denied(&self, key: &[u8]) -> bool {
        let fp = fingerprint(key);
        self.denylist
            .read()
            .unwrap()
            .as_ref()
            .is_some_and(|d| d.denied.contains(&fp))
    }

    /// Checks the other end of a handshake: its static `key` and the certificate it
    /// sent (`cert`, empty for none) against what this node trusts, for `group`.
    pub fn check_remote(&self, key: &[u8], cert: &[u8], group: &str) -> CoreResult<Remote> {
        let key: PublicKey = key
            .try_into()
            .map_err(|_| CoreError::Protocol("a static key is 32 bytes".into()))?;
        let fp = fingerprint_hex(&key);
        if !self.checks_certs() {
            return Ok(Remote { key, cert: None });
        }
        if cert.is_empty() {
            return Err(CoreError::Identity(format!(
                "key {fp} presented no certificate (every node needs one signed by the run \
                 key)"
            )));
        }
        let c = Cert::parse(cert).map_err(|e| match e {
            CoreError::InvalidArgument(_) => {
                CoreError::Identity(format!("key {fp} presented a malformed certificate"))
            }
            e => e,
        })?;
        if c.node_key != key {
            return Err(CoreError::Identity(format!(
                "key {fp} presented the certificate of another key ({})",
                fingerprint_hex(&c.node_key)
            )));
        }
        if !self.anchors.contains(&c.issuer) {
            return Err(CoreError::Identity(format!(
                "key {fp} ({:?}) has a certificate signed by run key {}, which is not \
                 trusted here (self-signed, or from another run)",
                c.name,
                fingerprint_hex(&c.issuer)
            )));
        }
        let now = now_secs();
        if now > c.not_after.saturating_add(CLOCK_SKEW_SECS) {
            return Err(CoreError::Identity(format!(
                "key {fp} ({:?}) has a certificate that expired {} s ago",
                c.name,
                now - c.not_after
            )));
        }
        if now.saturating_add(CLOCK_SKEW_SECS) < c.not_before {
            return Err(CoreError::Identity(format!(
                "key {fp} ({:?}) has a certificate valid only from {} s from now",
                c.name,
                c.not_before - now
            )));
        }
        if !c.groups.iter().any(|g| g == group) {
            return Err(CoreError::Identity(format!(
                "key {fp} ({:?}) is certified for {:?}, not as a {group}",
                c.name, c.groups
            )));
        }
        if self.is_denied(&key) {
            return Err(CoreError::Identity(format!(
                "key {fp} ({:?}) is revoked (on the run's denylist)",
                c.name
            )));
        }
        Ok(Remote { key, cert: Some(c) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ca() -> [u8; 32] {
        rand::random()
    }

    fn node(seed: &[u8; 32], groups: &[&str], window: (u64, u64)) -> (NodeKey, Vec<u8>) {
        let k = NodeKey::generate();
        let groups: Vec<String> = groups.iter().map(|g| g.to_string()).collect();
        let c = Cert::sign(seed, *k.public(), "n1", &groups, window.0, window.1).unwrap();
        (k, c)
    }

    fn now_window() -> (u64, u64) {
        let n = now_secs();
        (n - 10, n + 3600)
    }

    #[test]
    fn a_certificate_round_trips_and_any_flipped_bit_breaks_it() {
        let seed = ca();
        let (k, raw) = node(&seed, &["peer"], now_window());
        let c = Cert::parse(&raw).unwrap();
        assert_eq!(&c.node_key, k.public());
        assert_eq!(c.issuer, run_public(&seed));
        assert_eq!(c.groups, vec!["peer".to_string()]);
        for i in 0..raw.len() {
            let mut bent = raw.clone();
            bent[i] ^= 1;
            assert!(Cert::parse(&bent).is_err(), "bit flip at {i} passed");
        }
        assert!(Cert::parse(&raw[..raw.len() - 1]).is_err());
        assert!(Cert::parse(&[]).is_err());
    }

    #[test]
    fn check_remote_refuses_each_wrong_identity_naming_the_fingerprint() {
        let seed = ca();
        let (k, cert) = node(&seed, &["peer"], now_window());
        let (own, own_cert) = node(&seed, &["peer"], now_window());
        let me = Identity::new(own, Some(own_cert), vec![run_public(&seed)]).unwrap();
        let fp = fingerprint_hex(k.public());
        assert!(me.check_remote(k.public(), &cert, GROUP_PEER).is_ok());
        let refused = |key: &[u8], cert: &[u8], group: &str| match me.check_remote(key, cert, group)
        {
            Err(CoreError::Identity(m)) => m,
            other => panic!("expected an identity error, got {other:?}"),
        };
        // No certificate, a certificate for another key, the wrong group.
        assert!(refused(k.public(), &[], GROUP_PEER).contains(&fp));
        let other = NodeKey::generate();
        assert!(refused(other.public(), &cert, GROUP_PEER).contains("another key"));
        assert!(refused(k.public(), &cert, GROUP_MASTER).contains("not as a master"));
        // Self-signed (by a run key nobody trusts), expired.
        let (k2, selfsigned) = node(&ca(), &["peer"], now_window());
        assert!(refused(k2.public(), &selfsigned, GROUP_PEER).contains("not trusted"));
        let n = now_secs();
        let (k3, old) = node(&seed, &["peer"], (n - 7200, n - 3600));
        let m = refused(k3.public(), &old, GROUP_PEER);
        assert!(m.contains("expired") && m.contains(&fingerprint_hex(k3.public())));
        // Revoked: by a denylist of a trusted run key, newer versions only.
        let list = Denylist::sign(&seed, 1, n, &[fingerprint(k.public())]).unwrap();
        assert!(me.install_denylist(&list).unwrap());
        assert!(!me.install_denylist(&list).unwrap());
        assert!(refused(k.public(), &cert, GROUP_PEER).contains("revoked"));
        let forged = Denylist::sign(&ca(), 9, n, &[]).unwrap();
        assert!(matches!(
            me.install_denylist(&forged),
            Err(CoreError::Identity(_))
        ));
        let empty = Denylist::sign(&seed, 2, n, &[]).unwrap();
        assert!(me.install_denylist(&empty).unwrap());
        assert!(me.check_remote(k.public(), &cert, GROUP_PEER).is_ok());
    }

    #[test]
    fn an_identity_refuses_a_certificate_it_cannot_use() {
        let seed = ca();
        let (_, cert) = node(&seed, &["peer"], now_window());
        let err = Identity::new(NodeKey::generate(), Some(cert), vec![run_public(&seed)]);
        assert!(matches!(err, Err(CoreError::InvalidArgument(_))));
        let err = Identity::new(NodeKey::generate(), None, vec![run_public(&seed)]);
        assert!(matches!(err, Err(CoreError::InvalidArgument(_))));
        assert!(format!("{:?}", Identity::ephemeral()).contains("NodeKey("));
    }

    #[test]
    fn x25519_refuses_low_order_points() {
        let k = NodeKey::generate();
        assert!(x25519(k.secret(), &[0u8; 32]).is_none());
        let mut one = [0u8; 32];
        one[0] = 1;
        assert!(x25519(k.secret(), &one).is_none());
        let other = NodeKey::generate();
        assert_eq!(
            x25519(k.secret(), other.public()),
            x25519(other.secret(), k.public())
        );
    }
}
