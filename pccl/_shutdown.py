"""Interpreter exit versus the Rust runtime's threads.

When an awaited pccl operation finishes, a tokio thread hands the result to the event
loop (``loop.call_soon_threadsafe``), which writes to the loop's self-pipe with the GIL
released. The awaiting coroutine may resume, and the program end, before that thread
takes the GIL back. If CPython (3.11-3.13) is finalizing by then, it ends the thread with
``pthread_exit``; the forced unwind cannot cross the Rust frames and the whole process
aborts: SIGABRT, exit status 134 instead of 0, with nothing printed. (Seen in about 3% of
peer processes exiting right after ``await comm.close()``.)

``atexit`` hooks run before finalization starts, so the hook below tells the Rust side
that Python is leaving (``pccl._core.leave_python``). Every attach of a runtime thread
(handing an operation's outcome to its asyncio future, forwarding a log record, building
a result object) goes through one gate on the Rust side; the call closes it, and
returns once no runtime thread is attached any more (waiting at most 2 s, with the GIL
released so that such a thread can finish). From then on operations that finish never
hand their outcome over, and no runtime thread enters Python again.

Python's own threads are the other half. A daemon thread inside a pccl call that
releases the GIL (``content_hash``, ``copy_into``, a ring op's commit, ...) as the
program ends would take the GIL back while CPython finalizes, and be ended by
``pthread_exit`` through the call's Rust frames: SIGSEGV. Such calls count the threads on
their way back into Python; the hook also waits (same 2 s) until none is, and a thread
other than the one that finalizes that finishes such a call afterwards never returns
from it: it stays parked until the process ends (CPython 3.14 hangs such threads
instead of ending them, too).

History: first only a wait for runtime threads already in Python; then the flag, which
a thread could still pass just before it was set (a peer process of the churn tests
died of SIGSEGV at exit in a runtime thread, the main thread finalizing). pccl's own
asyncio bridge replaced pyo3-async-runtimes' ``future_into_py``, whose hand-off for an
asyncio future cancelled in the program's last moments attached without any check.
Then the daemon threads (issue 36): every such program crashed before.

So pccl calls made from ``atexit`` hooks that run after this one (registered before
``import pccl``) never finish: close communicators in hooks registered after importing
pccl, or before the program ends. (Blocking calls made by the finalizing thread itself
still return; one made by another thread then does not, so such a hook must not wait
for a thread that is inside pccl without a timeout.)
"""

from __future__ import annotations

import atexit
import sys


@atexit.register
def _let_runtime_threads_leave_python() -> None:
    if "pccl._core" in sys.modules:
        sys.modules["pccl._core"].leave_python()
