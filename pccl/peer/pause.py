"""Telling a pause of this process from a lost master.

A process that does not run (SIGSTOP, a laptop's sleep, heavy swapping, an event loop
held by a long synchronous call) answers no heartbeat: the master drops it after its
heartbeat timeout, and on waking the peer finds its connection gone or silent. Both look
like a lost master from inside the read loop; the log then blamed the master for what
happened here. The driver ticks a :class:`PauseWatch` on a fixed interval: a tick that
ran much later than due, or one overdue right now, means this process did not run
meanwhile, and the driver says so instead.
"""

from __future__ import annotations

import dataclasses
import math
import time

__all__ = ["PauseWatch", "awake_clock", "describe"]

_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)


def awake_clock() -> float:
    """Seconds on a clock that also counts while the machine sleeps (``CLOCK_BOOTTIME``
    on Linux; elsewhere :func:`time.monotonic`, which counts a stopped process but, on
    some systems, not a suspend)."""
    if _BOOTTIME is not None:
        return time.clock_gettime(_BOOTTIME)
    return time.monotonic()


@dataclasses.dataclass
class PauseWatch:
    """How long this process last went without running, from ticks due every
    ``interval`` seconds (sans-IO: the caller passes the clock's readings).

    Example::

        w = PauseWatch(interval=0.5, last=100.0)
        w.tick(100.5)                               # on time
        w.tick(109.0)                               # 8 s late: a pause
        assert w.paused_for(109.1, within=5.0) == 8.0
        assert w.paused_for(120.0, within=5.0) == 0.0  # long over
    """

    interval: float
    last: float  # when the last tick ran
    pause: float = 0.0  # the last pause seen (a tick more than an interval late), seconds
    ended: float = -math.inf  # when it ended

    def tick(self, now: float) -> None:
        late = now - self.last - self.interval
        if late > self.interval:
            self.pause, self.ended = late, now
        self.last = now

    def paused_for(self, now: float, within: float) -> float:
        """Seconds this process did not run in a pause that ended at most ``within``
        seconds before ``now``, or that goes on at ``now`` (no tick since it began:
        the caller is the first to run after it); 0.0 when none."""
        going_on = now - self.last - self.interval
        recent = self.pause if now - self.ended <= within else 0.0
        return max(recent, going_on if going_on > self.interval else 0.0)


def describe(paused: float, heartbeat_timeout: float) -> str:
    """What a peer that lost its master connection after a pause of ``paused`` seconds
    should say (the master drops a peer silent for ``heartbeat_timeout`` seconds)."""
    what = (f"longer than the master's heartbeat timeout ({heartbeat_timeout:g}s): the "
            "master dropped it" if paused >= heartbeat_timeout else
            f"close to the master's heartbeat timeout ({heartbeat_timeout:g}s): its "
            "connection to the master did not survive that")
    return (f"this process was paused for {paused:.1f}s (SIGSTOP, laptop sleep, swap, or "
            f"an event loop blocked by a long call), {what}")
