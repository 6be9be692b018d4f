"""Command line: ``python -m pccl master ...`` / ``python -m pccl demo``.

``pccl-master`` (the console script) is the same as ``python -m pccl master``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from pccl.master.server import DEFAULT_PORT, MasterNode


def _add_master_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default=f"0.0.0.0:{DEFAULT_PORT}",
                   help="host:port to listen on (port 0: ephemeral)")
    p.add_argument("--secret-file", type=Path, default=None,
                   help="file holding the shared secret peers must prove they know")
    p.add_argument("--heartbeat-interval", type=float, default=1.0)
    p.add_argument("--heartbeat-timeout", type=float, default=5.0)
    p.add_argument("--recovery-grace", type=float, default=5.0,
                   help="after a restart: seconds to wait for the rest of an old group")
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"])


async def _run_master(args: argparse.Namespace) -> None:
    secret = args.secret_file.read_bytes().strip() if args.secret_file else None
    master = MasterNode(listen=args.listen, secret=secret,
                        heartbeat_interval=args.heartbeat_interval,
                        heartbeat_timeout=args.heartbeat_timeout,
                        recovery_grace=args.recovery_grace)
    await master.start()
    print(f"pccl master listening on {master.address}", flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await master.stop()


def master_main(argv: list[str] | None = None) -> None:
    """Entry point of the ``pccl-master`` console script."""
    p = argparse.ArgumentParser(prog="pccl-master", description="Run a pccl master node.")
    _add_master_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_run_master(args))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pccl")
    sub = p.add_subparsers(dest="command", required=True)
    _add_master_args(sub.add_parser("master", help="run a master node"))
    demo = sub.add_parser("demo", help="run a local demo cluster and narrate it")
    demo.add_argument("--peers", type=int, default=4)
    demo.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "master":
        asyncio.run(_run_master(args))
    else:
        from pccl.demo import run_demo

        sys.exit(asyncio.run(run_demo(args.peers)))


if __name__ == "__main__":
    main()
