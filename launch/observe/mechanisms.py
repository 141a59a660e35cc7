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

from collections.abc import Callable
from dataclasses import dataclass

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
    unit: str  # what `count` counts, singular: the report writes '1 group', '4 groups'
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
        "group",
        last(mk.REPLAY_RETRY_ADMITTED),
        ALL_FAILED,
    ),
    Mechanism(
        "Buffered Dynamic Retry: a repair task from the buffer is served", "group", last(mk.REPLAY_RETRY_SERVED), RETRY
    ),
    Mechanism(
        "Buffered Dynamic Retry: a repair group is trained", "group", last(mk.REPLAY_RETRY_TRAINED), RETRY_TRAINED
    ),
    Mechanism(
        "MirrorPop drops a sequence (mean |log π_prox - log μ| > δ)",
        "sequence",
        summed(mk.TRAIN_MIRRORPOP_DROPPED),
        MIRRORPOP,
    ),
    Mechanism(
        "MirrorPop masks a token of a kept sequence (|log π_prox - log μ| > δ_tok)",
        "token",
        summed(mk.TRAIN_MIRRORPOP_TOKEN_MASKED),
        None,
    ),
    Mechanism("a repair turn passes (after a failed turn)", "episode", summed(mk.ROLLOUT_REPAIR_PASSES), REPAIR_PASSED),
    Mechanism(
        "off-policy: a sample made by an older version is trained (MirrorPop kept it)",
        "sequence",
        summed(mk.TRAIN_OFF_POLICY_KEPT),
        OFF_POLICY,
    ),
    Mechanism(
        "verdict: cheating (legality gate)", "attempt", summed(mk.verifier_error("cheating")), verdict_tag("cheating")
    ),
    Mechanism("verdict: compile error", "attempt", summed(mk.verifier_error("compile")), verdict_tag("compile")),
    Mechanism(
        "verdict: wrong result (correctness)",
        "attempt",
        summed(mk.verifier_error("correctness")),
        verdict_tag("correctness"),
    ),
    Mechanism("verdict: timeout", "attempt", summed(mk.verifier_error("timeout")), verdict_tag("timeout")),
    Mechanism("dynamic sampling: a tied group is filtered", "group", last(mk.replay_filtered_groups("tied")), TIED),
    Mechanism(
        "staleness filter: a group with a sample lagging > η is filtered",
        "group",
        last(mk.replay_filtered_groups("stale")),
        None,
    ),
    Mechanism("PPO clip: a token's ratio is clipped", "token-update", summed(mk.TRAIN_CLIPPED), None),
    Mechanism("importance weight truncated at C", "token", summed(mk.TRAIN_IS_TRUNCATED), None),
)

# One sentence per term of the algorithm that the report names, in the order a reader meets them; the
# report explains each term once, where it first appears (its summary, the mechanisms table, a plot).
GLOSSARY = {
    "PrimeEcho": (
        "PrimeEcho is the episode's reward, R = α·s_first + (1-α)·max_k s_k + b_early: the first turn's verifier "
        "score s_first anchors it, the best turn's score lifts it, and a pass at turn 1 (or 2) earns a bonus."
    ),
    "MirrorPop": (
        "MirrorPop drops a sequence whose tokens' log-probabilities under the learner (π_prox) differ from the "
        "engine's at sampling time (μ) by more than δ on average, so samples too far off-policy carry no gradient; "
        "in a kept sequence, a token whose own difference exceeds δ_tok carries none either."
    ),
    "Buffered Dynamic Retry": (
        "Buffered Dynamic Retry (BDR) keeps each group whose every attempt failed, with its code and the verifier's "
        "feedback, in a bounded buffer, and serves a repair task from it instead of a fresh task with probability p."
    ),
    "η": (
        "η (the maximum staleness) is how many weight versions a trained sample's tokens may lag the learner: a "
        "group with an older sample is filtered (its task re-issued), and admission starts no more groups than "
        "can still be trained within that bound."
    ),
    "ε": (
        "ε_low and ε_high bound the PPO ratio r = π_θ/π_prox: a token-update that would push r below 1-ε_low "
        "(A < 0) or above 1+ε_high (A > 0) is clipped, so one batch cannot move the policy far."
    ),
    "C": (
        "C caps each token's importance weight w = min(π_prox/μ, C), the correction for tokens sampled by older "
        "weights, so one unlikely token cannot dominate the loss."
    ),
}

# The mechanisms `make demo`'s workload is shaped to show (tests/launch/driver/test_demo.py asserts each acted).
DEMO_MECHANISMS = tuple(m for m in MECHANISMS if m.tag is not None)


def counts(rows: Rows) -> dict[str, int]:
    """How often each mechanism acted over the run's rows, by name."""
    return {m.name: m.count(rows) for m in MECHANISMS}
