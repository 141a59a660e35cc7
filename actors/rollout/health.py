"""The rollout actor's health record, with its engine's and its weight client's state."""

from __future__ import annotations

from dataclasses import dataclass

from actors.base import ActorHealth
from protocols import EngineHealth


@dataclass(frozen=True)
class WeightSyncHealth:
    """The engine's end of the weight push (`WeightClient`)."""

    version: int | None = None  # the weight version the engine serves
    group: str | None = None  # the process group it joined, if any
    error: str = ""  # the last load or rejoin failure
    bootstraps: int = 0  # loads of the current weights before serving (start, engine restart, new learner)
    loaded: int = 0
    skipped: int = 0  # announcements at or below the version served
    failures: int = 0
    disk_fallbacks: int = 0
    releases: int = 0  # colocated: memory given back for a learner step
    last_seconds: float = 0.0  # the last load's duration


@dataclass(frozen=True, kw_only=True)
class RolloutHealth(ActorHealth):
    actor_id: str = ""
    groups: int = 0
    episodes: int = 0
    engine_restarts: int = 0
    waits: int = 0  # task requests answered "wait" (or not answered)
    feed_timeouts: int = 0
    inflight: int = 0  # attempts in flight (at the engine or being verified)
    at_engine: int = 0  # of those, attempts whose generate request is at the engine (rollout.max_attempts_at_engine)
    at_verifiers: int = 0  # of those, attempts sent to verifiers and not answered (rollout.max_attempts_at_verifiers)
    engine_tokens_reserved: int = 0  # their prompts plus max_new_tokens, bounded by rollout.max_tokens_in_flight
    group_errors: int = 0  # groups cut short by an exception (their tasks are re-issued)
    unacked: int = 0  # episodes held until replay acknowledges them
    acked: int = 0
    verify_infra: int = 0  # attempts marked 'infra' for want of a verifier answer
    engine_alive: bool = False
    decoded_tokens: int = 0  # tokens the engine generated (0 for an engine that does not count them)
    engine: EngineHealth | None = None  # the engine's own report; None before the engine is built
    weights: WeightSyncHealth | None = None  # None: serving the initial weights (rollout-only)
