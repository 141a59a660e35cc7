"""The mechanisms of Kiln's algorithm as a run shows them: what each is, how often it acted (counted
from metrics.jsonl alone), and the episode-dump tag of an episode that shows it.

The report's "Mechanisms" table lists them; the episode dumper (launch/observe/episode_dump.py) always dumps
the first episode that carries each tag, so the table can point at it; the demo's test asserts that
the mechanisms the demo is shaped for all acted.

Counts come in two kinds of metric: per-step keys (what happened since the last step: verdicts,
MirrorPop drops, lags of trained samples) are summed over the rows; run totals that replay keeps
(retry buffer, filtered groups) are read from the last row that has them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from protocols import metric_keys as mk

Rows = list[dict]


def summed(key: str) -> Callable[[Rows], int]:
    return lambda rows: int(sum(r.get(key) or 0.0 for r in rows))


def last(key: str) -> Callable[[Rows], int]:
    def count(rows: Rows) -> int:
        values = [r[key] for r in rows if r.get(key) is not None]
        return int(values[-1]) if values else 0

    return count


@dataclass(frozen=True)
class Mechanism:
    name: str
    unit: str  # what `count` counts
    count: Callable[[Rows], int]
    tag: str | None  # the episode-dump tag of an episode that shows it; None: it acts on tokens, not episodes


# Episode-dump tags (launch/observe/episode_dump.py sets them on the episodes it holds).
ALL_FAILED = "all-failed group"
RETRY = "retry"
RETRY_TRAINED = "retry group trained"
MIRRORPOP = "MirrorPop dropped"
REPAIR_PASSED = "repair turn passed"
OFF_POLICY = "trained off-policy (lag >= 1)"
TIED = "tied group"


def verdict_tag(error_class: str) -> str:
    return f"verdict {error_class}"


MECHANISMS = (
    Mechanism(
        "Buffered Dynamic Retry: an all-failed group enters the retry buffer",
        "groups",
        last(mk.REPLAY_RETRY_ADMITTED),
        ALL_FAILED,
    ),
    Mechanism(
        "Buffered Dynamic Retry: a repair task from the buffer is served", "groups", last(mk.REPLAY_RETRY_SERVED), RETRY
    ),
    Mechanism(
        "Buffered Dynamic Retry: a repair group is trained", "groups", last(mk.REPLAY_RETRY_TRAINED), RETRY_TRAINED
    ),
    Mechanism(
        "MirrorPop drops a sequence (mean |log π_prox - log μ| > δ)",
        "sequences",
        summed(mk.TRAIN_MIRRORPOP_DROPPED),
        MIRRORPOP,
    ),
    Mechanism(
        "a repair turn passes (after a failed turn)", "episodes", summed(mk.ROLLOUT_REPAIR_PASSES), REPAIR_PASSED
    ),
    Mechanism(
        "off-policy: a sample made by an older version is trained (MirrorPop kept it)",
        "sequences",
        summed(mk.TRAIN_OFF_POLICY_KEPT),
        OFF_POLICY,
    ),
    Mechanism(
        "verdict: cheating (legality gate)", "attempts", summed(mk.verifier_error("cheating")), verdict_tag("cheating")
    ),
    Mechanism("verdict: compile error", "attempts", summed(mk.verifier_error("compile")), verdict_tag("compile")),
    Mechanism(
        "verdict: wrong result (correctness)",
        "attempts",
        summed(mk.verifier_error("correctness")),
        verdict_tag("correctness"),
    ),
    Mechanism("verdict: timeout", "attempts", summed(mk.verifier_error("timeout")), verdict_tag("timeout")),
    Mechanism("dynamic sampling: a tied group is filtered", "groups", last(mk.replay_filtered_groups("tied")), TIED),
    Mechanism(
        "staleness filter: a group with a sample lagging > η is filtered",
        "groups",
        last(mk.replay_filtered_groups("stale")),
        None,
    ),
    Mechanism("PPO clip: a token's ratio is clipped", "token-updates", summed(mk.TRAIN_CLIPPED), None),
    Mechanism("importance weight truncated at C", "tokens", summed(mk.TRAIN_IS_TRUNCATED), None),
)

# The mechanisms `make demo`'s workload is shaped to show (tests/launch/driver/test_demo.py asserts each acted).
DEMO_MECHANISMS = tuple(m for m in MECHANISMS if m.tag is not None)


def counts(rows: Rows) -> dict[str, int]:
    """How often each mechanism acted over the run's rows, by name."""
    return {m.name: m.count(rows) for m in MECHANISMS}
