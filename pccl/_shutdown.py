"""Interpreter exit versus the Rust runtime's threads.

When an awaited pccl operation finishes, a tokio thread hands the result to the event
loop (``loop.call_soon_threadsafe``), which writes to the loop's self-pipe with the GIL
released. The awaiting coroutine may resume, and the program end, before that thread
takes the GIL back. If CPython (3.11-3.13) is finalizing by then, it ends the thread with
``pthread_exit``; the forced unwind cannot cross the Rust frames and the whole process
aborts: SIGABRT, exit status 134 instead of 0, with nothing printed. (Seen in about 3% of
peer processes exiting right after ``await comm.close()``.)

``atexit`` hooks run before finalization starts, so the hook below first tells the Rust
side that Python is leaving (``pccl._core.leave_python``: operations that finish from
then on never hand their result over, and runtime threads no longer attach), then waits,
bounded, until no thread that Python did not start is executing Python code, releasing
the GIL while it waits; such a thread then finishes its hand-off and leaves Python for
good. A peer process of the churn tests once died of SIGSEGV at exit in a runtime thread
(the main thread had no Python frame left: finalizing) with only the wait in place.

So pccl calls made from ``atexit`` hooks that run after this one (registered before
``import pccl``) never finish: close communicators in hooks registered after importing
pccl, or before the program ends.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time

_MAX_WAIT_S = 2.0


def _foreign_thread_in_python() -> bool:
    own = {t.ident for t in threading.enumerate() if not isinstance(t, threading._DummyThread)}
    return any(ident not in own for ident in sys._current_frames())


@atexit.register
def _let_runtime_threads_leave_python() -> None:
    # No new hand-off from here on (pccl._core.leave_python), then wait for the ones
    # already under way. (A hand-off that pyo3-async-runtimes makes for an asyncio
    # future cancelled during the program's last moments is not covered by the first.)
    if "pccl._core" in sys.modules:
        sys.modules["pccl._core"].leave_python()
    deadline = time.monotonic() + _MAX_WAIT_S
    while _foreign_thread_in_python() and time.monotonic() < deadline:
        time.sleep(0.001)  # releases the GIL to the thread that needs it
