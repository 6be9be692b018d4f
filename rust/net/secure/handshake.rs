//! The secure handshake as a state machine without I/O (`Handshake`): who speaks as
//! whom (`Auth`), the dialer's hello with its secret offer, the acceptor's choice, the
//! status replies that tell the other end why it failed, and the verdict. `stream.rs`
//! drives it over a tokio stream, `py::secure` from asyncio.

use super::noise::{build_state, full_prologue, psk_id, EPHEMERAL_LEN};
use super::record::{DirKey, Keys};
use super::{
    Role, Suite, CLEAR_HELLO, HELLO_MAGIC, MAX_HANDSHAKE_FRAME, MAX_PSKS, MAX_REASON, PSK_ID_LEN,
};
use crate::error::{CoreError, CoreResult};
use crate::net::identity::{self, fingerprint_hex, Identity, PublicKey, Remote};
use snow::{HandshakeState, StatelessTransportState};
use std::sync::Arc;

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

fn auth_failed(what: &str) -> CoreError {
    CoreError::Authentication(format!(
        "secure handshake failed: {what} (different shared secrets or session contexts, \
         or the handshake was tampered with)"
    ))
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
    pub(super) fn into_parts(self) -> Option<(StatelessTransportState, Keys, Remote)> {
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
