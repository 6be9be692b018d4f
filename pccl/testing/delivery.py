"""Holding back one control-plane message on its way to a communicator."""

from __future__ import annotations

import asyncio
from typing import Any

from pccl.protocol import messages as m


class HeldMessage:
    """Keeps the first message of type ``kind`` that the master sends ``comm`` from
    reaching it, until :meth:`release`; everything else goes through. For tests of
    races such as "the caller cancels while the group's outcome is on its way"::

        held = HeldMessage(comm, pccl.protocol.messages.SyncOutcome)
        task = asyncio.create_task(comm.sync_shared_state(state))
        await held.arrived.wait()
        task.cancel()
        held.release()
    """

    def __init__(self, comm: Any, kind: type[m.Message]) -> None:
        self.kind = kind
        self.message: m.Message | None = None
        self.arrived = asyncio.Event()
        self._comm = comm
        self._deliver = comm._dispatch
        comm._dispatch = self._intercept

    def _intercept(self, msg: m.Message) -> None:
        if isinstance(msg, self.kind) and self.message is None:
            self.message = msg
            self.arrived.set()
        else:
            self._deliver(msg)

    def release(self) -> None:
        """Delivers the held message now and stops intercepting."""
        self._comm._dispatch = self._deliver
        if self.message is not None:
            self._deliver(self.message)
