"""The shared-state fetch engine of a peer: brings the tensors a sync plan names from
their holders, verified against their content hashes as the bytes land.

Large tensors travel in ranges spread over the holders (a range whose holder fails goes
on from the next one, after the hash leaves already landed); small ones in pipelined
batches over one stream per holder; a tensor whose bytes do not match its hash is
fetched whole from each holder in turn. Nothing here talks to the master or decides
anything about the sync: :class:`pccl.communicator.Communicator` hands it the master's
plan and reports the outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from pccl import _core
from pccl.errors import PCCLError
from pccl.protocol import messages as m
from pccl.shared_state import SyncProgress
from pccl.tensors import RawTensor, byte_buffer

log = logging.getLogger("pccl.communicator")


class Fetcher:
    """Fetches one sync's plan through ``node`` (a :class:`pccl._core.P2PNode`)."""

    def __init__(self, node: Any, peer_id: int | None, pool: int, peer_timeout: float) -> None:
        self.node, self.peer_id, self.pool, self.peer_timeout = node, peer_id, pool, peer_timeout

    async def fetch_planned(self, plan: m.SyncPlan, by_key: dict[str, RawTensor],
                             in_place: bool,
                             counters: dict[tuple[str, int], tuple[int, Any]],
                             fetched: dict[str, Any]) -> list[BaseException]:
        """Fetches what ``plan`` says into scratch buffers (or, ``in_place``, the tensors):
        large tensors in ranges, small ones in pipelined batches. What verifies goes into
        ``fetched``; returns the failures (every fetch has ended by then)."""
        addrs = dict(zip(plan.source_ids, plan.source_addrs))
        # Fetches in flight at once (a range, a tensor or a batch of small tensors, one
        # stream each, kept for the next fetch from the same holder), bounded.
        limit = asyncio.Semaphore(MAX_FETCHES_IN_FLIGHT)
        pool = self.pool
        wanted = list(zip(plan.fetch_keys, plan.fetch_hashes, plan.fetch_sources))
        big = [w for w in wanted if by_key[w[0]].nbytes >= 2 * RANGE_BYTES]
        # Large tensors are fetched in ranges, over at least p2p_connection_pool_size
        # streams in all (one tensor alone is not stuck with one stream; many do not each
        # open that many).
        streams = -(-pool // max(1, len(big)))

        async def fetch(key: str, want: bytes, sources: list[int]) -> None:
            dst = by_key[key].data if in_place else None
            fetched[key] = await self._fetch_verified(
                key, want, sources, addrs, dst, by_key[key].nbytes, counters, limit, streams)

        async def fetch_batch(n: int, batch: list[tuple[str, bytes, list[int]]]) -> None:
            outs = [by_key[k].data if in_place else byte_buffer(by_key[k].nbytes)
                    for k, _, _ in batch]
            retry = await self._fetch_pipelined(n, batch, outs, addrs, counters, limit, fetched)
            failed = [r for r in await asyncio.gather(*(fetch(*w) for w in retry),
                                                      return_exceptions=True)
                      if isinstance(r, BaseException)]
            if failed:
                raise failed[0]

        small = [w for w in wanted if by_key[w[0]].nbytes < 2 * RANGE_BYTES]
        jobs = [fetch(*w) for w in big]
        jobs += [fetch_batch(n, b) for n, b in enumerate(_batches(small, pool))]
        results = await asyncio.gather(*jobs, return_exceptions=True)
        return [r for r in results if isinstance(r, BaseException)]

    async def _fetch_pipelined(self, n: int, batch: list[tuple[str, bytes, list[int]]],
                               outs: list[Any], addrs: dict[int, str],
                               counters: dict[tuple[str, int], tuple[int, Any]],
                               limit: asyncio.Semaphore,
                               fetched: dict[str, Any]) -> list[tuple[str, bytes,
                                                                             list[int]]]:
        """Fetches the small tensors of ``batch`` from their first source over one
        stream into ``outs``, every request sent up front (one round trip for the batch,
        not one per tensor). What verifies goes into ``fetched``; returns the others
        (failed, refused, or not matching their hash) with their sources rotated so this
        source comes last, to be fetched one by one."""
        src = batch[0][2][0]
        counter = _core.ByteCounter()
        slot = ("", -1 - n)  # no tensor range has a negative offset
        counters[slot] = (0, counter)
        started = time.perf_counter()
        async with limit:
            try:
                results = await self.node.fetch_many_into(
                    addrs[src], src, [k for k, _, _ in batch], outs,
                    io_timeout=self.peer_timeout, counter=counter)
            except PCCLError as e:
                results = [e] * len(batch)
        retry, landed = [], 0
        for (key, want, sources), out, r in zip(batch, outs, results):
            if isinstance(r, bytes) and _core.hash_root(r, out.nbytes) == want:
                fetched[key] = out
                landed += out.nbytes
            else:
                why = r if isinstance(r, BaseException) else "content hash mismatch"
                log.info("peer %s: shared state %r from peer %s: %s; fetching it alone",
                         self.peer_id, key, src, why)
                retry.append((key, want, sources[1:] + sources[:1]))
        counters[slot] = (landed, _core.ByteCounter())  # the retries count afresh
        if landed:
            self._log_fetched(f"({len(batch) - len(retry)} tensors)", landed, started, [src])
        return retry

    async def _fetch_verified(self, key: str, want: bytes, sources: list[int],
                              addrs: dict[int, str], dst: Any | None, nbytes: int,
                              counters: dict[tuple[str, int], tuple[int, Any]],
                              limit: asyncio.Semaphore, streams: int = 1) -> Any:
        """Fetches ``key`` into a scratch buffer (or straight into ``dst``) and checks
        its content hash. A large tensor is split into ranges fetched at once (at least
        one per holder, and ``streams``); a range whose source fails continues from the
        next holder after the whole hash leaves already landed. After a content
        mismatch, whole-tensor fetches go through the holders in turn. ``counters``
        count the bytes landed."""
        scratch = byte_buffer(nbytes) if dst is None else dst
        started = time.perf_counter()
        # Every range runs to its end before a failure is raised: nothing keeps writing
        # into the buffer after this returns.
        results = await asyncio.gather(*(
            self._fetch_range(key, scratch, offset, length, nbytes,
                              sources[i % len(sources):] + sources[:i % len(sources)],
                              addrs, counters, limit)
            for i, (offset, length) in enumerate(
                _fetch_ranges(nbytes, len(sources), streams))),
            return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        parts = [r for r in results if not isinstance(r, BaseException)]
        got = _core.hash_root(b"".join(p for p, _ in parts), nbytes)
        used = sorted({src for _, srcs in parts for src in srcs})
        if got == want:
            self._log_fetched(repr(key), nbytes, started, used)
            return scratch
        errors = [f"peers {used}: content hash mismatch (got {got.hex()[:16]}..., "
                  f"expected {want.hex()[:16]}...)"]
        for k in [k for k in counters if k[0] == key]:
            del counters[k]  # the whole-tensor attempts below count afresh
        for src in sources:
            started = time.perf_counter()
            try:
                digests, _ = await self._fetch_range(key, scratch, 0, nbytes, nbytes, [src],
                                                     addrs, counters, limit)
            except PCCLError as e:
                errors.append(str(e))
                continue
            got = _core.hash_root(digests, nbytes)
            if got == want:
                self._log_fetched(repr(key), nbytes, started, [src])
                return scratch
            errors.append(f"peer {src}: content hash mismatch (sent {got.hex()[:16]}..., "
                          f"expected {want.hex()[:16]}...)")
        raise _core.PeerConnectionError(
            f"could not fetch shared state {key!r} from any source: {'; '.join(errors)}")

    async def _fetch_range(self, key: str, scratch: Any, offset: int, length: int,
                           total: int, order: list[int], addrs: dict[int, str],
                           counters: dict[tuple[str, int], tuple[int, Any]],
                           limit: asyncio.Semaphore) -> tuple[bytes, list[int]]:
        """Fetches bytes ``offset..offset + length`` from the holders in ``order``: when
        one fails, the next continues after the whole hash leaves that already landed
        (their digests are computed from what landed; the content hash of the tensor
        still checks every byte). Returns the range's leaf digests and the holders that
        delivered parts of it."""
        errors = []
        done, head, used = 0, b"", []  # bytes of whole leaves landed so far, their digests
        for src in order:
            start = offset + done
            counter = _core.ByteCounter()
            counters[(key, offset)] = (done, counter)
            async with limit:
                try:
                    digests = await self.node.fetch_into(
                        addrs[src], src, key, scratch[start:offset + length], offset=start,
                        total=total, io_timeout=self.peer_timeout, counter=counter)
                except PCCLError as e:
                    errors.append(f"peer {src}: {e}")
                    whole = counter.value // _LEAF * _LEAF
                    if whole:
                        head += _core.leaf_digests(scratch[start:start + whole], start // _LEAF)
                        done += whole
                        used.append(src)
                    continue
            return head + bytes(digests), [*used, src]
        raise _core.PeerConnectionError(
            f"could not fetch bytes {offset}..{offset + length} of shared state {key!r}: "
            f"{'; '.join(errors)}")

    def _log_fetched(self, what: str, nbytes: int, started: float, sources: list[int]) -> None:
        elapsed = time.perf_counter() - started
        log.info("peer %s: fetched shared state %s (%.1f MiB) from peer(s) %s in %.2fs "
                 "(%.2f GB/s)", self.peer_id, what, nbytes / 2**20, sources, elapsed,
                 nbytes / max(elapsed, 1e-9) / 1e9)


def prefault_all(buffers: list[Any]) -> None:
    """Best effort: an optimization must never fail a sync."""
    for b in buffers:
        try:
            _core.prefault(b)
        except Exception as e:  # noqa: BLE001 (nothing to recover; the commit faults pages in)
            log.debug("prefault skipped: %s", e)


#: Fetches (streams) one sync keeps in flight at once.
MAX_FETCHES_IN_FLIGHT = 16
#: Tensors of at least twice this size are fetched in ranges over several streams at once.
RANGE_BYTES = 32 << 20
_LEAF = 1 << 20  # ranges start on hash leaves (pccl._core's tree hash)


#: Small tensors fetched over one stream with their requests pipelined, at most.
BATCH_TENSORS = 64


def _batches(wanted: list[tuple[str, bytes, list[int]]],
             streams: int) -> list[list[tuple[str, bytes, list[int]]]]:
    """Groups small tensors by their first source (the master spreads those) into
    batches of at most :data:`BATCH_TENSORS`, at least ``streams`` per source while
    there are tensors for them (several streams keep a per-connection cap from limiting
    the sync)."""
    by_source: dict[int, list[tuple[str, bytes, list[int]]]] = {}
    for w in wanted:
        by_source.setdefault(w[2][0], []).append(w)
    out = []
    for ws in by_source.values():
        count = max(-(-len(ws) // BATCH_TENSORS), min(len(ws), streams))
        out += [ws[i::count] for i in range(count)]
    return out


def _fetch_ranges(nbytes: int, holders: int, streams: int = 1) -> list[tuple[int, int]]:
    """(offset, length) ranges of a tensor, fetched at once (range i from holder
    i mod ``holders``): at least ``streams`` of them, rounded up to a multiple of the
    holders so each serves as many, and no more than leaves each about
    :data:`RANGE_BYTES` or more; each starts on a hash leaf. One range for small
    tensors."""
    want = holders * -(-max(streams, 1) // holders)
    parts = max(1, min(want, nbytes // RANGE_BYTES))
    if parts == 1:
        return [(0, nbytes)]
    leaves = -(-nbytes // _LEAF)
    per = -(-leaves // parts) * _LEAF
    return [(a, min(per, nbytes - a)) for a in range(0, nbytes, per)]


class SyncReporter:
    """Reports a running sync's progress to a callback and, for long transfers, to the
    log; an owned task from the master's plan until the outcome (``async with``)."""

    LOG_EVERY = 10.0

    def __init__(self, node_of: Callable[[], Any], peer_id: int | None,
                 callback: Callable[[SyncProgress], object] | None, interval: float, served_before: int,
                 counters: dict[tuple[str, int], tuple[int, Any]],
                 fetched: dict[str, Any], sizes: list[int]) -> None:
        self._node_of, self._peer_id, self._callback = node_of, peer_id, callback
        self._interval = max(float(interval), 0.01)
        self._served_before = served_before
        self._counters, self._fetched = counters, fetched
        self._rx_total, self._tensors = sum(sizes), len(sizes)
        self._started = time.perf_counter()
        self._task: asyncio.Task[None] | None = None

    def snapshot(self, final: bool = False) -> SyncProgress:
        node = self._node_of()
        tx = int(node.bytes_served() - self._served_before) if node is not None else 0
        return SyncProgress(
            rx_bytes=sum(base + c.value for base, c in list(self._counters.values())),
            rx_total=self._rx_total, tx_bytes=tx, tensors_done=len(self._fetched),
            tensors_total=self._tensors, seconds=time.perf_counter() - self._started,
            final=final)

    def _emit(self, final: bool = False) -> SyncProgress:
        p = self.snapshot(final)
        if self._callback is not None:
            try:
                self._callback(p)
            except Exception:
                log.exception("peer %s: the sync progress callback failed; not calling it "
                              "again", self._peer_id)
                self._callback = None
        return p

    async def _run(self) -> None:
        logged = 0.0
        while True:
            await asyncio.sleep(self._interval)
            p = self._emit()
            if p.rx_total and p.seconds - logged >= self.LOG_EVERY:
                logged = p.seconds
                log.info("peer %s: shared-state sync: %.1f of %.1f MiB fetched, %d/%d "
                         "tensors, %.1fs (%.2f GB/s)", self._peer_id,
                         p.rx_bytes / 2**20, p.rx_total / 2**20, p.tensors_done,
                         p.tensors_total, p.seconds, p.rx_bytes / max(p.seconds, 1e-9) / 1e9)

    async def __aenter__(self) -> SyncReporter:
        self._emit()
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._emit(final=True)
