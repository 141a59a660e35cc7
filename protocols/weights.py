"""The weight-push plan both ends cut from one `WeightAnnouncement` (docs/training.md), without torch.

A learner pushes a version as an ordered list of buckets; an engine receives them in the same order.
Both sides derive the buckets from the announced manifest, bucket size and format with
`plan_buckets`, so the plan never travels and can never disagree. `bucket_layout` places a bucket's
tensors in one flat byte buffer (the CUDA IPC path shares one buffer per bucket instead of one
handle per tensor). A flat process-group push (`by_dtype=True`) gives every bucket one dtype, so a
bucket travels as one tensor of that dtype: its tensors flattened and concatenated in order, no
padding (`flat_offsets`) — SGLang's `flattened_bucket` format.
"""

from __future__ import annotations

from math import prod

from protocols.records import TensorSpec

# Bytes per element of the dtypes a weight push carries (names as torch prints them, minus "torch.").
ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
# Offsets inside a flat bucket buffer are multiples of this, so every tensor view is aligned for any dtype
# and for vectorised copies.
ALIGN = 256


def nbytes(spec: TensorSpec) -> int:
    """Bytes of one tensor; ValueError for a dtype a weight push does not carry."""
    size = ITEMSIZE.get(spec.dtype.removeprefix("torch."))
    if size is None:
        raise ValueError(f"{spec.name}: dtype {spec.dtype!r} is not a weight dtype ({sorted(ITEMSIZE)})")
    if any(d < 0 for d in spec.shape):
        raise ValueError(f"{spec.name}: negative dimension in shape {spec.shape}")
    return size * prod(spec.shape)


def manifest_bytes(manifest: list[TensorSpec]) -> int:
    return sum(nbytes(s) for s in manifest)


def plan_buckets(manifest: list[TensorSpec], bucket_bytes: int, *, by_dtype: bool = False) -> list[list[TensorSpec]]:
    """Split the manifest, in order, into buckets of at most `bucket_bytes` (a larger tensor gets a
    bucket of its own; `bucket_bytes` <= 0 means one bucket per dtype group). With `by_dtype` the
    manifest is first grouped by dtype (in the order each dtype first appears, tensors in manifest
    order within it), so no bucket mixes dtypes. Deterministic: the same manifest, size and format
    always give the same buckets."""
    if by_dtype:
        groups: dict[str, list[TensorSpec]] = {}
        for spec in manifest:
            nbytes(spec)  # refuses a dtype a weight push does not carry
            groups.setdefault(spec.dtype.removeprefix("torch."), []).append(spec)
        return [b for group in groups.values() for b in plan_buckets(group, bucket_bytes)]
    if bucket_bytes <= 0:
        return [list(manifest)] if manifest else []
    buckets: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    filled = 0
    for spec in manifest:
        size = nbytes(spec)
        if current and filled + size > bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
        current.append(spec)
        filled += size
    if current:
        buckets.append(current)
    return buckets


def bucket_layout(bucket: list[TensorSpec]) -> tuple[list[int], int]:
    """Byte offset of each tensor in the bucket's flat buffer, and the buffer's total size."""
    offsets, end = [], 0
    for spec in bucket:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + nbytes(spec)
    return offsets, end


def flat_offsets(bucket: list[TensorSpec]) -> tuple[list[int], int]:
    """Element offset of each tensor in a flat bucket (one dtype, no padding), and its total elements."""
    if len({s.dtype.removeprefix("torch.") for s in bucket}) > 1:
        raise ValueError(f"a flat bucket holds one dtype, got {sorted({s.dtype for s in bucket})}")
    offsets, end = [], 0
    for spec in bucket:
        offsets.append(end)
        end += prod(spec.shape)
    return offsets, end


def group_name(engine_id: str, location: str) -> str:
    """The name of the weight-broadcast group an engine joins at `location` ("host:port"): unique per
    join, so a rejoining engine never meets a group of an earlier life."""
    return f"kiln-weights/{engine_id}/{location}"


def parse_location(location: str) -> tuple[str, int]:
    """("host", port) of a rendezvous location "host:port"; ValueError when malformed."""
    host, sep, port = location.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad rendezvous location {location!r} (want host:port)")
    return host, int(port)
