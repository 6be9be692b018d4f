"""Type stubs for the Rust extension ``pccl._core`` (hand-written; keep in sync with rust/py)."""

from asyncio import Future
from typing import Any, final

# The runtime's own __all__ (pyo3 lists every name registered, in order): stubtest
# compares the two, so a new function or class goes here too.
__all__ = [
    "__version__",
    "reset_log_cache",
    "close_log_bridge",
    "leave_python",
    "PCCLError",
    "InvalidArgumentError",
    "InvalidUsageError",
    "TooFewPeersError",
    "MasterConnectionError",
    "PeerConnectionError",
    "NoSharedStateAvailableError",
    "PendingAsyncOpsError",
    "UpdateTopologyFailedError",
    "TopologyOptimizationFailedError",
    "RevisionIncrementViolationError",
    "AuthenticationError",
    "IdentityError",
    "ProtocolError",
    "CollectiveAbortedError",
    "hash_root",
    "leaf_digests",
    "content_hash",
    "content_hash_hex",
    "copy_into",
    "prefault",
    "star_all_reduce",
    "mesh_partners",
    "mesh_rounds",
    "ByteCounter",
    "HASH_LEAF_BYTES",
    "FETCH_RANGE_BYTES",
    "MAX_FETCHES_IN_FLIGHT",
    "fetch_ranges",
    "FetchOp",
    "sparse_encoded_len",
    "sparse_compress",
    "sparse_decode_add",
    "SecureHandshake",
    "SecureSession",
    "SECURE_HELLO_MAGIC",
    "CLEAR_HELLO",
    "MAX_HANDSHAKE_FRAME",
    "STATUS_TRANSPORT_MISMATCH",
    "Identity",
    "node_public_key",
    "run_public_key",
    "key_fingerprint",
    "sign_cert",
    "parse_cert",
    "sign_denylist",
    "parse_denylist",
    "GROUP_PEER",
    "GROUP_MASTER",
    "P2PNode",
    "RingOp",
]

__version__: str
#: Bytes of one leaf of the content hash's tree (fetched ranges start on leaves).
HASH_LEAF_BYTES: int
#: Tensors of at least twice this many bytes are fetched in ranges (the default).
FETCH_RANGE_BYTES: int
#: Streams one shared-state fetch keeps in flight at once, at most.
MAX_FETCHES_IN_FLIGHT: int

class PCCLError(Exception):
    """Base class of every pccl error."""

class InvalidArgumentError(PCCLError):
    """An argument is invalid (dtype, layout, size, value)."""

class InvalidUsageError(PCCLError):
    """The call is not valid in the current state (or disagrees with other peers)."""

class TooFewPeersError(PCCLError):
    """The operation cannot run with this few peers."""

class MasterConnectionError(PCCLError):
    """The master could not be reached or the connection to it was lost."""

class PeerConnectionError(PCCLError):
    """A peer-to-peer link failed, timed out or the peer died."""

class NoSharedStateAvailableError(PCCLError):
    """No peer holds the requested shared state."""

class PendingAsyncOpsError(PCCLError):
    """Asynchronous operations are still in flight."""

class UpdateTopologyFailedError(PCCLError):
    """update_topology() could not complete."""

class TopologyOptimizationFailedError(PCCLError):
    """optimize_topology() could not complete."""

class RevisionIncrementViolationError(PCCLError):
    """A shared-state revision did not advance by exactly one."""

class AuthenticationError(PCCLError):
    """The shared secrets differ (or one side has none)."""

class IdentityError(AuthenticationError):
    """A node's identity was refused (certificate or key); the message names its
    fingerprint."""

class ProtocolError(PCCLError):
    """The remote end sent something that is not valid pccl protocol."""

class CollectiveAbortedError(PCCLError):
    """The collective was called off before it ran (other peers of the group voted on
    the topology, or a deadline passed); nothing was written: retry."""


SECURE_HELLO_MAGIC: bytes
CLEAR_HELLO: bytes
MAX_HANDSHAKE_FRAME: int
STATUS_TRANSPORT_MISMATCH: int


