"""Blocking API with the names and call shapes of PCCL's Python bindings.

Code written against PCCL (``from pccl import *`` with PrimeIntellect's bindings) runs
on pccl by changing its import only::

    import pccl.blocking as pccl            # or: from pccl.blocking import *

    master = pccl.MasterNode(listen_address="0.0.0.0:48148")
    master.run()                            # returns at once; serves in the background

    comm = pccl.Communicator("127.0.0.1:48148", 0)
    comm.connect(n_attempts=15)
    if comm.are_peers_pending():
        comm.update_topology()
    info = comm.all_reduce(grads, grads, op=pccl.ReduceOp.SUM)
    ok, status, info = comm.all_reduce_async(grads, grads, op=pccl.ReduceOp.AVG).wait()

Every call blocks the calling thread until it is done; the work runs on the async
:mod:`pccl` objects (:class:`pccl.Communicator`, :class:`pccl.MasterNode`) driven by one
asyncio event loop on a daemon thread that this module owns. The loop starts with the
first object that needs it and stops when the last one is closed (``close()``,
``interrupt()``, a ``with`` block, or at interpreter exit). Waiting releases the GIL, and
tensor bytes move in the Rust extension's threads, so other Python threads keep running
while a reduce is in flight. Blocking calls must not be made from the loop's own thread
(e.g. from a callback running on it); they raise :class:`InvalidUsageError` there.

What maps exactly and what differs (``docs/blocking.md`` has the full table):

- Names, argument names, order and defaults follow PCCL's bindings: ``Communicator(address,
  peer_group=0, p2p_connection_pool_size=0)``, ``connect(n_attempts=5)`` (one attempt per
  second), ``all_reduce(send, recv, *, op, tag=0, operand_descriptor=None,
  quantization_options=None)``, ``all_reduce_async(...).wait() -> (is_success, status,
  ReduceInfo)``, ``all_reduce_multiple_with_retry(descriptors, *, max_in_flight=4) ->
  ReduceInfo``, ``sync_shared_state(shared_state, strategy=ENFORCE_POPULAR)``,
  ``MasterNode(listen_address).run() / .interrupt()``, ``ReduceInfo(local_world_size,
  tx_bytes, rx_bytes)``, ``SharedState(tensor_infos)`` with ``revision`` and
  ``push_revision()``, ``TensorInfo.from_numpy / from_torch / (name, data_ptr, *, numel,
  dtype, device_type, allow_content_inequality)``, the descriptor classes, ``Result``.
- ``ReduceOp``, ``QuantizationAlgorithm`` and ``SharedStateSyncStrategy`` are pccl's own
  enums (same member names and values as PCCL's; they are ``IntEnum``). ``DataType``,
  ``Attribute``, ``DeviceType``, ``DistributionHint`` and ``Result`` carry PCCL's names
  and C values (``DataType.FLOAT``/``DOUBLE``, ``Attribute.LOCAL_WORLD_SIZE``); pccl's
  async enums are accepted wherever these are.
- Errors are pccl's :class:`PCCLError` hierarchy; ``PCCLError`` here *is*
  :class:`pccl.PCCLError`, so ``except pccl.PCCLError`` catches what PCCL's binding
  raised. Each raised error has PCCL's ``result`` attribute (a :class:`Result`), e.g.
  :class:`PeerConnectionError` -> ``Result.RANK_CONNECTION_LOST``. Where PCCL raises a
  builtin type for a bad argument, the error is also that type:
  :class:`ArgumentValueError` (an ``InvalidArgumentError`` and a ``ValueError``) and
  :class:`ArgumentAssertionError` (an ``InvalidArgumentError`` and an
  ``AssertionError``). ``connect()`` raises :class:`MasterConnectionError` (an
  ``Exception``) after ``n_attempts`` failed attempts.
- Like PCCL, reduces need at least two peers in the group (``TooFewPeersError``), and
  ``optimize_topology()`` at least two in the run (``InvalidUsageError``); the async API
  accepts a world of one.
- Like PCCL, a collective that failed because a peer died leaves the run ready for a plain
  relaunch: the master rebuilds the ring from the peers left (PCCL drops dead peers the
  same way), and a retry runs on it. This layer never calls ``update_topology()`` behind
  the script's back (``auto_update_topology=`` is accepted and ignored);
  ``all_reduce_multiple_with_retry()`` and ``sync_shared_state()`` retry as
  :mod:`pccl.recovery` says, the one recovery policy of every pccl layer.
- A ``MasterNode`` that was ``run()`` and never ``interrupt()``-ed keeps the process
  alive at interpreter exit until it is interrupted (Ctrl-C / SIGTERM), as PCCL's master
  scripts expect (``master.run()`` is the last line of them).
- CUDA tensors: all-reduces take them (staged through pinned host memory, see
  :mod:`pccl.staging`; ``cuda.is_available()`` is torch's answer); shared state is still
  host memory only. Not mapped: ``DistributionHint`` (accepted, ignored),
  ``PCCLError.check`` and the ``to_c`` helpers (there is no C ABI), quantizing to
  anything but 8-bit wire types (UINT8, INT8, and pccl's FLOAT8_E4M3 / FLOAT8_E5M2).
  pccl-only keyword arguments (``secret``, ``timeout``, ``peer_timeout``, ...) pass
  through to the async objects.
"""

