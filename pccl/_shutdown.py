"""Interpreter exit versus the Rust runtime's threads.

When an awaited pccl operation finishes, a tokio thread hands the result to the event
loop (``loop.call_soon_threadsafe``), which writes to the loop's self-pipe with the GIL
released. The awaiting coroutine may resume, and the program end, before that thread
takes the GIL back. If CPython (3.11-3.13) is finalizing by then, it ends the thread with
``pthread_exit``; the forced unwind cannot cross the Rust frames and the whole process
aborts: SIGABRT, exit status 134 instead of 0, with nothing printed. (Seen in about 3% of
peer processes exiting right after ``await comm.close()``.)

``atexit`` hooks run before finalization starts, so the hook below waits, bounded, until
no thread that Python did not start is executing Python code, releasing the GIL while it
waits; such a thread then finishes its hand-off and leaves Python for good.
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
    deadline = time.monotonic() + _MAX_WAIT_S
    while _foreign_thread_in_python() and time.monotonic() < deadline:
        time.sleep(0.001)  # releases the GIL to the thread that needs it