@final
class SecureHandshake:
    """One side of the secure handshake, driven frame by frame (no I/O)."""

    def __new__(cls, dial: bool, secret: bytes | None, prologue: bytes,
                identity: Identity | None = None, group: str = "peer",
                expect: bytes | None = None, also: list[bytes] = ...) -> SecureHandshake: ...
    def hello(self) -> bytes: ...
    def on_frame(self, frame: bytes) -> tuple[bytes | None, BaseException | None]: ...
    @property
    def done(self) -> bool: ...
    @property
    def remote(self) -> _RemoteInfo | None: ...
    def session(self) -> SecureSession: ...


#: (static key, fingerprint, certificate name, certificate groups, not_after): who the
#: other end of a handshake proved to be (the last three None/[] without certificates).
_RemoteInfo = tuple[bytes, str, str | None, list[str], int | None]

GROUP_PEER: str
GROUP_MASTER: str


@final
class Identity:
    """A node's static key and certificate, the run keys it trusts, its denylist."""

    def __new__(cls, secret_key: bytes | None = None, cert: bytes | None = None,
                anchors: list[bytes] = ...) -> Identity: ...
    @property
    def public_key(self) -> bytes: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def cert(self) -> bytes | None: ...
    @property
    def checks_certs(self) -> bool: ...
    @property
    def anchors(self) -> list[bytes]: ...
    def install_denylist(self, raw: bytes) -> bool: ...
    @property
    def denylist(self) -> bytes | None: ...
    @property
    def denylist_version(self) -> int: ...
    def is_denied(self, key: bytes) -> bool: ...
    def check_remote(self, key: bytes, cert: bytes, group: str) -> _RemoteInfo: ...


def node_public_key(secret_key: bytes) -> bytes: ...
def run_public_key(seed: bytes) -> bytes: ...
def key_fingerprint(key: bytes) -> str: ...
def sign_cert(seed: bytes, node_key: bytes, name: str, groups: list[str], not_before: int,
              not_after: int) -> bytes: ...
def parse_cert(raw: bytes) -> tuple[bytes, bytes, str, list[str], int, int]: ...
def sign_denylist(seed: bytes, version: int, issued_at: int,
                  fingerprints: list[bytes]) -> bytes: ...
def parse_denylist(raw: bytes) -> tuple[bytes, int, int, list[bytes]]: ...


@final
class SecureSession:
    """The record layer of one connection after a secure handshake."""

    MAX_RECORD: int
    MIN_RECORD: int

    def seal(self, data: bytes) -> bytes: ...
    def open(self, record: bytes) -> bytes: ...


