"""Who may join a run: strong shared secrets, node keys, certificates signed by the
operator's run key, and the signed denylist that revokes keys.

The handshakes themselves live in the Rust core (``rust/net/identity.rs``,
``rust/net/secure/``); this module holds what is Python's: the files, the checks done
at construction, and the operator's tools behind ``pccl secret new``, ``pccl ca ...``
and ``pccl node new``.

Files are one line of text, ``LABEL BASE64``, so they survive copy and paste:

================  =====================  ==================================
file              label                  holds
================  =====================  ==================================
``run.key``       ``pccl-run-key-v1``     the run key's Ed25519 seed (0600: keep offline)
``run.pub``       ``pccl-run-pub-v1``     its public key: every node's trust anchor
``NODE.key``      ``pccl-node-key-v1``    a node's X25519 secret key (0600)
``NODE.pub``      ``pccl-node-pub-v1``    its public key, to be signed
``NODE.cert``     ``pccl-cert-v1``        the certificate the run key signed
``deny.list``     ``pccl-denylist-v1``    the signed, versioned denylist
================  =====================  ==================================

Example::

    import os, tempfile
    from pccl import identity as ident
    d = tempfile.mkdtemp()
    run = ident.new_run_key(os.path.join(d, "run"))
    ident.new_node_key(os.path.join(d, "alice"))
    ident.sign_node(run, os.path.join(d, "alice.pub"), name="alice", groups=["peer"],
                    days=7, out=os.path.join(d, "alice.cert"))
    me = ident.load(os.path.join(d, "alice.key"), os.path.join(d, "alice.cert"),
                    trust=[os.path.join(d, "run.pub")])
    assert me.checks_certs and len(me.fingerprint) == 32
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import secrets as _secrets
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from pccl import _core
from pccl.config import read_secret_file
from pccl.errors import InvalidArgumentError

__all__ = ["MIN_SECRET_BITS", "ROTATION_GRACE", "Secrets", "check_secret", "describe", "load",
           "load_denylist",
           "new_node_key", "new_run_key", "new_secret", "parse_fingerprint", "revoke",
           "sign_node", "trust_paths", "write_text"]

Identity = _core.Identity

RUN_KEY = "pccl-run-key-v1"
RUN_PUB = "pccl-run-pub-v1"
NODE_KEY = "pccl-node-key-v1"
NODE_PUB = "pccl-node-pub-v1"
CERT = "pccl-cert-v1"
DENYLIST = "pccl-denylist-v1"

#: A shared secret must carry at least this much randomness.
MIN_SECRET_BITS = 128

_HEX = re.compile(r"[0-9a-fA-F]+")
_B64 = re.compile(r"[A-Za-z0-9+/_-]+={0,2}")

_SECRET_ADVICE = (
    "a secret is a key, not a password: at least 128 random bits, e.g. `pccl secret new "
    "--out FILE` (or `openssl rand -hex 16`), given to every node as --secret-file / "
    "PCCL_SECRET_FILE")


def _bits(text: str) -> int:
    """The randomness a secret written as hex or base64 can carry, at most."""
    if _HEX.fullmatch(text):
        return 4 * len(text)
    if _B64.fullmatch(text):
        return 6 * len(text.rstrip("="))
    return 0


def check_secret(secret: bytes | str | None, what: str = "secret") -> bytes | None:
    """The secret as bytes, or None for none. Raises
    :class:`~pccl.InvalidArgumentError` for an empty secret or one that cannot hold
    :data:`MIN_SECRET_BITS` random bits: text must be hex (32 digits or more) or base64
    (22 characters or more), binary bytes at least 16 long; a value of fewer than 8
    distinct symbols (``aaaa...``, ``abab...``) is refused too. Nothing can prove that a
    secret is random; this refuses what certainly is not (passwords, words, short
    values)."""
    if secret is None:
        return None
    if isinstance(secret, str):
        raw = secret.encode()
    elif isinstance(secret, (bytes, bytearray)):
        raw = bytes(secret)
    else:
        raise InvalidArgumentError(f"the {what} must be bytes or str, not "
                                   f"{type(secret).__name__}")
    if not raw.strip():
        raise InvalidArgumentError(f"the {what} is empty: {_SECRET_ADVICE}")
    if raw.isascii() and raw.decode().strip().isprintable():
        text = raw.decode().strip()
        bits, symbols = _bits(text), len(set(text))
    else:
        bits, symbols = 8 * len(raw), len(set(raw))
    if bits < MIN_SECRET_BITS or symbols < 8:
        raise InvalidArgumentError(
            f"the {what} is too weak ({len(raw)} bytes, {symbols} distinct): "
            f"{_SECRET_ADVICE}")
    return raw


def new_secret() -> str:
    """A fresh shared secret: 256 random bits in hex."""
    return _secrets.token_hex(32)


#: Seconds a node still accepts the secret it used before a rotation (the master's is
#: ``MasterNode(secret_grace=)``).
ROTATION_GRACE = 3600.0
#: Older secrets a node holds at most besides its current one (the transport offers
#: four at most).
MAX_OLDER_SECRETS = 3

SecretSource = bytes | str | os.PathLike[str] | None


class Secrets:
    """A node's run secret, and the older ones it still accepts during a rotation.

    Given as bytes or text, the secret changes only by :meth:`rotate`. Given as a path
    (``secret=Path("secret")``, ``PCCL_SECRET_FILE``, ``--secret-file``), the file is
    read now and again whenever :meth:`reread` finds it changed: its first line becomes
    the current secret (used to connect from then on) and the previous one is still
    accepted, and offered, for ``grace`` seconds; further lines (at most three) are
    older secrets accepted for as long as they are there (a node started during a
    rotation). So a run's secret is rotated by replacing the file on every node, in any
    order, without a restart: two nodes agree on any secret both hold (docs/security.md,
    "Rotating the secret")."""

    def __init__(self, secret: SecretSource, what: str = "secret",
                 grace: float = ROTATION_GRACE) -> None:
        self.what = what
        self.grace = grace
        self.path: Path | None = None
        self._stamp: tuple[int, int, int] | None = None
        self._listed: list[bytes] = []  # further lines of the file
        if isinstance(secret, os.PathLike):
            self.path = Path(secret)
            self._stamp = self._stat()
            self.current, self._listed = self._read()
        else:
            self.current = check_secret(secret, what)
        self._older: list[tuple[bytes, float]] = []  # (secret, accepted until: monotonic)

    def also(self, now: float | None = None) -> list[bytes]:
        """The older secrets still accepted (the file's further lines, then those of
        rotations, newest first), at most :data:`MAX_OLDER_SECRETS`."""
        now = time.monotonic() if now is None else now
        self._older = [(s, until) for s, until in self._older if until > now]
        out: list[bytes] = []
        for s in [*self._listed, *(s for s, _ in self._older)]:
            if s != self.current and s not in out:
                out.append(s)
        return out[:MAX_OLDER_SECRETS]

    def rotate(self, secret: bytes | str, now: float | None = None) -> bool:
        """Makes ``secret`` the current one; the previous one is accepted for
        ``grace`` more seconds. False when it already was the current one."""
        new = check_secret(secret, self.what)
        assert new is not None
        if self.current is None:
            raise InvalidArgumentError(
                f"this node runs without a {self.what}: one cannot be added while it runs")
        if new == self.current:
            return False
        now = time.monotonic() if now is None else now
        older = [(s, u) for s, u in self._older if u > now and s != new]
        self._older = ([(self.current, now + self.grace), *older])[:MAX_OLDER_SECRETS]
        self.current = new
        return True

    def reread(self, now: float | None = None) -> bool:
        """Reads the file again if it changed since it was last read; True when that
        changed the secrets. A file that cannot be read, or holds no valid secret, keeps
        the current secret and raises :class:`~pccl.InvalidArgumentError` once per
        change of the file."""
        if self.path is None:
            return False
        stamp = self._stat()
        if stamp is None or stamp == self._stamp:
            return False
        self._stamp = stamp
        listed = self._listed
        current, self._listed = self._read()
        assert current is not None
        return self.rotate(current, now) or self._listed != listed

    def _stat(self) -> tuple[int, int, int] | None:
        assert self.path is not None
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _read(self) -> tuple[bytes | None, list[bytes]]:
        """The file's secret (its first line) and the older ones of its further lines."""
        assert self.path is not None
        data = read_secret_file(self.path, f"{self.what} file")  # (unreadable, empty: refused)
        lines = [x.strip() for x in data.splitlines() if x.strip()]
        if len(lines) > 1 + MAX_OLDER_SECRETS:
            raise InvalidArgumentError(
                f"the {self.what} file {str(self.path)!r} has {len(lines)} lines: the "
                f"secret, then at most {MAX_OLDER_SECRETS} older ones still accepted")
        checked = [check_secret(x, self.what) for x in lines]
        return checked[0], [x for x in checked[1:] if x is not None]


