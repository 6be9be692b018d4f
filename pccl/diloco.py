"""DiLoCo over pccl: local training with infrequent, fault-tolerant outer steps.

Every peer trains its own copy of the model with its own inner optimizer. Every
``inner_steps`` (H) inner steps the peers take one *outer step* together:

1. each peer forms its pseudo-gradient ``Δ = global - local`` in float32 (for a bfloat16
   model, ``global`` is the float32 global parameters rounded to bfloat16, i.e. exactly
   what the round started from, so Δ is pure inner progress);
2. the pseudo-gradients are averaged with one ``all_reduce(op=AVG)`` (optionally
   quantized on the wire with :class:`pccl.QuantizationOptions`);
3. an outer optimizer moves the float32 global parameters: SGD with Nesterov momentum by
   default (``outer_lr=0.7``, ``outer_momentum=0.9``, DiLoCo's usual values)::

       m = μ·m + Δ̄;   d = Δ̄ + μ·m  (nesterov)  or  d = m;   global = global - lr·d

   every operation in float32, in that order (so results can be re-computed exactly);
4. every peer sets its local parameters to the new global parameters (rounded to the
   model's dtype) and the next round of inner steps begins.

The global parameters, the momentum buffers and a small ``diloco.meta`` tensor live in a
:class:`pccl.SharedState` that is synced (``ENFORCE_POPULAR``) at every outer step, so
the peers' global state stays bit-identical and a joiner catches up in one sync.

Example (one peer; every peer of the run runs the same code)::

    import pccl
    from pccl.diloco import DiLoCo

    async with pccl.Communicator(master="10.0.0.1:48148") as comm:
        model = make_model()
        inner = torch.optim.AdamW(model.parameters(), lr=3e-4)
        async with DiLoCo(model, inner, comm, inner_steps=500) as diloco:
            for x, y in batches:
                loss = await diloco.inner_step(lambda: loss_fn(model(x), y))

    # or run the inner optimizer yourself and tell DiLoCo after each inner step:
    #     loss.backward(); inner.step(); inner.zero_grad()
    #     info = await diloco.step()      # an OuterStepInfo every H calls, else None

API
---
- ``DiLoCo(model, inner_optimizer, comm, *, inner_steps=500, outer_lr=0.7,
  outer_momentum=0.9, nesterov=True, async_mode=False, quantization=None,
  compression=None, max_retries=8, tag=DEFAULT_TAG)``:
  ``compression=pccl.sparse.SparseLoCo(density, bits, chunk, beta)`` sends each
  pseudo-gradient sparse (top-k per chunk, ``bits``-bit codes) through a local
  error-feedback accumulator (see :mod:`pccl.sparse`; every peer must pass the same);
  ``model`` is an ``nn.Module`` (its ``named_parameters()``), a mapping name -> tensor, or
  a sequence of tensors (torch CPU / CUDA tensors or numpy arrays; float16, bfloat16,
  float32, float64). ``inner_optimizer`` may be None if you only call :meth:`step`.
  ``comm`` is a connected :class:`pccl.Communicator`; DiLoCo never closes it.
  ``tag`` and ``tag + 1`` are the all-reduce tags it uses.
- ``await start(strategy=None)``:
  the first sync, before any inner step (``async with`` calls it). A peer joining a
  running group syncs ``RECEIVE_ONLY`` and adopts the group's global parameters,
  momentum and outer-step count; when nobody offers state yet (the first peers of a
  run) every peer retries with ``ENFORCE_POPULAR``, so founders with the same seed
  start from their common initialisation (different seeds: the earliest joiner's).
- ``await step() -> OuterStepInfo | None``:
  call after each inner optimizer step; every H-th call takes the outer step.
- ``await inner_step(loss_fn) -> float``:
  ``zero_grad``, ``loss = loss_fn()``, ``backward``, ``inner_optimizer.step()`` in a
  worker thread, then :meth:`step`; returns the loss.
- ``await flush()``:
  async mode: wait for the reduce in flight and apply it now (collective: every peer
  calls it at the same point, e.g. right after the last outer step of a run).
- ``await close()``:
  cancel a reduce in flight (the others see it fail and retry without this peer).
- Properties: ``outer_step``, ``inner_step_count``, ``reduce_in_flight``,
  ``global_parameters`` / ``momentum_buffers`` (name -> float32 numpy views),
  ``shared_state``, ``last_info``.

Churn
-----
pccl collectives are all-or-nothing, so a failed reduce leaves the pseudo-gradient
untouched on every survivor. A failure is handled by the one recovery policy
(:func:`pccl.recovery.with_retry`): a lost peer is retried at once (the master rebuilt
the ring without it); a failure that needs a vote (the retry failed too, peers disagreed
about a topology vote) runs ``update_topology()`` (drops the dead, admits pending
joiners), re-syncs the shared state and retries; at most ``max_retries`` retries per
operation, then :class:`OuterStepFailedError`. Usage errors and a lost master are
raised at once. Between outer steps, joiners that ``are_peers_pending()`` reports are
admitted with ``update_topology()``.

A joiner's first sync tells it where the group stands (``diloco.meta`` holds the outer
step, what the group does after this sync, and the run's configuration, which must match
on every peer). Joining at an outer step it simply trains the next round. Joining while
the group retries a failed reduce (or, in async mode, while the group launches one), it
has no pseudo-gradient of its own: it takes part with zeros and weight 0, and the result
is rescaled by ``world / contributors`` so the update is the mean over the peers that
trained. (The contributor count comes from a tiny unquantized SUM all-reduce of the
weights, ``tag + 1``, run just before the pseudo-gradient reduce.)

``shared_state.revision`` advances by one per sync: one per outer step, plus one for each
re-sync after a failure; ``outer_step`` counts outer steps.

Async mode (``async_mode=True``, one-step delayed outer update)
---------------------------------------------------------------
The reduce of outer step t is started with ``all_reduce_async`` and runs while the inner
steps of round t+1 compute; it is awaited and applied at the end of round t+1. So the
update applied at the end of round t+1 uses the pseudo-gradient of round t (measured from
the global parameters round t started from), and round t+1's own progress is sent next.
The first outer step applies nothing. Two pseudo-gradient buffers alternate.

Why the reduce really overlaps: the bytes move on the Rust extension's tokio threads,
which never hold the GIL, so Python inner compute runs concurrently. The asyncio side
is only needed for the control messages (the master's go-ahead, the outcome vote),
which run whenever the event loop gets a turn:

- :meth:`inner_step` runs the inner step in ``asyncio.to_thread``: the event loop stays
  free the whole time (heartbeats, votes, other peers in the same process).
- :meth:`step` after your own synchronous inner step yields to the event loop once per
  call; while your code computes, the loop is blocked, so the reduce's control messages
  advance one hop per inner step while its bytes flow regardless. It still overlaps, but
  each inner step must stay well under the master's heartbeat timeout; prefer
  :meth:`inner_step` (or run your step in ``asyncio.to_thread`` and then call
  :meth:`step`).

Outer-step arithmetic on large buffers (pseudo-gradient, optimizer, copies into the
model) also runs in worker threads (numpy and torch release the GIL there).

CUDA: with parameters on a GPU the float32 buffers are allocated in pinned host memory;
pseudo-gradients and updates are staged through them. Module buffers (e.g. batch-norm
statistics) are not synchronized; only parameters are.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

try:
    import numpy as np
except ImportError as e:  # numpy is optional for pccl (torch-only programs), not here
    raise ModuleNotFoundError(
        'pccl.diloco needs numpy, which is not installed: pip install numpy '
        '(or "pccl[numpy]")', name="numpy") from e

from pccl import recovery, sparse
from pccl.communicator import Communicator, QuantizationOptions, ReduceInfo
from pccl.enums import DTYPES, ReduceOp, SharedStateSyncStrategy
from pccl.errors import (
    InvalidArgumentError,
    InvalidUsageError,
    NoSharedStateAvailableError,
    PCCLError,
    RevisionIncrementViolationError,
)
from pccl.shared_state import SharedState, SyncInfo, TensorInfo

__all__ = ["DEFAULT_TAG", "DiLoCo", "OuterStepFailedError", "OuterStepInfo"]

log = logging.getLogger(__name__)

#: All-reduce tags DiLoCo uses by default: ``DEFAULT_TAG`` (pseudo-gradients) and
#: ``DEFAULT_TAG + 1`` (contributor weights). Pick another ``tag`` if yours collide.
DEFAULT_TAG = 0xD1_10C0

# What a retry can fix (pccl.recovery, one policy for every layer). DiLoCo always
# votes before it retries: a joiner must be admitted by that vote to take part in the
# re-sync that follows, which tells it where the group stands.
T = TypeVar("T")


class _RetriedVote:
    """The vote a recovery makes (:class:`pccl.recovery.Voter`), itself retried under
    the policy."""

    def __init__(self, diloco: DiLoCo) -> None:
        self._diloco = diloco

    async def update_topology(self) -> None:
        await self._diloco._update_topology()

_RETRYABLE = recovery.RETRYABLE

# What the group does right after a sync, recorded in the shared state so that a peer
# joining at that sync knows where it lands.
_TRAIN = 0   # inner steps follow
_LAUNCH = 1  # async mode: the next reduce is started, then inner steps follow
_RETRY = 2   # a failed reduce is retried now, then the outer step completes
_RETRY_FLUSH = 3  # async mode: a failed reduce is retried now, then flush() completes

# diloco.meta layout (int64): the outer step, the phase above, then the configuration
# every peer must share (floats as their float64 bit patterns).
_META_STEP, _META_PHASE = 0, 1
_META_CONFIG = slice(2, 12)
_CONFIG_FIELDS = ("async_mode", "inner_steps", "nesterov", "outer_lr", "outer_momentum",
                  "tag", "compression.density", "compression.bits", "compression.chunk",
                  "compression.beta")

_BLOCK = 1 << 20  # elements per chunk of the outer update (bounds its scratch memory)


class OuterStepFailedError(PCCLError):
    """An outer step (or the first sync) kept failing after ``max_retries`` recoveries."""


@dataclasses.dataclass(frozen=True)
class OuterStepInfo:
    """What one outer step did on this peer."""

    outer_step: int  #: outer steps completed, this one included
    applied: bool  #: an update was applied (False: async mode's first step, or nobody trained)
    world_size: int  #: peers in the applied reduce (0 when none was applied)
    contributors: int  #: peers whose pseudo-gradients it averages
    retries: int  #: failed attempts recovered from (reduce, sync, update_topology)
    tx_bytes: int  #: bytes this peer sent for the applied reduce
    rx_bytes: int  #: bytes this peer received for the applied reduce
    sync_rx_bytes: int  #: shared-state bytes fetched (0 while parity holds)


# --- parameters ---------------------------------------------------------------------


class _Param:
    """One model parameter and its segment of the flat float32 buffers."""

    exact = True  # the model's dtype holds every float32 value: no rounding needed

    def __init__(self, name: str, tensor: Any, offset: int, count: int) -> None:
        self.name = name
        self.tensor = tensor
        self.sl = slice(offset, offset + count)
        self.count = count

    def read(self, out: np.ndarray) -> None:
        """``out`` (float32) := the local values."""
        raise NotImplementedError

    def write(self, src: np.ndarray) -> None:
        """Local values := ``src`` (float32) rounded to the model's dtype."""
        raise NotImplementedError

    def rounded(self, src: np.ndarray, out: np.ndarray) -> None:
        """``out`` := float32(``src`` rounded to the model's dtype)."""
        raise NotImplementedError


