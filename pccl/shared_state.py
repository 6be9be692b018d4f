"""Shared state: named tensors that every peer of a group must hold bit for bit.

Example::

    state = pccl.SharedState([
        pccl.TensorInfo.from_numpy(weights, "weights"),
        pccl.TensorInfo.from_numpy(momentum, "momentum"),
    ], revision=0)
    ...
    state.revision += 1
    info = await comm.sync_shared_state(state)   # ENFORCE_POPULAR by default
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pccl.errors import InvalidArgumentError


@dataclasses.dataclass
class TensorInfo:
    """One named tensor of a :class:`SharedState`.

    ``allow_content_inequality=True`` exempts it from the parity check (peers may hold
    different values, e.g. a local RNG state); a fresh RECEIVE_ONLY peer still fetches it.
    """

    name: str
    tensor: Any
    allow_content_inequality: bool = False

    @classmethod
    def from_numpy(cls, array: Any, name: str, allow_content_inequality: bool = False
                   ) -> TensorInfo:
        """A numpy array (C-contiguous) under ``name``; syncs write into it in place."""
        return cls(name, array, allow_content_inequality)

    @classmethod
    def from_torch(cls, tensor: Any, name: str, allow_content_inequality: bool = False
                   ) -> TensorInfo:
        """A torch CPU tensor (contiguous) under ``name``; syncs write into it in place."""
        return cls(name, tensor, allow_content_inequality)


class SharedState:
    """Tensors plus a revision that advances by exactly one between syncs."""

    def __init__(self, infos: list[TensorInfo], revision: int = 0) -> None:
        if isinstance(infos, (str, bytes, dict)) or not hasattr(infos, "__iter__"):
            raise InvalidArgumentError(
                f"SharedState takes a list of pccl.TensorInfo, got {type(infos).__name__}")
        infos = list(infos)
        for i, info in enumerate(infos):
            if not isinstance(info, TensorInfo):
                raise InvalidArgumentError(
                    f"SharedState entry {i} is a {type(info).__module__}."
                    f"{type(info).__qualname__}, not a pccl.TensorInfo: name each tensor, "
                    f"e.g. pccl.TensorInfo.from_numpy(array, 'weights') or "
                    f"pccl.TensorInfo.from_torch(tensor, 'layer1.weight')")
            if not isinstance(info.name, str) or not info.name:
                raise InvalidArgumentError(
                    f"SharedState entry {i}: the name must be a non-empty string, got "
                    f"{info.name!r}")
        names = [i.name for i in infos]
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"shared state names must be unique: {names}")
        if not isinstance(revision, int) or revision < 0:
            raise InvalidArgumentError("revision must be a non-negative integer")
        self.infos = list(infos)
        self.revision = revision


@dataclasses.dataclass(frozen=True)
class SyncInfo:
    """What one sync cost this peer."""

    tx_bytes: int  #: tensor bytes this peer served to others
    rx_bytes: int  #: tensor bytes this peer fetched


@dataclasses.dataclass(frozen=True)
class SyncProgress:
    """A snapshot of a running sync, handed to ``sync_shared_state(progress=...)``."""

    #: tensor bytes landed so far; may step back a little when a source fails (the next
    #: one continues after the whole 1 MiB leaves that landed) and by a whole tensor
    #: when a content mismatch makes it fetch that tensor again
    rx_bytes: int
    rx_total: int  #: tensor bytes this peer fetches in this sync
    tx_bytes: int  #: tensor bytes served to other peers so far in this sync
    tensors_done: int  #: tensors fetched and verified
    tensors_total: int  #: tensors this peer fetches in this sync
    seconds: float  #: since the master's plan arrived
    final: bool  #: the last report: the sync's outcome is known (success or error)
