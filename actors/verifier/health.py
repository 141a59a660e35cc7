"""The verifier actor's health record."""

from __future__ import annotations

from dataclasses import dataclass

from actors.base import ActorHealth


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