class _TorchParam(_Param):
    def __init__(self, name: str, tensor: Any, offset: int, count: int) -> None:
        super().__init__(name, tensor, offset, count)
        import torch

        self._torch = torch
        self.exact = tensor.dtype in (torch.float32, torch.float64)

    def read(self, out: np.ndarray) -> None:
        self._torch.from_numpy(out).copy_(self.tensor.detach().reshape(-1))

    def write(self, src: np.ndarray) -> None:
        with self._torch.no_grad():
            self.tensor.copy_(self._torch.from_numpy(src).view(self.tensor.shape))

    def rounded(self, src: np.ndarray, out: np.ndarray) -> None:
        t = self._torch
        t.from_numpy(out).copy_(t.from_numpy(src).to(self.tensor.dtype))


class _NumpyParam(_Param):
    def __init__(self, name: str, array: np.ndarray, offset: int, count: int) -> None:
        super().__init__(name, array, offset, count)
        self.exact = array.dtype in (np.float32, np.float64)

    def read(self, out: np.ndarray) -> None:
        np.copyto(out, self.tensor.reshape(-1), casting="unsafe")

    def write(self, src: np.ndarray) -> None:
        self.tensor[...] = src.reshape(self.tensor.shape)

    def rounded(self, src: np.ndarray, out: np.ndarray) -> None:
        np.copyto(out, src.astype(self.tensor.dtype), casting="unsafe")


