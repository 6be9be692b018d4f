"""``pccl secret``, ``pccl ca``, ``pccl node``, ``pccl cert``: the operator's key tools
(see :mod:`pccl.identity` for the files and what each one holds).

A run with certificates is set up like this::

    python -m pccl secret new --out secret          # optional: the shared secret
    python -m pccl ca new --out run                 # run.key (keep offline), run.pub
    python -m pccl node new --out alice             # on the node: alice.key, alice.pub
    python -m pccl ca sign alice.pub --key run.key --name alice        # -> alice.cert
    python -m pccl ca sign m.pub --key run.key --name m --groups master
    python -m pccl ca revoke FINGERPRINT --key run.key --denylist deny.list
    python -m pccl cert show alice.cert

Each command prints what it wrote and what to do next. A mistake (a missing or wrong
file, a file that exists already, a bad signature) is one line on stderr,
``python -m pccl COMMAND ACTION: error: ...``, and exit status 2.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

from pccl import _core, identity
from pccl.errors import InvalidArgumentError, PCCLError

COMMANDS = ("secret", "ca", "node", "cert")
#: The groups a certificate may name: what a handshake checks the other end against.
GROUPS = ("peer", "master")

_PROG = "python -m pccl"


def add_commands(sub: Any) -> None:
    """Adds ``secret``, ``ca``, ``node`` and ``cert`` to the subparsers ``sub`` of
    ``python -m pccl``. Each has its own sub-commands, in ``args.action``."""
    secret = sub.add_parser("secret", help="make a shared secret").add_subparsers(
        dest="action", required=True, metavar="ACTION")
    p = secret.add_parser("new", help="write a fresh 256-bit secret to a file (mode 0600)")
    p.add_argument("--out", required=True, type=Path, metavar="FILE",
                   help="the file to write (a secret is not printed to the terminal)")
    _add_force(p)

    ca = sub.add_parser("ca", help="the run key: make it, sign node certificates, "
                                   "revoke keys").add_subparsers(
        dest="action", required=True, metavar="ACTION")
    p = ca.add_parser("new", help="write a new run key: PREFIX.key (0600) and PREFIX.pub")
    p.add_argument("--out", required=True, metavar="PREFIX",
                   help="path of the files less their suffix (e.g. run)")
    _add_force(p)
    p = ca.add_parser("sign", help="sign a certificate for a node's public key")
    p.add_argument("node_pub", type=Path, metavar="NODE.pub",
                   help="the node's public key (from `pccl node new`)")
    p.add_argument("--key", required=True, type=Path, metavar="RUN.key", help="the run key")
    p.add_argument("--name", required=True, help="the node's name in logs and status")
    p.add_argument("--groups", default="peer", type=_groups, metavar="G1,G2",
                   help="what the node may be, comma-separated: peer, master "
                        "(default: %(default)s)")
    p.add_argument("--days", default=7.0, type=float, metavar="N",
                   help="validity from now, in days (default: %(default)s)")
    p.add_argument("--out", type=Path, default=None, metavar="NODE.cert",
                   help="where to write it (default: NODE.pub with .cert for .pub)")
    _add_force(p)
    p = ca.add_parser("revoke", help="add keys to the signed denylist (or remove them)")
    p.add_argument("fingerprints", nargs="+", metavar="FINGERPRINT",
                   help="a key's fingerprint, 32 hex digits (as `pccl cert show` prints)")
    p.add_argument("--key", required=True, type=Path, metavar="RUN.key", help="the run key")
    p.add_argument("--denylist", required=True, type=Path, metavar="FILE",
                   help="the denylist file; made if absent, else its next version is "
                        "written in its place")
    p.add_argument("--unrevoke", action="store_true",
                   help="remove the fingerprints from the denylist instead")

    node = sub.add_parser("node", help="make a node key").add_subparsers(
        dest="action", required=True, metavar="ACTION")
    p = node.add_parser("new", help="write a new node key: PREFIX.key (0600) and PREFIX.pub")
    p.add_argument("--out", required=True, metavar="PREFIX",
                   help="path of the files less their suffix (e.g. the node's name)")
    _add_force(p)

    cert = sub.add_parser("cert", help="inspect certificates and denylists").add_subparsers(
        dest="action", required=True, metavar="ACTION")
    p = cert.add_parser("show", help="print what a certificate or a denylist says")
    p.add_argument("file", type=Path, metavar="FILE", help="a .cert or a denylist file")


def _add_force(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true", help="overwrite files that exist")


def _groups(text: str) -> list[str]:
    """``--groups``: a comma-separated list of :data:`GROUPS`; empty items are dropped.
    The signer takes any name, but a handshake only ever asks for these, so anything
    else is a typo that would make a useless certificate."""
    groups = [g.strip() for g in text.split(",") if g.strip()]
    unknown = [g for g in groups if g not in GROUPS]
    if not groups or unknown:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give one or more of {', '.join(GROUPS)}, comma-separated")
    return list(dict.fromkeys(groups))


def run(args: argparse.Namespace) -> int:
    """Runs ``args.command`` / ``args.action``; returns the exit status: 0, or 2 after
    printing a one-line error for a bad file, a refused signature or a failed write."""
    handler = _HANDLERS[(args.command, args.action)]
    try:
        handler(args)
    except PCCLError as e:  # InvalidArgumentError, IdentityError
        return _error(args, str(e))
    except OSError as e:
        where = f"{e.filename}: " if e.filename is not None else ""
        return _error(args, f"{where}{e.strerror or e}")
    return 0


def _error(args: argparse.Namespace, message: str) -> int:
    print(f"{_PROG} {args.command} {args.action}: error: {message}", file=sys.stderr)
    return 2


def _iso(t: int) -> str:
    """Seconds since the epoch as a UTC ISO time, ``2025-01-31T12:00:00Z``."""
    when = datetime.datetime.fromtimestamp(t, tz=datetime.UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def _fingerprint_of(path: str | os.PathLike[str], label: str) -> str:
    return _core.key_fingerprint(identity._read(path, label))


# --- the commands --------------------------------------------------------------------


def _secret_new(args: argparse.Namespace) -> None:
    out: Path = args.out
    identity.write_text(out, identity.new_secret() + "\n", private=True, force=args.force)
    print(f"wrote a new secret to {out} (mode 0600)")
    print(f"give the same file to the master and to every node: --secret-file {out}, "
          f"or PCCL_SECRET_FILE={out}")


def _ca_new(args: argparse.Namespace) -> None:
    key = identity.new_run_key(args.out, force=args.force)
    pub = Path(f"{args.out}.pub")
    print(f"wrote the run key {key} (mode 0600) and its public key {pub}")
    print(f"run key fingerprint: {_fingerprint_of(pub, identity.RUN_PUB)}")
    print(f"keep {key} offline: whoever holds it can admit any node. Give {pub} to every "
          f"node as its trust anchor (--trust / PCCL_TRUST).")


def _ca_sign(args: argparse.Namespace) -> None:
    node_pub: Path = args.node_pub
    out: Path = args.out if args.out is not None else _cert_path(node_pub)
    identity.sign_node(args.key, node_pub, name=args.name, groups=args.groups,
                       days=args.days, out=out, force=args.force)
    _, node_key, name, groups, _, not_after = _core.parse_cert(
        identity._read(out, identity.CERT))
    print(f"wrote {out}")
    print(f"name:        {name}")
    print(f"groups:      {', '.join(groups)}")
    print(f"fingerprint: {_core.key_fingerprint(node_key)}")
    print(f"expires:     {_iso(not_after)}")
    print("the node runs with its key and this certificate: PCCL_KEY_FILE and "
          "PCCL_CERT_FILE (or, for `pccl master`, --key-file and --cert-file)")


def _cert_path(node_pub: Path) -> Path:
    """``NODE.pub`` -> ``NODE.cert``; a name not ending in ``.pub`` gets ``.cert`` added."""
    if node_pub.suffix == ".pub":
        return node_pub.with_suffix(".cert")
    return node_pub.with_name(node_pub.name + ".cert")


def _ca_revoke(args: argparse.Namespace) -> None:
    version = identity.revoke(args.key, args.fingerprints, args.denylist,
                              unrevoke=args.unrevoke)
    _, _, _, fps = _core.parse_denylist(identity.load_denylist(args.denylist))
    print(f"wrote {args.denylist}, version {version}; it lists {len(fps)} key(s):")
    for fp in fps:
        print(f"  {fp.hex()}")
    print("a master started with --denylist FILE reads the new version within a second")


def _node_new(args: argparse.Namespace) -> None:
    pub = identity.new_node_key(args.out, force=args.force)
    print(f"wrote the node key {args.out}.key (mode 0600; it stays on this node) and "
          f"its public key {pub}")
    print(f"node key fingerprint: {_fingerprint_of(pub, identity.NODE_PUB)}")
    print(f"next: the operator signs it with `{_PROG} ca sign {pub} --key run.key "
          f"--name NAME` and gives the .cert back to this node")


def _cert_show(args: argparse.Namespace) -> None:
    path: Path = args.file
    try:
        label = path.read_text().strip().partition(" ")[0]
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgumentError(f"cannot read {str(path)!r}: {e}") from None
    if label == identity.DENYLIST:
        _show_denylist(path)
    elif label == identity.CERT:
        _show_cert(path)
    else:
        raise InvalidArgumentError(f"{str(path)!r} is neither a {identity.CERT} nor a "
                                   f"{identity.DENYLIST} file (it starts with "
                                   f"{label[:40]!r})")


def _show_cert(path: Path) -> None:
    issuer, node_key, name, groups, not_before, not_after = _core.parse_cert(
        identity._read(path, identity.CERT))
    now = time.time()
    expired = " (expired)" if not_after <= now else ""
    early = " (not yet valid)" if not_before > now else ""
    print(f"certificate {path}")
    print(f"name:        {name}")
    print(f"groups:      {', '.join(groups)}")
    print(f"fingerprint: {_core.key_fingerprint(node_key)}")
    print(f"issuer:      {_core.key_fingerprint(issuer)} (the run key's fingerprint)")
    print(f"not before:  {_iso(not_before)}{early}")
    print(f"not after:   {_iso(not_after)}{expired}")


def _show_denylist(path: Path) -> None:
    issuer, version, issued_at, fps = _core.parse_denylist(identity.load_denylist(path))
    print(f"denylist {path}")
    print(f"issuer:      {_core.key_fingerprint(issuer)} (the run key's fingerprint)")
    print(f"version:     {version}")
    print(f"issued at:   {_iso(issued_at)}")
    print(f"revoked:     {len(fps)} key(s)")
    for fp in fps:
        print(f"  {fp.hex()}")


_HANDLERS = {
    ("secret", "new"): _secret_new,
    ("ca", "new"): _ca_new,
    ("ca", "sign"): _ca_sign,
    ("ca", "revoke"): _ca_revoke,
    ("node", "new"): _node_new,
    ("cert", "show"): _cert_show,
}
