"""The control plane: msgpack messages between peers and the master, and their framing.

Every frame is a 4-byte big-endian length followed by a msgpack map ``{"t": type, ...}``.
See ``docs/protocol.md`` for the message flow.
"""

from pccl.protocol.codec import MAX_FRAME, decode, encode, frame
from pccl.protocol.messages import (
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    Message,
    compatible,
    version_mismatch,
)

__all__ = ["MAX_FRAME", "MIN_PROTOCOL_VERSION", "PROTOCOL_VERSION", "Message", "compatible",
           "decode", "encode", "frame", "version_mismatch"]