_FLOAT_NAMES = frozenset(i.numpy for i in DTYPES.values() if i.is_float and i.numpy)


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] == "torch"


def _named_tensors(model: Any) -> list[tuple[str, Any]]:
    if hasattr(model, "named_parameters"):
        return list(model.named_parameters())
    if isinstance(model, Mapping):
        return [(str(k), v) for k, v in model.items()]
    if isinstance(model, Sequence):
        return [(str(i), v) for i, v in enumerate(model)]
    raise InvalidArgumentError(
        f"model must be an nn.Module, a mapping name -> tensor or a sequence of tensors, "
        f"not {type(model).__name__}")


def _buffer(n: int, pinned: bool) -> tuple[np.ndarray, Any]:
    """A zeroed float32 buffer (numpy view, plus the torch tensor owning pinned memory)."""
    if pinned:
        import torch

        t = torch.zeros(n, dtype=torch.float32, pin_memory=True)
        return t.numpy(), t
    return np.zeros(n, dtype=np.float32), None


def _bits(x: float) -> int:
    return int(np.array([x], dtype=np.float64).view(np.int64)[0])


# --- reduces ------------------------------------------------------------------------


@dataclasses.dataclass
class _Reduce:
    """One pseudo-gradient reduce: its buffer, this peer's weight, and the running task."""

    buf: np.ndarray
    weight: float
    weight_buf: np.ndarray
    task: asyncio.Task[tuple[ReduceInfo, ReduceInfo]] | None = None
    infos: tuple[ReduceInfo, ReduceInfo] | None = None  # (weights, pseudo-gradient)


