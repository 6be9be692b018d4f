"""Runs a pccl program as if it were a later release, for the rolling-upgrade tests.

    python tests/future_release.py AHEAD python -m pccl master --listen ...
    python tests/future_release.py AHEAD python -m pccl.testing.peer_worker ...

The release this makes up speaks protocol ``PROTOCOL_VERSION + AHEAD``, works with
releases down to ``AHEAD - 1`` versions behind it (a window of one, as a real release
keeps), and adds a field that today's release does not know to every control-plane
frame it sends (what a later release does when it grows a message). Everything else is
today's code: the test shows that the window's rules (skip unknown fields, refuse a
version outside the window by name) carry a rolling upgrade, not that a later
release's new feature works.
"""

from __future__ import annotations

import runpy
import sys

import msgpack

import pccl  # noqa: F401  (imports every module whose version names are patched below)
import pccl.doctor
import pccl.master.server
import pccl.peer.driver
from pccl.protocol import codec
from pccl.protocol import messages as m

TODAY = m.PROTOCOL_VERSION


def pretend(ahead: int) -> None:
    version, oldest = TODAY + ahead, TODAY + ahead - 1
    for name, mod in list(sys.modules.items()):
        if name.startswith("pccl") and mod is not None:
            if getattr(mod, "PROTOCOL_VERSION", None) == TODAY:
                mod.PROTOCOL_VERSION = version  # type: ignore[attr-defined]
            if hasattr(mod, "MIN_PROTOCOL_VERSION"):
                mod.MIN_PROTOCOL_VERSION = oldest  # type: ignore[attr-defined]
    today_encode = codec.encode

    def encode(msg: m.Message) -> bytes:
        body = msgpack.unpackb(today_encode(msg), raw=False)
        body[f"added_in_{version}"] = [version, "a field today's release skips"]
        packed: bytes = msgpack.packb(body, use_bin_type=True)
        return packed

    codec.encode = encode
    pccl.peer.driver.encode = encode  # (it imported the name)


if __name__ == "__main__":
    ahead = int(sys.argv[1])
    pretend(ahead)
    # argv[2:] is "python -m MODULE ARGS...": run MODULE here, with ARGS.
    assert sys.argv[3] == "-m", sys.argv
    module, args = sys.argv[4], sys.argv[5:]
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