# The package, by job (re-exported here; import from pccl.blocking, not the modules):
#   compat        PCCL's enums, Result codes, result_of, the argument error types
#   descriptors   PCCL's descriptor / info classes and its checks of reduce arguments
#   runtime       the event-loop thread and its process hooks (atexit, fork, SIGTERM)
#   shared_state  TensorInfo, SharedState
#   communicator  Communicator, AsyncReduceHandle, the retry loops (policy: pccl.recovery)
#   master        MasterNode

from __future__ import annotations

from pccl import errors as _errors
from pccl.blocking.communicator import AsyncReduceHandle, Communicator
from pccl.blocking.compat import (
    ArgumentAssertionError,
    ArgumentValueError,
    Attribute,
    DataType,
    DeviceType,
    DistributionHint,
    Result,
    cuda,
)
from pccl.blocking.compat import result_of as result_of  # public, not in __all__
from pccl.blocking.descriptors import (
    QuantizationOptions,
    ReduceDescriptor,
    ReduceInfo,
    ReduceOpDescriptor,
    ReduceOperandDescriptor,
    SharedStateSyncInfo,
)
from pccl.blocking.master import MasterNode
from pccl.blocking.runtime import loop_thread_running as loop_thread_running  # ditto
from pccl.blocking.shared_state import SharedState, TensorInfo
from pccl.enums import QuantizationAlgorithm, ReduceOp, SharedStateSyncStrategy
from pccl.errors import *  # noqa: F403 (the error classes: pccl.errors.__all__, the one list)
from pccl.shared_state import SyncInfo as SyncInfo  # ditto
from pccl.shared_state import SyncProgress as SyncProgress  # ditto

__all__ = [
    # PCCL's names
    "AsyncReduceHandle",
    "Attribute",
    "Communicator",
    "DataType",
    "DeviceType",
    "DistributionHint",
    "MasterNode",
    "QuantizationAlgorithm",
    "QuantizationOptions",
    "ReduceDescriptor",
    "ReduceInfo",
    "ReduceOp",
    "ReduceOpDescriptor",
    "ReduceOperandDescriptor",
    "Result",
    "SharedState",
    "SharedStateSyncInfo",
    "SharedStateSyncStrategy",
    "TensorInfo",
    "cuda",
    # pccl's error classes (all PCCLError subclasses): PCCL's argument errors, and
    # every error of pccl.errors
    "ArgumentAssertionError",
    "ArgumentValueError",
    *(n for n in _errors.__all__ if n != "ErrorKind"),
]