class DiLoCo:
    """DiLoCo (optionally one-step-delayed) over a :class:`pccl.Communicator`.

    See the module docstring for the algorithm, churn handling and async mode.

    Example::

        diloco = DiLoCo(model, torch.optim.AdamW(model.parameters()), comm, inner_steps=100)
        await diloco.start()
        for x, y in batches:
            await diloco.inner_step(lambda: F.cross_entropy(model(x), y))
        await diloco.close()
    """

    def __init__(
        self,
        model: Any,
        inner_optimizer: Any,
        comm: Communicator,
        *,
        inner_steps: int = 500,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        async_mode: bool = False,
        quantization: QuantizationOptions | None = None,
        compression: sparse.SparseLoCo | None = None,
        max_retries: int = 8,
        tag: int = DEFAULT_TAG,
    ) -> None:
        if not isinstance(inner_steps, int) or inner_steps < 1:
            raise InvalidArgumentError("inner_steps must be a positive integer")
        if not outer_lr > 0:
            raise InvalidArgumentError("outer_lr must be positive")
        if not 0 <= outer_momentum < 1:
            raise InvalidArgumentError("outer_momentum must be in [0, 1)")
        if nesterov and outer_momentum == 0:
            nesterov = False  # Nesterov without momentum is plain SGD
        if max_retries < 0:
            raise InvalidArgumentError("max_retries must be >= 0")
        if not isinstance(tag, int) or tag < 0:
            raise InvalidArgumentError("tag must be a non-negative integer")
        if compression is not None and not isinstance(compression, sparse.SparseLoCo):
            raise InvalidArgumentError(
                f"compression must be a pccl.sparse.SparseLoCo, got {type(compression).__name__}")
        if compression is not None and quantization is not None:
            raise InvalidArgumentError("pass quantization or compression, not both")
        self.compression = compression
        self.inner_optimizer = inner_optimizer
        self.comm = comm
        self.inner_steps = inner_steps
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.nesterov = bool(nesterov)
        self.async_mode = bool(async_mode)
        self.quantization = quantization
        self.max_retries = max_retries
        self.tag = tag

        named = _named_tensors(model)
        if not named:
            raise InvalidArgumentError("the model has no parameters")
        self._params: list[_Param] = []
        offset, cuda = 0, False
        for name, t in named:
            is_torch = _is_torch(t)
            dtype = str(t.dtype).removeprefix("torch.") if is_torch else np.dtype(t.dtype).name
            if dtype not in _FLOAT_NAMES:
                raise InvalidArgumentError(
                    f"parameter {name!r} has dtype {dtype}; DiLoCo trains float parameters")
            if is_torch:
                cuda = cuda or t.device.type == "cuda"
                if t.device.type not in ("cpu", "cuda"):
                    raise InvalidArgumentError(
                        f"parameter {name!r} is on {t.device}; use CPU or CUDA tensors")
                count = t.numel()
                self._params.append(_TorchParam(name, t, offset, count))
            elif isinstance(t, np.ndarray):
                if not t.flags.writeable:
                    raise InvalidArgumentError(f"parameter {name!r} is read-only")
                count = t.size
                self._params.append(_NumpyParam(name, t, offset, count))
            else:
                raise InvalidArgumentError(
                    f"parameter {name!r} is a {type(t).__name__}; pass torch tensors or "
                    "numpy arrays")
            offset += count
        self.num_elements = offset
        self._keep: list[Any] = []  # torch tensors owning pinned buffers
        self._master = self._alloc(cuda)
        self._momentum = self._alloc(cuda) if self.outer_momentum else None
        # Async mode alternates two pseudo-gradient buffers: one in flight, one forming.
        self._pg = [self._alloc(cuda) for _ in range(2 if self.async_mode else 1)]
        self._pg_next = 0
        # SparseLoCo's error-feedback accumulator: local to this peer (not shared state;
        # a joiner starts at zero, owing nothing), and the scratch of one attempt.
        self._feedback = self._alloc(cuda) if compression is not None else None
        self._feedback_work = self._alloc(cuda) if compression is not None else None
        #: SparseLoCo: seconds this peer spent encoding its payloads and decoding the
        #: group's, over every outer step so far (the codec's CPU cost).
        self.codec_seconds = 0.0
        self._meta = np.zeros(12, dtype=np.int64)
        self._meta[_META_CONFIG] = self._config()
        infos = [TensorInfo("diloco.meta", self._meta)]
        infos += [TensorInfo(f"diloco.params.{p.name}", self._master[p.sl])
                  for p in self._params]
        if self._momentum is not None:
            infos += [TensorInfo(f"diloco.momentum.{p.name}", self._momentum[p.sl])
                      for p in self._params]
        self._state = SharedState(infos, revision=0)
        self._synced_revision: int | None = None
        self._started = False
        self._trained = False  # this peer trained the round its next pseudo-gradient covers
        self._local_step = 0
        self._inner_step_count = 0
        self._pending: _Reduce | None = None
        self._retries = 0
        self.last_info: OuterStepInfo | None = None

    def _alloc(self, pinned: bool) -> np.ndarray:
        arr, owner = _buffer(self.num_elements, pinned)
        if owner is not None:
            self._keep.append(owner)
        return arr

    def _config(self) -> list[int]:
        c = self.compression
        compression = [0, 0, 0, 0] if c is None else [
            _bits(c.density), c.bits, c.chunk, _bits(c.beta)]
        return [int(self.async_mode), self.inner_steps, int(self.nesterov),
                _bits(self.outer_lr), _bits(self.outer_momentum), self.tag, *compression]

    # --- public state -----------------------------------------------------------------

    @property
    def outer_step(self) -> int:
        """Outer steps the group has completed (shared by every peer)."""
        return int(self._meta[_META_STEP])

    @property
    def inner_step_count(self) -> int:
        """Inner steps this peer has reported since :meth:`start`."""
        return self._inner_step_count

    @property
    def reduce_in_flight(self) -> bool:
        """Async mode: a pseudo-gradient reduce is running in the background."""
        return self._pending is not None and self._pending.task is not None \
            and not self._pending.task.done()

    @property
    def global_parameters(self) -> dict[str, np.ndarray]:
        """The float32 global parameters (views; do not modify)."""
        return {p.name: self._master[p.sl] for p in self._params}

    @property
    def momentum_buffers(self) -> dict[str, np.ndarray]:
        """The outer optimizer's float32 momentum buffers (views; empty without momentum)."""
        if self._momentum is None:
            return {}
        return {p.name: self._momentum[p.sl] for p in self._params}

    @property
    def feedback_accumulator(self) -> np.ndarray | None:
        """SparseLoCo: what this peer owes the group (its error-feedback accumulator, a
        float32 view; local, not shared: a joiner's starts at zero). None without
        compression."""
        return self._feedback

    @property
    def shared_state(self) -> SharedState:
        """The synced state: ``diloco.meta``, ``diloco.params.*``, ``diloco.momentum.*``."""
        return self._state

    # --- lifecycle --------------------------------------------------------------------

    async def start(self, strategy: SharedStateSyncStrategy | None = None) -> SyncInfo:
        """First sync; call once before the first inner step (collective). Returns the
        :class:`pccl.SyncInfo` of the sync that brought this peer in (what it fetched).

        ``strategy=None`` joins as described in the module docstring (``RECEIVE_ONLY``,
        falling back to ``ENFORCE_POPULAR`` when nobody offers state yet).
        """
        if self._started:
            raise InvalidUsageError("start() was already called on this DiLoCo")
        await asyncio.to_thread(self._read_local_into_master)
        self._meta[_META_STEP] = 0
        try:
            if strategy is None:
                try:
                    info = await self._sync(_TRAIN, SharedStateSyncStrategy.RECEIVE_ONLY)
                    log.info("peer %s: DiLoCo joined the run at outer step %d",
                             self.comm.peer_id, self.outer_step)
                except NoSharedStateAvailableError:
                    # Everybody is fresh: the first peers of a run agree on a common start.
                    info = await self._sync(_TRAIN, SharedStateSyncStrategy.ENFORCE_POPULAR)
            else:
                info = await self._sync(_TRAIN, SharedStateSyncStrategy(strategy))
        except RevisionIncrementViolationError as e:
            raise InvalidUsageError(
                f"this communicator synced shared state before ({e}); the master checks "
                "revisions per peer, so DiLoCo needs a communicator whose shared-state "
                "syncs are all its own: use a fresh Communicator for it") from e
        self._started = True
        phase = int(self._meta[_META_PHASE])
        await asyncio.to_thread(self._write_local)
        self._local_step = 0
        if phase == _TRAIN:
            self._trained = True
        elif phase == _LAUNCH:
            # The group starts the reduce of the round we missed: join it with weight 0.
            self._pending = self._launch(await self._zero_reduce())
            self._trained = True
        else:
            # The group is retrying a reduce: join it with weight 0, then finish the outer
            # step (or the flush) with everyone. Our own next pseudo-gradient covers no
            # training either.
            self._trained = False
            if self.async_mode:
                self._pending = await self._zero_reduce()
            if phase == _RETRY_FLUSH:
                await self._flush()
            else:
                await self._outer_step()
        return info

    async def step(self) -> OuterStepInfo | None:
        """Reports one inner step; every ``inner_steps``-th call takes the outer step."""
        self._require_started()
        self._local_step += 1
        self._inner_step_count += 1
        if self._local_step < self.inner_steps:
            # A turn for the event loop, so a reduce in flight gets its control messages
            # through even if the caller's inner steps block the loop.
            await asyncio.sleep(0)
            return None
        return await self._outer_step()

    async def inner_step(self, loss_fn: Callable[[], Any]) -> float:
        """One inner step in a worker thread (``zero_grad``, ``loss_fn()``, ``backward``,
        ``inner_optimizer.step()``), then :meth:`step`. Returns the loss."""
        self._require_started()
        if self.inner_optimizer is None:
            raise InvalidUsageError("inner_step() needs an inner_optimizer; or call step() "
                                    "after your own inner step")
        loss = await asyncio.to_thread(self._run_inner_step, loss_fn)
        await self.step()
        return loss

    async def flush(self) -> OuterStepInfo | None:
        """Async mode: waits for the reduce in flight, applies it and syncs; local
        parameters become the new global ones. Collective. No-op in sync mode."""
        self._require_started()
        if self._pending is None:
            return None
        return await self._flush()

    async def _flush(self) -> OuterStepInfo:
        retries_before = self._retries
        pending, self._pending = self._pending, None
        assert pending is not None
        applied, world, contributors, tx, rx = await self._complete(pending, _RETRY_FLUSH)
        sync = await self._sync(_TRAIN)
        await asyncio.to_thread(self._write_local)
        self._local_step = 0
        self._trained = True
        self.last_info = OuterStepInfo(self.outer_step, applied, world, contributors,
                                       self._retries - retries_before, tx, rx, sync.rx_bytes)
        return self.last_info

    async def close(self) -> None:
        """Cancels a reduce in flight (the communicator stays open). Idempotent."""
        pending, self._pending = self._pending, None
        if pending is not None and pending.task is not None:
            pending.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, PCCLError):
                await pending.task

    async def __aenter__(self) -> DiLoCo:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- the outer step ---------------------------------------------------------------

    async def _outer_step(self) -> OuterStepInfo:
        retries_before = self._retries
        applied, world, contributors, tx, rx = False, 0, 0, 0, 0
        if not self.async_mode:
            current = self._form_reduce()
            await asyncio.to_thread(self._form_pseudo_gradient, current)
            applied, world, contributors, tx, rx = await self._complete(current, _RETRY)
            nxt = None
        else:
            pending, self._pending = self._pending, None
            if pending is not None:
                await self._finish(pending, _RETRY)
            # Measured from the global parameters this round started from, so formed
            # before the delayed update moves them.
            nxt = self._form_reduce()
            await asyncio.to_thread(self._form_pseudo_gradient, nxt)
            if pending is not None:
                applied, world, contributors, tx, rx = await self._apply(pending)
        self._meta[_META_STEP] += 1
        if await self.comm.are_peers_pending():
            log.info("peer %s: admitting pending peers after outer step %d",
                     self.comm.peer_id, self.outer_step)
            await self._update_topology()
        sync = await self._sync(_LAUNCH if self.async_mode else _TRAIN)
        await asyncio.to_thread(self._write_local)
        self._local_step = 0
        self._trained = True
        if nxt is not None:
            self._pending = self._launch(nxt)
        self.last_info = OuterStepInfo(self.outer_step, applied, world, contributors,
                                       self._retries - retries_before, tx, rx, sync.rx_bytes)
        log.debug("peer %s: %s", self.comm.peer_id, self.last_info)
        return self.last_info

    def _form_reduce(self) -> _Reduce:
        buf = self._pg[self._pg_next]
        self._pg_next = (self._pg_next + 1) % len(self._pg)
        return _Reduce(buf, 1.0 if self._trained else 0.0, np.zeros(1, dtype=np.float32))

    async def _zero_reduce(self) -> _Reduce:
        """A weight-0 reduce of zeros, for a joiner that trained none of its round."""
        r = self._form_reduce()
        r.weight = 0.0
        await asyncio.to_thread(r.buf.fill, 0.0)
        return r

    def _launch(self, r: _Reduce) -> _Reduce:
        r.weight_buf[0] = r.weight  # reset: a failed attempt may have left a partial result
        r.task = asyncio.create_task(self._reduce(r), name=f"diloco-reduce-{self.comm.peer_id}")
        return r

    async def _reduce(self, r: _Reduce) -> tuple[ReduceInfo, ReduceInfo]:
        # The weights first: if the pseudo-gradient reduce fails, its buffer is untouched
        # and both are simply run again. (The other order could leave an averaged buffer
        # behind a failed weight reduce.)
        if self.compression is not None:
            return await self._sparse_reduce(r)
        w = await self.comm.all_reduce(r.weight_buf, op=ReduceOp.SUM, tag=self.tag + 1)
        g = await self.comm.all_reduce(r.buf, op=ReduceOp.AVG, tag=self.tag,
                                       quantization=self.quantization)
        return w, g

    async def _sparse_reduce(self, r: _Reduce) -> tuple[ReduceInfo, ReduceInfo]:
        """SparseLoCo: ``work = beta * acc + delta``; the group sums what each peer's
        codec keeps of its ``work``; ``r.buf`` := that sum / world (the mean, as the
        dense reduce's AVG). Each peer's weight rides with its payload (no collective of
        its own: one round of latency less per outer step), summed in slot order into
        ``r.weight_buf``. Only a success moves the accumulator (to ``work``'s
        residual): a failed attempt leaves ``acc`` and ``r.buf`` as they were, so a
        retry starts over from them."""
        c, acc, work = self.compression, self._feedback, self._feedback_work
        assert c is not None and acc is not None and work is not None

        def form() -> None:
            np.multiply(acc, np.float32(c.beta), out=work)
            np.add(work, r.buf, out=work)

        await asyncio.to_thread(form)
        total = np.empty_like(r.buf)
        # (`work` is scratch, formed again from `acc` for a retry: no backup needed.)
        info = await sparse.all_reduce(self.comm, c, work, total, tag=self.tag,
                                       meta=np.float32(r.weight).tobytes(), restore=False)
        self._feedback, self._feedback_work = work, acc
        self.codec_seconds += info.compress_seconds + info.decode_seconds
        weight = np.float32(0.0)
        for m in info.metas:  # slot order: the same sum on every peer
            weight += np.frombuffer(m, np.float32)[0]
        r.weight_buf[0] = weight
        await asyncio.to_thread(np.divide, total, np.float32(info.world_size), out=r.buf)
        g = ReduceInfo(tx_bytes=info.tx_bytes, rx_bytes=info.rx_bytes,
                       world_size=info.world_size, algorithm="sparse")
        return ReduceInfo(tx_bytes=0, rx_bytes=0, world_size=info.world_size,
                          algorithm="sparse"), g

    async def _finish(self, r: _Reduce, retry_phase: int) -> tuple[ReduceInfo, ReduceInfo]:
        """Awaits ``r`` (launching it if needed); on a failure a retry may fix, does what
        the recovery policy says and runs it again: at once after a lost peer (the
        master rebuilt the ring), else after a vote and a re-sync (which tells joiners
        ``retry_phase``: what follows the reduce)."""

        async def attempt() -> tuple[ReduceInfo, ReduceInfo]:
            if r.task is None:
                self._launch(r)
            assert r.task is not None
            try:
                r.infos = await r.task
            finally:
                if r.infos is None:
                    r.task = None
            return r.infos

        async def after_vote(action: recovery.Action) -> None:
            if action is recovery.Action.UPDATE_TOPOLOGY:
                await self._sync(retry_phase)

        r.infos = None
        return await self._recovering(
            attempt, f"outer step {self.outer_step + 1}: the pseudo-gradient all-reduce",
            before_retry=after_vote, vote=True)

    async def _recovering(self, call: Callable[[], Awaitable[T]], what: str, *,
                          vote: bool,
                          before_retry: Callable[[recovery.Action], Awaitable[None]]
                          | None = None) -> T:
        """``call()`` under the one recovery policy (:func:`pccl.recovery.with_retry`),
        at most ``max_retries`` retries; giving up after them is
        :class:`OuterStepFailedError`. ``vote``: a vote the policy asks for is made
        here (False: ``call`` is the vote)."""

        def count(e: BaseException, failures: int) -> None:
            self._retries += 1

        try:
            return await recovery.with_retry(
                call, _RetriedVote(self) if vote else None, attempts=self.max_retries + 1,
                what=f"peer {self.comm.peer_id}: {what}", before_retry=before_retry,
                on_failure=count)
        except _RETRYABLE as e:
            if not recovery.retryable(e):
                raise
            # The message only: a logged exception keeps its traceback (and the failed
            # ring's sockets) alive for as long as a handler holds the record.
            raise OuterStepFailedError(
                f"{what} failed {self.max_retries + 1} times (last: {type(e).__name__}: "
                f"{e}); giving up after max_retries={self.max_retries}") from e

    async def _complete(self, r: _Reduce, retry_phase: int) -> tuple[bool, int, int, int, int]:
        await self._finish(r, retry_phase)
        return await self._apply(r)

    async def _apply(self, r: _Reduce) -> tuple[bool, int, int, int, int]:
        assert r.infos is not None
        w, g = r.infos
        world = g.world_size
        contributors = int(round(float(r.weight_buf[0])))
        tx, rx = w.tx_bytes + g.tx_bytes, w.rx_bytes + g.rx_bytes
        if contributors == 0:
            return False, world, 0, tx, rx
        scale = world / contributors if contributors != world else None
        await asyncio.to_thread(self._outer_update, r.buf, scale)
        return True, world, contributors, tx, rx

    # --- collectives with recovery ----------------------------------------------------

    async def _update_topology(self) -> None:
        await self._recovering(self.comm.update_topology, "update_topology()", vote=False)

    async def _sync(self, phase: int, strategy: SharedStateSyncStrategy =
                    SharedStateSyncStrategy.ENFORCE_POPULAR) -> SyncInfo:
        async def attempt() -> SyncInfo:
            self._meta[_META_PHASE] = phase
            self._meta[_META_CONFIG] = self._config()
            if self._synced_revision is not None:
                self._state.revision = self._synced_revision + 1
            return await self.comm.sync_shared_state(self._state, strategy)

        info = await self._recovering(attempt, "sync_shared_state()", vote=True)
        self._synced_revision = self._state.revision
        theirs = [int(x) for x in self._meta[_META_CONFIG]]
        if theirs != self._config():
            differ = [f for f, a, b in zip(_CONFIG_FIELDS, theirs, self._config()) if a != b]
            raise InvalidUsageError(
                f"this peer's DiLoCo configuration differs from the group's in {differ}; "
                "every peer must use the same inner_steps, async_mode and outer optimizer")
        return info

    # --- arithmetic (run in worker threads) -------------------------------------------

    def _read_local_into_master(self) -> None:
        for p in self._params:
            p.read(self._master[p.sl])

    def _write_local(self) -> None:
        for p in self._params:
            p.write(self._master[p.sl])
        if any(isinstance(p, _TorchParam) and p.tensor.device.type == "cuda"
               for p in self._params):
            import torch

            torch.cuda.synchronize()

    def _form_pseudo_gradient(self, r: _Reduce) -> None:
        """``r.buf`` := float32(global rounded to the model dtype) - float32(local)."""
        if r.weight == 0.0:
            r.buf.fill(0.0)  # nothing trained: contribute nothing
            return
        for p in self._params:
            out = r.buf[p.sl]
            p.read(out)
            start = self._master[p.sl]
            if not p.exact:
                rounded = np.empty_like(start)
                p.rounded(start, rounded)
                start = rounded
            np.subtract(start, out, out=out)

    def _outer_update(self, g: np.ndarray, scale: float | None) -> None:
        lr = np.float32(self.outer_lr)
        mu = np.float32(self.outer_momentum)
        theta, m = self._master, self._momentum
        tmp = np.empty(min(_BLOCK, g.size), dtype=np.float32)
        for lo in range(0, g.size, _BLOCK):
            sl = slice(lo, min(lo + _BLOCK, g.size))
            gg, t = g[sl], tmp[: sl.stop - lo]
            if scale is not None:
                np.multiply(gg, np.float32(scale), out=gg)
            if m is None:
                d = gg
            else:
                mm = m[sl]
                np.multiply(mm, mu, out=mm)  # m = mu*m + g
                np.add(mm, gg, out=mm)
                if self.nesterov:
                    np.multiply(mm, mu, out=t)  # d = g + mu*m
                    np.add(gg, t, out=t)
                    d = t
                else:
                    d = mm
            np.multiply(d, lr, out=t)  # global = global - lr*d
            np.subtract(theta[sl], t, out=theta[sl])

    def _run_inner_step(self, loss_fn: Callable[[], Any]) -> float:
        opt = self.inner_optimizer
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
        return float(loss.detach())

    def _require_started(self) -> None:
        if not self._started:
            raise InvalidUsageError("call `await diloco.start()` (or use `async with`) "
                                    "before the first inner step")
