"""The verifier actor's health record, and the histogram of how long its verifications take."""

from __future__ import annotations

import math
from dataclasses import dataclass

from actors.base import ActorHealth

# Verification latency histogram: fixed log-spaced buckets, so that two readings of the cumulative
# counts subtract bucket by bucket into the histogram of the verifications in between (a benchmark's
# window) whatever the latencies. Eight buckets per doubling put a bucket's geometric middle within
# 4.4% of any latency inside it; 2^-7 s (7.8 ms) to 2^12 s (68 min) covers a cache hit to a hung run.
BUCKETS_PER_DOUBLING = 8
LOWEST_LOG2_S = -7
HIGHEST_LOG2_S = 12
LATENCY_BUCKETS = (HIGHEST_LOG2_S - LOWEST_LOG2_S) * BUCKETS_PER_DOUBLING + 2  # + below and above the range


def latency_bucket(seconds: float) -> int:
    """The bucket of one verification's latency: 0 below 2^-7 s, the last above 2^12 s."""
    if not seconds > 0:  # zero, negative or NaN: below the range
        return 0
    index = math.floor((math.log2(seconds) - LOWEST_LOG2_S) * BUCKETS_PER_DOUBLING) + 1
    return min(max(index, 0), LATENCY_BUCKETS - 1)


def bucket_seconds(index: int) -> float:
    """A bucket's representative latency: its geometric middle (the range's ends for the outer two)."""
    if index <= 0:
        return 2.0**LOWEST_LOG2_S
    if index >= LATENCY_BUCKETS - 1:
        return 2.0**HIGHEST_LOG2_S
    return 2.0 ** (LOWEST_LOG2_S + (index - 0.5) / BUCKETS_PER_DOUBLING)


def latency_quantile(counts, q: float) -> float | None:
    """The `q`-quantile of a histogram (counts per bucket, in bucket order); None when it is empty."""
    total = sum(counts)
    if total <= 0:
        return None
    rank, seen = q * total, 0.0
    for index, n in enumerate(counts):
        seen += n
        if n > 0 and seen >= rank:
            return bucket_seconds(index)
    return bucket_seconds(len(counts) - 1)


@dataclass(frozen=True, kw_only=True)
class VerifierHealth(ActorHealth):
    address: str = ""
    received: int = 0  # requests accepted (a resend of one in flight is not counted again)
    replied: int = 0
    infra: int = 0  # answered 'infra': the reward actor raised, hung or returned an invalid result
    hung: int = 0  # of those, the ones that did not answer within verifier.reward_timeout_s
    rejected: int = 0  # requests that were not a VerifyRequest
    queued: int = 0  # waiting for a worker
    inflight: int = 0
    reward_actor: str = ""  # the reward-actor class, as module.qualname
    compiled: int = 0  # verifications that ran a real compile (a build not served from a cache)
    modelled_s: float = 0.0  # seconds of modelled GPU-side latency slept (verifier.modelled_latency)
    warming: bool = False  # the reward actor's one-off warm-up (warm(): precompiled headers, sandbox) still runs
    # Verifications so far by how long each held its worker slot (the reward actor, then any modelled
    # latency; not the wait for a worker), counted per bucket of `latency_bucket`: cumulative, so
    # that a benchmark subtracts two readings. Empty from an actor that predates it.
    latency_counts: tuple[int, ...] = ()
