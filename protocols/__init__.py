"""Kiln's wire layer: every record, the msgpack codec and the ZMQ channels (docs/architecture.md).

Actors never build raw sockets or raw dicts: they send records through these channels.
"""

from protocols.codec import decode, decode_parts, encode, encode_parts
from protocols.records import *  # the records are this package's vocabulary
from protocols.records import ERROR_CLASSES
from protocols.schema import REGISTRY, ProtocolError, Record

__all__ = [
    "ERROR_CLASSES",
    "REGISTRY",
    "ProtocolError",
    "Record",
    "decode",
    "decode_parts",
    "encode",
    "encode_parts",
    "infra_result",
]
__all__ += list(REGISTRY)  # every record class, by name