@final
class P2PNode:
    """A peer's p2p endpoint: listener, pools and ring links (all I/O on tokio)."""

    @staticmethod
    def bind(
        peer_id: int,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: bytes | None = None,
        handshake_timeout: float = 5.0,
        connect_timeout: float = 5.0,
        insecure: bool = False,
        identity: Identity | None = None,
    ) -> Future[P2PNode]: ...
    @property
    def port(self) -> int: ...
    @property
    def punch_ports(self) -> list[int]: ...
    @property
    def peer_id(self) -> int: ...
    def set_peer_id(self, peer_id: int) -> None: ...
    def set_secrets(self, secret: bytes | None, also: list[bytes] = ...) -> None: ...
    def set_peer_keys(self, keys: dict[int, bytes]) -> None: ...
    def connect_pool(self, addr: str, to: int, epoch: int, pool_size: int,
                     route: str = "direct", token: bytes | None = None,
                     relay: str | None = None, mesh: bool = False) -> Future[None]: ...
    def open_inbound(self, route: str, addr: str, token: bytes, stream: int | None = None,
                     relay: str | None = None) -> Future[None]: ...
    def set_transfer_relay(self, to: int, relay: str, token: bytes) -> Future[None]: ...
    def retain_from_epoch(self, epoch: int) -> None: ...
    def parked(self) -> tuple[int, int]: ...
    def close(self) -> Future[None]: ...
    def install_ring(
        self,
        epoch: int,
        next_id: int,
        prev_id: int,
        pool_timeout: float = 10.0,
        io_timeout: float = 30.0,
        max_piece: int = 16 << 20,
        ring: list[int] | None = None,
        mesh_max_bytes: int = 0,
    ) -> Future[None]: ...
    def start_all_reduce(
        self,
        op_id: int,
        rank: int,
        world: int,
        buffer: Any,
        dtype: int,
        op: int,
        piece_bytes: int = 1 << 20,
        quant_algorithm: int = 0,
        quant_dtype: int = 0,
        out: Any = None,
        armed: bool = True,
        in_place: bool = False,
    ) -> RingOp:
        """Starts a ring all-reduce; with ``armed=False`` silence from the previous peer
        is no stall until ``RingOp.arm()``. ``in_place=True`` (without a separate
        ``out``): the results land in ``buffer`` as the ring goes, its original bytes in
        a backup; ``commit(buffer)`` keeps them, ``rollback()`` restores the original
        (a failed ``run()`` restored it already). The op holds the buffer exports of
        ``buffer`` and ``out`` until it is committed or rolled back: meanwhile they
        cannot be resized (``BufferError`` for a ``bytearray``)."""
        ...
    def start_all_gather(
        self,
        op_id: int,
        rank: int,
        world: int,
        buffer: Any,
        out: Any,
        piece_bytes: int = 1 << 20,
        armed: bool = True,
    ) -> RingOp:
        """Starts a ring all-gather: ``buffer`` (this peer's contribution) goes into slot
        ``rank`` of ``out`` (``world`` times its size), the other ranks' contributions
        land in theirs. ``commit(out)`` copies nothing; on failure ``out``'s other slots
        hold unspecified bytes. The op holds ``out``'s export until committed or rolled
        back."""
        ...
    def ring_lanes(self) -> tuple[int, int]: ...
    def ring_ok(self) -> bool: ...
    def serve(self, key: str, buffer: Any) -> None: ...
    def unserve_all(self) -> None: ...
    def drop_idle_transfers(self) -> None: ...
    def bytes_served(self) -> int: ...
    def fetch_into(
        self,
        addr: str,
        peer_id: int,
        key: str,
        out: Any,
        offset: int = 0,
        total: int | None = None,
        io_timeout: float = 30.0,
        counter: ByteCounter | None = None,
        reuse: bool = True,
    ) -> Future[bytes]:
        """Fills ``out`` with bytes ``offset..offset + len(out)`` of the tensor of
        ``total`` bytes a peer serves under ``key``; resolves to the range's leaf
        digests (``hash_root`` combines them), computed while the bytes land."""
        ...
    def fetch_many_into(
        self,
        addr: str,
        peer_id: int,
        keys: list[str],
        outs: list[Any],
        io_timeout: float = 30.0,
        counter: ByteCounter | None = None,
        reuse: bool = True,
    ) -> Future[list[bytes | PCCLError]]:
        """Fills each of ``outs`` with the whole tensor served under the matching key,
        over one stream with every request sent up front; resolves to, per key, its
        leaf digests or the exception its fetch failed with."""
        ...
    def start_fetch(
        self,
        entries: list[tuple[str, Any, bytes, list[int]]],
        addrs: dict[int, str],
        *,
        streams: int = 1,
        io_timeout: float = 30.0,
        range_bytes: int | None = None,
    ) -> FetchOp:
        """Prepares the fetch of a sync plan: ``(key, out, content_hash, holders)``
        entries (``out`` writable, the tensor's size; holders in the order to try them)
        and every holder's ``"host:port"``. Nothing moves before ``FetchOp.run()``."""
        ...
    def probe(
        self,
        addr: str,
        peer_id: int,
        seconds: float = 0.25,
        streams: int = 1,
        max_bytes: int = 256 << 20,
        io_timeout: float = 10.0,
    ) -> Future[tuple[float, float]]: ...

@final
class ByteCounter:
    """Bytes landed by a fetch so far (pass as ``counter=``; read ``value`` any time)."""

    def __init__(self) -> None: ...
    @property
    def value(self) -> int: ...