# --- files ---------------------------------------------------------------------------


def write_text(path: str | os.PathLike[str], text: str, *, private: bool,
               force: bool = False) -> Path:
    """Writes ``text`` to a new file (0600 when ``private``, also over an existing file
    with ``force``); InvalidArgumentError when it exists and ``force`` is not given."""
    p = Path(path)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    try:
        fd = os.open(p, flags, 0o600 if private else 0o644)
    except FileExistsError:
        raise InvalidArgumentError(f"{str(p)!r} exists already; it is not overwritten "
                                   "(remove it first, or pass --force)") from None
    with os.fdopen(fd, "w") as f:
        if private:
            os.fchmod(f.fileno(), 0o600)  # (--force over a file others could read)
        f.write(text)
    return p


def _write(path: str | os.PathLike[str], label: str, data: bytes, *, private: bool,
           force: bool = False) -> Path:
    return write_text(path, f"{label} {base64.b64encode(data).decode()}\n",
                      private=private, force=force)


def _read(path: str | os.PathLike[str], label: str) -> bytes:
    try:
        text = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgumentError(f"cannot read {str(path)!r}: {e}") from None
    got, _, body = text.partition(" ")
    if got != label:
        raise InvalidArgumentError(
            f"{str(path)!r} is not a {label} file (it starts with {got[:40]!r})")
    try:
        return base64.b64decode(body.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgumentError(f"{str(path)!r}: the {label} is not valid base64") from None


def _require_private(path: str | os.PathLike[str]) -> None:
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise InvalidArgumentError(f"cannot read {str(path)!r}: {e.strerror or e}") from None
    if mode & 0o077:
        raise InvalidArgumentError(
            f"{str(path)!r} holds a secret key but others may read it (mode "
            f"{mode & 0o777:o}); chmod 600 it")


def _none_exist(prefix: str | os.PathLike[str], force: bool) -> None:
    """A key pair is written whole or not at all."""
    for path in (f"{prefix}.key", f"{prefix}.pub"):
        if not force and os.path.lexists(path):
            raise InvalidArgumentError(f"{path!r} exists already; it is not overwritten "
                                       "(remove it first, or pass --force)")


def new_run_key(prefix: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Writes a new run key: ``PREFIX.key`` (0600, keep it offline) and ``PREFIX.pub``
    (the trust anchor for every node). Returns the ``.key`` path."""
    _none_exist(prefix, force)
    seed = _secrets.token_bytes(32)
    key = _write(f"{prefix}.key", RUN_KEY, seed, private=True, force=force)
    _write(f"{prefix}.pub", RUN_PUB, _core.run_public_key(seed), private=False, force=force)
    return key


def new_node_key(prefix: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Writes a node key: ``PREFIX.key`` (0600, stays on the node) and ``PREFIX.pub``
    (what the operator signs). Returns the ``.pub`` path."""
    _none_exist(prefix, force)
    secret = _secrets.token_bytes(32)
    _write(f"{prefix}.key", NODE_KEY, secret, private=True, force=force)
    return _write(f"{prefix}.pub", NODE_PUB, _core.node_public_key(secret), private=False,
                  force=force)


def sign_node(run_key: str | os.PathLike[str], node_pub: str | os.PathLike[str], *,
              name: str, groups: Sequence[str] = ("peer",), days: float = 7.0,
              out: str | os.PathLike[str], force: bool = False) -> Path:
    """Signs a certificate for the node key in ``node_pub`` with the run key: valid from
    now for ``days``, for ``groups`` (``peer``, ``master``). Returns ``out``."""
    if not 0 < days <= 3660:
        raise InvalidArgumentError(f"days must be in (0, 3660], got {days}")
    _require_private(run_key)
    seed = _read(run_key, RUN_KEY)
    now = int(time.time())
    cert = _core.sign_cert(seed, _read(node_pub, NODE_PUB), name, list(groups), now,
                           now + int(days * 86400))
    return _write(out, CERT, cert, private=False, force=force)


def parse_fingerprint(text: str) -> bytes:
    """A key fingerprint as printed (32 hex digits) -> its 16 bytes."""
    t = text.strip().lower()
    if len(t) != 32 or not _HEX.fullmatch(t):
        raise InvalidArgumentError(f"{text!r} is not a key fingerprint (32 hex digits)")
    return bytes.fromhex(t)


def revoke(run_key: str | os.PathLike[str], fingerprints: Iterable[str],
           denylist: str | os.PathLike[str], *, unrevoke: bool = False) -> int:
    """Adds (or with ``unrevoke``, removes) keys by fingerprint to the denylist file,
    signed anew by the run key with the next version. Returns that version. A master
    started with ``--denylist FILE`` picks it up within a second and hands it to every
    peer; the revoked nodes are dropped and refused from then on."""
    _require_private(run_key)
    seed = _read(run_key, RUN_KEY)
    version, held = 0, set()
    if Path(denylist).exists():
        issuer, version, _, fps = _core.parse_denylist(_read(denylist, DENYLIST))
        if issuer != _core.run_public_key(seed):
            raise InvalidArgumentError(f"{str(denylist)!r} was signed by another run key")
        held = set(fps)
    change = {parse_fingerprint(f) for f in fingerprints}
    held = held - change if unrevoke else held | change
    raw = _core.sign_denylist(seed, version + 1, int(time.time()), sorted(held))
    tmp = Path(f"{denylist}.tmp")
    _write(tmp, DENYLIST, raw, private=False, force=True)
    os.replace(tmp, denylist)  # atomic: a master watching the file never reads half
    return version + 1


def load_denylist(path: str | os.PathLike[str]) -> bytes:
    """The signed bytes of a denylist file."""
    return _read(path, DENYLIST)


def trust_paths(trust: str | Sequence[str | os.PathLike[str]] | None) -> list[str]:
    """Run-key files from a comma-separated string (``PCCL_TRUST``) or a list."""
    if trust is None:
        return []
    if isinstance(trust, str):
        return [t.strip() for t in trust.split(",") if t.strip()]
    return [os.fspath(t) for t in trust]


def load(key_file: str | os.PathLike[str] | None, cert_file: str | os.PathLike[str] | None,
         trust: str | Sequence[str | os.PathLike[str]] | None = None,
         denylist: str | os.PathLike[str] | None = None) -> _core.Identity:
    """A node's identity from its files. ``trust``: the run-key files (``run.pub``) whose
    certificates this node accepts; with any, every other node must present one (and so
    must this node: ``cert_file``). Without ``key_file`` the node gets a fresh key (it
    then cannot have a certificate). Raises InvalidArgumentError for a missing,
    unreadable or inconsistent file (a certificate for another key, by an untrusted run
    key), IdentityError for a bad signature."""
    anchors = [_read(p, RUN_PUB) for p in trust_paths(trust)]
    secret = None
    if key_file is not None:
        _require_private(key_file)
        secret = _read(key_file, NODE_KEY)
    elif cert_file is not None:
        raise InvalidArgumentError("a certificate needs its key file (key_file)")
    cert = _read(cert_file, CERT) if cert_file is not None else None
    identity = _core.Identity(secret, cert, anchors)
    if denylist is not None and Path(denylist).exists():
        identity.install_denylist(load_denylist(denylist))
    return identity


def describe(identity: _core.Identity) -> dict[str, object]:
    """Fingerprint, name, groups and expiry of a node's own identity (for logs, status)."""
    out: dict[str, object] = {"fingerprint": identity.fingerprint}
    if identity.cert is not None:
        _, _, name, groups, _, not_after = _core.parse_cert(identity.cert)
        out.update(name=name, groups=groups, not_after=not_after)
    return out
