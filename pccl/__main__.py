"""Command line: ``python -m pccl master ...`` / ``python -m pccl demo``.

``pccl-master`` (the console script) is the same as ``python -m pccl master``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import logging
import signal
import sys
from pathlib import Path

from pccl.errors import InvalidArgumentError, PCCLError
from pccl.master.server import MasterNode
from pccl.protocol.auth import DEFAULT_PORT


def _version() -> str:
    try:
        return importlib.metadata.version("pccl")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a source tree
        return "unknown"


def _add_master_args(p: argparse.ArgumentParser) -> None:
    d = MasterNode.__init__.__kwdefaults__ or {}
    p.add_argument("--listen", default=f"0.0.0.0:{DEFAULT_PORT}", metavar="HOST:PORT",
                   help="address to listen on (port 0: a free one; default %(default)s)")
    p.add_argument("--secret-file", type=Path, default=None, metavar="FILE",
                   help="file holding the shared secret peers must prove they know "
                        "(surrounding whitespace is ignored)")
    p.add_argument("--heartbeat-interval", type=float, default=d["heartbeat_interval"],
                   metavar="S", help="seconds between pings to each peer (%(default)s)")
    p.add_argument("--heartbeat-timeout", type=float, default=d["heartbeat_timeout"],
                   metavar="S", help="a peer silent this long is dropped (%(default)s)")
    p.add_argument("--handshake-timeout", type=float, default=d["handshake_timeout"],
                   metavar="S", help="seconds a connecting peer has to say hello (%(default)s)")
    p.add_argument("--establish-timeout", type=float, default=d["establish_timeout"],
                   metavar="S", help="seconds the peers of a topology round have to report "
                                     "their p2p links (%(default)s)")
    p.add_argument("--max-establish-attempts", type=int,
                   default=d["max_establish_attempts"], metavar="N",
                   help="attempts at building the rings before a round fails (%(default)s)")
    p.add_argument("--recovery-grace", type=float, default=d["recovery_grace"], metavar="S",
                   help="after a restart: seconds to wait for the rest of an old group "
                        "(%(default)s)")
    p.add_argument("--repair-rings", action=argparse.BooleanOptionalAction,
                   default=d["repair_rings"],
                   help="rebuild a ring that lost a peer without waiting for "
                        "update_topology() (default: on, as in PCCL)")
    p.add_argument("--dial-back-timeout", type=float, default=d["dial_back_timeout"],
                   metavar="S", help="reachability check of each peer's p2p address "
                                     "(%(default)s s); peers that fail it are behind NAT")
    p.add_argument("--max-relayed-streams", type=int, default=d["max_relayed_streams"],
                   metavar="N", help="ring-link streams relayed at once for peers that "
                                     "cannot connect directly (%(default)s; 0: no relay)")
    p.add_argument("--insecure", action="store_true",
                   help="also accept peers whose control connection is in clear text "
                        "(Communicator(insecure=True)); encrypted ones are accepted either way")
    p.add_argument("--status", default="127.0.0.1:48180", metavar="HOST:PORT",
                   help="serve the read-only status page, /api/status and /metrics here "
                        "(default %(default)s; 'off': none); a non-loopback address needs "
                        "--status-token-file")
    p.add_argument("--status-token-file", type=Path, default=None, metavar="FILE",
                   help="file holding the bearer token the status server asks for")
    p.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def _read_secret(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        secret = path.read_bytes().strip()
    except OSError as e:
        raise _UserError(f"cannot read the secret file {str(path)!r}: {e.strerror}") from None
    if not secret:
        raise _UserError(f"the secret file {str(path)!r} is empty")
    return secret


class _UserError(Exception):
    """A mistake on the command line: printed as one line, exit status 2 (as argparse)."""


async def _run_master(args: argparse.Namespace) -> None:
    master = MasterNode(listen=args.listen, secret=_read_secret(args.secret_file),
                        heartbeat_interval=args.heartbeat_interval,
                        heartbeat_timeout=args.heartbeat_timeout,
                        handshake_timeout=args.handshake_timeout,
                        establish_timeout=args.establish_timeout,
                        max_establish_attempts=args.max_establish_attempts,
                        recovery_grace=args.recovery_grace,
                        repair_rings=args.repair_rings, insecure=args.insecure,
                        dial_back_timeout=args.dial_back_timeout,
                        max_relayed_streams=args.max_relayed_streams,
                        status_listen=None if args.status == "off" else args.status,
                        status_token=(_read_secret(args.status_token_file) or b"").decode()
                        or None)
    await master.start()
    print(f"pccl master listening on {master.address}", flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await master.stop()


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
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(_serve(p.prog, args))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pccl")
    p.add_argument("--version", action="version", version=f"pccl {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    _add_master_args(sub.add_parser("master", help="run a master node"))
    demo = sub.add_parser("demo", help="run a local demo cluster and narrate it")
    demo.add_argument("--peers", type=int, default=4, choices=range(2, 17), metavar="N",
                      help="peer processes to start, 2..16 (%(default)s)")
    demo.add_argument("--log-level", default="WARNING", type=str.upper,
                      choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    doctor = sub.add_parser("doctor", help="check this machine before it joins a run")
    doctor.add_argument("--master", required=True, metavar="HOST:PORT")
    doctor.add_argument("--secret-file", type=Path, default=None, metavar="FILE")
    doctor.add_argument("--insecure", action="store_true",
                        help="check a clear-text setup (Communicator(insecure=True))")
    doctor.add_argument("--p2p-port", type=int, default=0, metavar="PORT",
                        help="the p2p port this peer will listen on (0: any)")
    doctor.add_argument("--timeout", type=float, default=10.0, metavar="S")
    doctor.add_argument("--log-level", default="ERROR", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "doctor":
        from pccl.doctor import diagnose

        try:
            secret = _read_secret(args.secret_file)
        except _UserError as e:
            print(f"python -m pccl doctor: error: {e}", file=sys.stderr)
            sys.exit(2)
        report = asyncio.run(diagnose(args.master, secret, insecure=args.insecure,
                                      p2p_port=args.p2p_port, timeout=args.timeout))
        print(report.render(), flush=True)
        sys.exit(1 if report.failed else 0)
    if args.command == "master":
        sys.exit(_serve("python -m pccl master", args))
    else:
        from pccl.demo import run_demo

        sys.exit(asyncio.run(run_demo(args.peers)))


if __name__ == "__main__":
    main()
