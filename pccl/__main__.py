"""Command line: ``python -m pccl master ...`` / ``python -m pccl demo``.

``pccl-master`` (the console script) is the same as ``python -m pccl master``. Every flag
of the master falls back to its environment variable (``--listen``: ``PCCL_MASTER_LISTEN``,
``--status``: ``PCCL_STATUS_LISTEN``, ...; see :mod:`pccl.config`), then to
:class:`~pccl.MasterNode`'s default; a flag given wins.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import logging
import os
import resource
import signal
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pccl import _logging, config
from pccl._logging import parse_level
from pccl.errors import InvalidArgumentError, PCCLError
from pccl.master.server import MasterNode
from pccl.protocol import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION
from pccl.protocol.auth import join_host_port, split_host_port


def _version() -> str:
    """The release and the control-plane protocol it speaks (with the oldest it still
    works with: a rolling upgrade needs neighbours within that window)."""
    try:
        release = importlib.metadata.version("pccl")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a source tree
        release = "unknown"
    return (f"{release} (protocol {PROTOCOL_VERSION}, works with {MIN_PROTOCOL_VERSION} to "
            f"{PROTOCOL_VERSION})")


#: Where ``pccl-master`` serves its status page when neither ``--status`` nor
#: ``PCCL_STATUS_LISTEN`` says otherwise (``MasterNode`` itself serves none by default).
DEFAULT_STATUS = "127.0.0.1:48180"
_LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]
# Flags whose value goes to the MasterNode parameter of the same name as it is.
_PLAIN_FLAGS = ("listen", "heartbeat_interval", "heartbeat_timeout", "handshake_timeout",
                "establish_timeout", "max_establish_attempts", "recovery_grace",
                "repair_rings", "dial_back_timeout", "max_relayed_streams", "insecure",
                "max_connections",
                "mesh_max_bytes", "quorum", "standby", "key_file", "cert_file", "trust",
                "denylist", "allow_anonymous", "run_id", "state_dir", "secret_grace",
                "admin_socket")


def _add_master_args(p: argparse.ArgumentParser) -> None:
    """The master's flags. None has a default of its own: a flag left out falls back to
    its environment variable (pccl/config.py), then to MasterNode's default, so the
    attribute of a flag not given is absent from the parsed namespace."""
    var = {v.param: v for v in config.variables(MasterNode)}

    def d(param: str, default: object = None) -> str:
        v = var[param]
        shown = v.default if default is None else default
        return f"default: ${v.name}, else {shown}"

    s = argparse.SUPPRESS
    p.add_argument("--listen", default=s, metavar="HOST:PORT",
                   help=f"address to listen on (port 0: a free one; {d('listen')})")
    p.add_argument("--secret-file", type=Path, default=s, metavar="FILE",
                   help="file holding the shared secret peers must prove they know "
                        "(surrounding whitespace is ignored; re-read when it changes: a "
                        "rotation; default: $PCCL_SECRET_FILE or $PCCL_SECRET, else none)")
    p.add_argument("--secret-grace", type=float, default=s, metavar="S",
                   help=f"after a rotation, seconds the previous secret is still accepted "
                        f"({d('secret_grace')})")
    p.add_argument("--heartbeat-interval", type=float, default=s, metavar="S",
                   help=f"seconds between pings to each peer ({d('heartbeat_interval')})")
    p.add_argument("--heartbeat-timeout", type=float, default=s, metavar="S",
                   help=f"a peer silent this long is dropped ({d('heartbeat_timeout')})")
    p.add_argument("--handshake-timeout", type=float, default=s, metavar="S",
                   help=f"seconds a connecting peer has to say hello "
                        f"({d('handshake_timeout')})")
    p.add_argument("--establish-timeout", type=float, default=s, metavar="S",
                   help=f"seconds the peers of a topology round have to report their p2p "
                        f"links ({d('establish_timeout')})")
    p.add_argument("--max-establish-attempts", type=int, default=s, metavar="N",
                   help=f"attempts at building the rings before a round fails "
                        f"({d('max_establish_attempts')})")
    p.add_argument("--recovery-grace", type=float, default=s, metavar="S",
                   help=f"after a restart: seconds to wait for the rest of an old group "
                        f"({d('recovery_grace')})")
    p.add_argument("--repair-rings", action=argparse.BooleanOptionalAction, default=s,
                   help=f"rebuild a ring that lost a peer without waiting for "
                        f"update_topology() (as in PCCL; {d('repair_rings', 'on')})")
    p.add_argument("--dial-back-timeout", type=float, default=s, metavar="S",
                   help=f"reachability check of each peer's p2p address, seconds; peers "
                        f"that fail it are behind NAT ({d('dial_back_timeout')})")
    p.add_argument("--max-relayed-streams", type=int, default=s, metavar="N",
                   help=f"ring-link streams relayed at once for peers that cannot connect "
                        f"directly (0: no relay; {d('max_relayed_streams')})")
    p.add_argument("--max-connections", type=int, default=s, metavar="N",
                   help=f"connections held at once on the control port (peers, handshakes, "
                        f"relayed streams); past it new ones wait in the kernel's backlog "
                        f"({d('max_connections', 'the open-files limit less 128')})")
    p.add_argument("--mesh-max-bytes", type=int, default=s, metavar="N",
                   help=f"all-reduces up to N bytes run on the mesh (recursive doubling, "
                        f"log2(k) hops) instead of the ring (-1: chosen from k and the "
                        f"measured links; 0: never; {d('mesh_max_bytes')})")
    p.add_argument("--standby", action=argparse.BooleanOptionalAction, default=s,
                   help=f"a standby master starts no group: it takes one over from the "
                        f"peers of a lost master (peers list it after the active one in "
                        f"their master=a,b,...; {d('standby', 'off')})")
    p.add_argument("--quorum", action=argparse.BooleanOptionalAction, default=s,
                   help=f"a new ring needs a majority of the group's previous ring "
                        f"(split-brain protection; "
                        f"{d('quorum', QUORUM_DEFAULT)})")
    p.add_argument("--insecure", action=argparse.BooleanOptionalAction, default=s,
                   help=f"also accept peers whose control connection is in clear text "
                        f"(Communicator(insecure=True)); encrypted ones are accepted either "
                        f"way ({d('insecure', 'off')})")
    p.add_argument("--key-file", default=s, metavar="FILE",
                   help=f"this master's node key (`pccl node new`) ({d('key_file')})")
    p.add_argument("--cert-file", default=s, metavar="FILE",
                   help="this master's certificate, for the group `master` (`pccl ca sign "
                        f"--groups master`) ({d('cert_file')})")
    p.add_argument("--trust", default=s, metavar="RUN.pub[,...]",
                   help="run-key files whose certificates every peer must present "
                        f"({d('trust')})")
    p.add_argument("--denylist", default=s, metavar="FILE",
                   help="signed denylist (`pccl ca revoke`), re-read when it changes: the "
                        f"keys it names are dropped and refused ({d('denylist')})")
    p.add_argument("--allow-anonymous", action=argparse.BooleanOptionalAction, default=s,
                   help="listen beyond loopback with nothing authenticating the peers (no "
                        f"secret, no certificates) ({d('allow_anonymous', 'off')})")
    p.add_argument("--run-id", default=s, metavar="NAME",
                   help=f"the run this master serves: peers must say the same "
                        f"(Communicator(run_id=)) ({d('run_id', 'none')})")
    p.add_argument("--state-dir", default=s, metavar="DIR",
                   help=f"keep the timeline (timeline.jsonl) and the removed keys (bans.json) here "
                        f"across restarts "
                        f"({d('state_dir', 'none')})")
    p.add_argument("--admin-socket", default=s, metavar="PATH",
                   help=f"serve `pccl admin` (remove a contributor, end the run) on this "
                        f"Unix socket: 0600, root and this user only "
                        f"({d('admin_socket', 'none')})")
    p.add_argument("--status", default=s, metavar="HOST:PORT",
                   help=f"serve the read-only status page, /api/status and /metrics here "
                        f"('off': none; {d('status_listen', DEFAULT_STATUS)}); a non-loopback "
                        f"address needs --status-token-file")
    p.add_argument("--status-token-file", type=Path, default=s, metavar="FILE",
                   help="file holding the bearer token the status server asks for "
                        "(default: $PCCL_STATUS_TOKEN_FILE or $PCCL_STATUS_TOKEN, else none)")
    p.add_argument("--log-level", default=None, type=str.upper, choices=_LOG_LEVELS,
                   help=f"default: ${config.LOG_LEVEL}, else INFO")
    p.add_argument("--log-format", default=None, type=str.lower, choices=_logging.FORMATS,
                   help=f"text: one line per record, UTC timestamps; json: one JSON object "
                        f"per line (ts, level, logger, msg, exc) (default: "
                        f"${config.LOG_FORMAT}, else text)")


QUORUM_DEFAULT = "on for a standby, else off: give it to every master of a run with several"


def _log_level(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    """--log-level, else PCCL_LOG_LEVEL (a bad value was already warned about at import
    and is ignored, as everywhere), else INFO."""
    if args.log_level is not None:
        return int(logging.getLevelName(args.log_level))
    from_env = parse_level(env.get(config.LOG_LEVEL, ""))
    return logging.INFO if from_env is None else from_env


def _log_format(args: argparse.Namespace, env: Mapping[str, str]) -> str:
    """--log-format, else PCCL_LOG_FORMAT (a bad value was warned about at import and is
    ignored), else text."""
    if args.log_format is not None:
        return str(args.log_format)
    return _logging.parse_format(env.get(config.LOG_FORMAT, "")) or "text"


def master_overrides(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, Any]:
    """The MasterNode arguments the command line gives; ``MasterNode.from_env(env,
    **overrides)`` fills in the rest. Secret files are read here (an unreadable or empty
    one raises :class:`InvalidArgumentError`)."""
    given = vars(args)
    out: dict[str, Any] = {name: given[name] for name in _PLAIN_FLAGS if name in given}
    if "secret_file" in given:
        # Read once now (an unreadable file fails at once), then watched by the master:
        # a changed file rotates the secret.
        config.read_secret_file(given["secret_file"], "secret file")
        out["secret"] = Path(given["secret_file"])
    if "status" in given:
        out["status_listen"] = None if given["status"].lower() == "off" else given["status"]
    elif not config.is_set(env, config.env_name("status_listen")):
        out["status_listen"] = DEFAULT_STATUS
    if "status_token_file" in given:
        token = config.read_secret_file(given["status_token_file"], "status token file")
        try:
            out["status_token"] = token.decode()
        except UnicodeDecodeError:
            raise InvalidArgumentError(f"the status token file {str(given['status_token_file'])!r} "
                                       f"is not UTF-8 text") from None
    return out


class _UserError(Exception):
    """A mistake on the command line: printed as one line, exit status 2 (as argparse)."""


def _raise_fd_limit() -> None:
    """The soft limit on open files up to the hard one: a master holds a socket per
    peer, and what it accepts at once is this limit less a reserve
    (``MasterNode.max_connections``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, 1 << 20), hard))


