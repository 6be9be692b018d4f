//! snow's side of the handshake: the Noise protocol name, X25519 that refuses low-order
//! points and the resolver that brings it, one end's handshake state, and the PSK of a
//! group secret with the ids by which a hello offers it.

use super::handshake::Auth;
use super::{Cipher, Provider, Role, Suite, PROLOGUE_LABEL, PSK_ID_LEN, PSK_SALT};
use crate::error::{CoreError, CoreResult};
use crate::net::identity;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use snow::HandshakeState;

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
pub(super) const EPHEMERAL_LEN: usize = 32;

pub(super) fn hkdf_sha256_32(salt: &[u8], ikm: &[u8], info: &[u8]) -> [u8; 32] {
    let mut extract = <Hmac<Sha256> as Mac>::new_from_slice(salt).expect("any key length");
    extract.update(ikm);
    let prk = extract.finalize().into_bytes();
    let mut expand = <Hmac<Sha256> as Mac>::new_from_slice(&prk).expect("any key length");
    expand.update(info);
    expand.update(&[1]);
    expand.finalize().into_bytes().into()
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

pub(super) fn build_state(
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

pub(super) fn full_prologue(prologue: &[u8]) -> Vec<u8> {
    let mut p = Vec::with_capacity(PROLOGUE_LABEL.len() + 4 + prologue.len());
    p.extend_from_slice(PROLOGUE_LABEL);
    p.extend_from_slice(&(prologue.len() as u32).to_be_bytes());
    p.extend_from_slice(prologue);
    p
}