@final
class FetchOp:
    """One sync plan's fetch (see ``P2PNode.start_fetch``)."""

    def run(self) -> Future[list[PCCLError | None]]:
        """Fetches the plan; resolves, once every transfer has ended, to ``None`` (fetched
        and verified) or the exception its fetch failed with, per entry."""
        ...
    def abort(self) -> None: ...
    @property
    def rx_bytes(self) -> int: ...
    @property
    def tensors_done(self) -> int: ...

def fetch_ranges(
    nbytes: int, holders: int, streams: int = 1, range_bytes: int = 32 << 20
) -> list[tuple[int, int]]:
    """The ``(offset, length)`` ranges the fetch engine splits a tensor into."""

@final
class RingOp:
    """One all-reduce (or all-gather) in flight."""

    def run(self) -> Future[tuple[int, int]]: ...
    @property
    def algorithm(self) -> str:
        """"mesh" (recursive doubling over the mesh links) or "ring"."""
    def abort(self) -> None: ...
    def arm(self) -> None:
        """Starts the stall clock: silence from the previous peer for the I/O timeout
        fails the op from now on (idempotent; harmless once the op ended)."""
    def commit(self, out: Any) -> None:
        """Copies the result into ``out`` and spends the op: its tensors' buffer exports
        are released; it cannot run or commit again."""
    def rollback(self) -> None:
        """An in-place op that ran: puts the tensor's original bytes back (a no-op
        otherwise, after a commit, and the second time). Spends the op, as ``commit``."""

def content_hash(buffer: Any, threads: int | None = None) -> bytes:
    """128-bit content hash of a C-contiguous buffer's bytes, 16 big-endian bytes (GIL released)."""

def content_hash_hex(buffer: Any, threads: int | None = None) -> str:
    """``content_hash(buffer, threads).hex()``."""

def copy_into(dst: Any, src: Any, threads: int | None = None) -> None:
    """Copies ``src`` into ``dst`` (same byte length), GIL released: destination pages
    populated in bulk first, then copied on up to ``threads`` threads (default: all
    cores for copies of at least 64 MiB)."""

def prefault(buffer: Any) -> None:
    """Backs a writable buffer with pages now (contents untouched; GIL released)."""

def sparse_encoded_len(count: int, chunk: int, k: int, bits: int) -> int:
    """Bytes of one tensor's sparse payload (``count`` float32 elements)."""

def sparse_compress(acc: Any, chunk: int, k: int, bits: int) -> bytes:
    """Encodes the float32 accumulator (top ``k`` magnitudes per ``chunk``, ``bits``-bit
    codes on one scale) and leaves the residual in it; returns the payload."""

def sparse_decode_add(payload: bytes, out: Any, chunk: int, k: int, bits: int) -> None:
    """Checks ``payload`` against the parameters and adds what it carries to the float32
    buffer ``out`` (unchanged when refused: ProtocolError)."""

def star_all_reduce(inputs: list[Any], dtype: int, op: int) -> bytes:
    """The bytes a ring all-reduce of ``inputs`` (one per rank, in rank order) gives every peer."""

def mesh_partners(rank: int, world: int) -> list[int]:
    """The ranks ``rank`` exchanges pieces with in a mesh all-reduce of ``world`` peers."""

def mesh_rounds(world: int) -> int:
    """Hops of a mesh all-reduce of ``world`` peers."""

def leaf_digests(buffer: Any, first_leaf: int) -> bytes:
    """Leaf digests of a run of whole hash leaves starting at leaf ``first_leaf``."""

def hash_root(digests: bytes, nbytes: int) -> bytes:
    """The content hash of ``nbytes`` bytes from their leaf digests, in order."""

def reset_log_cache() -> None:
    """Forgets the Python loggers and levels the Rust side cached (after a level change;
    ``pccl._logging`` calls it on every one)."""

def close_log_bridge() -> None:
    """Stops forwarding Rust log records to Python for good (interpreter exit)."""

def leave_python() -> None:
    """Interpreter exit: pccl operations still running never resolve their asyncio
    futures, and the runtime's threads stop entering Python (irreversible). Returns
    once none of them is in Python (at most about 2 s)."""