def status_url(address: str) -> str:
    """The status page's URL to print: a wildcard listen address (0.0.0.0, ::) is no
    place to browse to, so this machine's name is shown, and the loopback URL."""
    host, port = split_host_port(address)
    if host in ("0.0.0.0", "::", ""):
        return (f"http://{socket.gethostname()}:{port}/ (every interface; from this machine "
                f"http://127.0.0.1:{port}/)")
    return f"http://{join_host_port(host, port)}/"


async def _run_master(args: argparse.Namespace) -> None:
    _raise_fd_limit()
    master = MasterNode.from_env(os.environ, **master_overrides(args, os.environ))
    await master.start()
    print(f"pccl master listening on {master.address}", flush=True)
    if master.status_address is not None:
        print(f"status page on {status_url(master.status_address)}", flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # Until a signal, or until the master stops on its own (`pccl admin end-run`).
    waits = [asyncio.create_task(stop.wait()), asyncio.create_task(master.serve_forever())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        await master.stop()


def _configure_logging(level: int, kind: str = "text") -> None:
    _logging.configure_root(level, kind)
    # PCCL_LOG_LEVEL set the pccl logger's own level at import: the flag wins.
    logging.getLogger("pccl").setLevel(level)


def _serve(prog: str, args: argparse.Namespace) -> int:
    """Runs the master; a user error is one line on stderr and a non-zero exit status."""
    try:
        asyncio.run(_run_master(args))
    except (_UserError, InvalidArgumentError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except (PCCLError, OSError) as e:
        text = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        print(f"{prog}: error: {text}", file=sys.stderr)
        return 1
    return 0


def master_main(argv: list[str] | None = None) -> None:
    """Entry point of the ``pccl-master`` console script."""
    p = argparse.ArgumentParser(prog="pccl-master", description="Run a pccl master node.")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    _add_master_args(p)
    args = p.parse_args(argv)
    _configure_logging(_log_level(args, os.environ), _log_format(args, os.environ))
    sys.exit(_serve(p.prog, args))


def _add_admin_command(sub: Any) -> None:
    adm = sub.add_parser("admin", help="ask a running master, over its admin socket, to "
                                       "remove a contributor or end the run",
                         description="Talks to a running master over its admin socket "
                                     "(pccl-master --admin-socket PATH), as root or the "
                                     "master's user.")
    adm.add_argument("--socket", default=None, metavar="PATH",
                     help=f"the master's admin socket (default: "
                          f"${config.env_name('admin_socket')})")
    adm.add_argument("--timeout", type=float, default=30.0, metavar="S",
                     help="seconds to wait for the master's answer (%(default)s)")
    acts = adm.add_subparsers(dest="action", required=True)
    rm = acts.add_parser("remove", help="drop a peer from the run and refuse its key from "
                                        "then on")
    rm.add_argument("target", metavar="NAME_OR_ID_OR_FINGERPRINT",
                    help="the peer's name (as on the status page), its id, or a prefix of "
                         "its key's fingerprint (12 hex digits at least)")
    rm.add_argument("--reason", default="", metavar="TEXT",
                    help="why (logged, and put on the run's timeline)")
    ub = acts.add_parser("unban", help="lift the ban on a removed key")
    ub.add_argument("target", metavar="NAME_OR_FINGERPRINT",
                    help="the name it was removed under, or a fingerprint prefix")
    end = acts.add_parser("end-run", help="end the run: every peer is told and stops "
                                          "waiting, and the master stops")
    end.add_argument("--reason", default="", metavar="TEXT",
                     help="what the peers are told")
    acts.add_parser("status", help="the peers (id, name, key fingerprint) and the bans")


def _admin(args: argparse.Namespace) -> int:
    """``pccl admin``: one request; its answer on stdout, or one line on stderr and a
    non-zero exit status."""
    from pccl.master import admin

    prog = "pccl admin"
    path = args.socket or os.environ.get(config.env_name("admin_socket"), "").strip()
    if not path:
        print(f"{prog}: error: say where the master's admin socket is: --socket PATH or "
              f"{config.env_name('admin_socket')}", file=sys.stderr)
        return 2
    doc: dict[str, Any] = {"command": args.action}
    for field in ("target", "reason"):
        if getattr(args, field, ""):
            doc[field] = getattr(args, field)
    try:
        reply = admin.request(path, doc, args.timeout)
    except admin.AdminError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    if reply.get("ok") is not True:
        error = " ".join(str(reply.get("error", "the master refused the request")).split())
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 1
    if args.action != "status":
        print(reply.get("text", "done"))
        return 0
    run = f" (run {reply['run_id']!r})" if reply.get("run_id") else ""
    print(f"master {reply.get('address', '?')}{run}")
    peers = reply.get("peers") or []
    print(f"peers: {len(peers)}")
    for p in peers:
        print(f"  {p.get('peer_id')}\t{p.get('name') or '-'}\t{p.get('fingerprint') or '-'}"
              f"\tgroup {p.get('group')}\t{p.get('status')}")
    bans = reply.get("bans") or []
    print(f"removed keys: {len(bans)}")
    for b in bans:
        print(f"  {b.get('fingerprint')}\t{b.get('name') or '-'}\t{b.get('reason') or '-'}")
    return 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pccl")
    p.add_argument("--version", action="version", version=f"pccl {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    _add_master_args(sub.add_parser("master", help="run a master node"))
    sub.add_parser("env", help="print every PCCL_* variable pccl reads, as a Markdown table")
    demo = sub.add_parser("demo", help="run a local demo cluster and narrate it")
    demo.add_argument("--peers", type=int, default=4, choices=range(2, 17), metavar="N",
                      help="peer processes to start, 2..16 (%(default)s)")
    demo.add_argument("--log-level", default="WARNING", type=str.upper,
                      choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    doctor = sub.add_parser("doctor", help="check this machine before it joins a run")
    doctor.add_argument("--master", required=True, metavar="HOST:PORT",
                        help="the master this machine will join")
    doctor.add_argument("--secret-file", type=Path, default=None, metavar="FILE",
                        help="the run's shared secret (the file the master was started with)")
    doctor.add_argument("--insecure", action="store_true",
                        help="check a clear-text setup (Communicator(insecure=True))")
    doctor.add_argument("--key-file", default=None, metavar="FILE",
                        help="this node's key (`pccl node new`), to check its certificate")
    doctor.add_argument("--cert-file", default=None, metavar="FILE",
                        help="this node's certificate (`pccl ca sign`)")
    doctor.add_argument("--trust", default=None, metavar="RUN.pub[,...]",
                        help="run-key files the master's certificate must come from")
    doctor.add_argument("--p2p-port", type=int, default=0, metavar="PORT",
                        help="the p2p port this peer will listen on (0: any)")
    doctor.add_argument("--timeout", type=float, default=10.0, metavar="S",
                        help="seconds for each check (%(default)s)")
    doctor.add_argument("--log-level", default="ERROR", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="what pccl logs while checking (%(default)s)")
    from pccl import keys_cli

    keys_cli.add_commands(sub)
    _add_admin_command(sub)
    args = p.parse_args(argv)
    if args.command in keys_cli.COMMANDS:
        sys.exit(keys_cli.run(args))
    if args.command == "admin":
        sys.exit(_admin(args))
    if args.command == "env":
        print(config.markdown_table(), end="")
        return
    if args.command == "master":
        _configure_logging(_log_level(args, os.environ), _log_format(args, os.environ))
    else:
        _logging.configure_root(int(logging.getLevelName(args.log_level)),
                                _log_format(argparse.Namespace(log_format=None), os.environ))
    if args.command == "doctor":
        from pccl import identity as ident
        from pccl.doctor import diagnose

        try:
            # (The file's first line: further ones are older secrets of a rotation.)
            secret = (ident.Secrets(args.secret_file).current
                      if args.secret_file is not None else None)
            me = (ident.load(args.key_file, args.cert_file, args.trust)
                  if args.key_file or args.trust else None)
        except (_UserError, PCCLError) as e:
            print(f"python -m pccl doctor: error: {e}", file=sys.stderr)
            sys.exit(2)
        report = asyncio.run(diagnose(args.master, secret, insecure=args.insecure,
                                      p2p_port=args.p2p_port, timeout=args.timeout,
                                      identity=me))
        print(report.render(), flush=True)
        sys.exit(1 if report.failed else 0)
    if args.command == "master":
        sys.exit(_serve("python -m pccl master", args))
    else:
        from pccl.demo import run_demo

        sys.exit(asyncio.run(run_demo(args.peers)))


if __name__ == "__main__":
    main()
