"""The ablation's arms: each a list of config overrides applied on top of the user's config and
overrides, and the counter (metric keys of metrics.jsonl) that proves its mechanism acted. In the
`full` arm every counter should be above 0; in an arm its own counter must be 0."""

from __future__ import annotations

from dataclasses import dataclass

from protocols import metric_keys as mk


@dataclass(frozen=True)
class Counter:
    """How often a mechanism acted over a run: per-step keys are summed over the rows, run totals
    (replay's) are read from the last row that has them."""

    name: str
    summed: tuple[str, ...] = ()
    total: tuple[str, ...] = ()

    def count(self, rows: list[dict]) -> float:
        n = sum(float(r.get(k) or 0.0) for r in rows for k in self.summed)
        for key in self.total:
            values = [r[key] for r in rows if r.get(key) is not None]
            n += float(values[-1]) if values else 0.0
        return n


@dataclass(frozen=True)
class Arm:
    name: str
    overrides: tuple[str, ...]
    counter: Counter | None  # None: the full arm, which switches nothing off
    switches_off: str


ARMS: dict[str, Arm] = {
    arm.name: arm
    for arm in (
        # Nothing switched off: the baseline every other arm is compared with.
        Arm("full", (), None, "nothing"),
        # PrimeEcho's anchor: α = 0 makes an episode's reward its best turn's score (plus b_early); the
        # first turn no longer anchors it. Counter: episodes whose first turn scored below their best
        # while α > 0, i.e. whose reward the anchor changed (rollout/anchored_episodes).
        Arm(
            "no_prime_echo_anchor",
            ("algo.alpha=0",),
            Counter("anchored episodes", summed=(mk.ROLLOUT_ANCHORED_EPISODES,)),
            "PrimeEcho's first-turn anchor (algo.alpha=0)",
        ),
        # Buffered Dynamic Retry: p = 0, so the task feed never serves a repair task from the retry
        # buffer (all-failed groups still enter it). Counter: repair tasks served (replay/retry_served).
        Arm(
            "no_bdr",
            ("replay.retry.probability=0",),
            Counter("BDR repair tasks served", total=(mk.REPLAY_RETRY_SERVED,)),
            "Buffered Dynamic Retry (replay.retry.probability=0)",
        ),
        # MirrorPop: neither the sequence filter nor the token bound. Counter: sequences dropped plus
        # tokens masked (train/mirrorpop_dropped + train/mirrorpop_token_masked).
        Arm(
            "no_mirrorpop",
            ("algo.mirrorpop_delta=null", "algo.mirrorpop_token_delta=null"),
            Counter(
                "MirrorPop drops + token masks", summed=(mk.TRAIN_MIRRORPOP_DROPPED, mk.TRAIN_MIRRORPOP_TOKEN_MASKED)
            ),
            "MirrorPop (algo.mirrorpop_delta=null, algo.mirrorpop_token_delta=null)",
        ),
        # Per-turn credit: every turn trained with the episode's advantage. Counter: turns after the
        # first credited with their own advantage (replay/turn_credited_turns).
        Arm(
            "no_turn_credit",
            ("algo.turn_credit=episode",),
            Counter("turns credited on their own", total=(mk.REPLAY_TURN_CREDITED_TURNS,)),
            "per-turn credit (algo.turn_credit=episode)",
        ),
        # Performance turns: a slow pass ends its attempt. Counter: performance turns taken
        # (rollout/optimize_turns: turns that follow a passed turn).
        Arm(
            "no_perf_turns",
            ("rollout.optimize_turns=0",),
            Counter("performance turns", summed=(mk.ROLLOUT_OPTIMIZE_TURNS,)),
            "performance turns (rollout.optimize_turns=0)",
        ),
        # Dynamic sampling: tied groups are trained like any other. Counter: groups filtered as tied
        # (replay/filtered_groups/tied).
        Arm(
            "no_dynamic_sampling",
            ("algo.drop_tied_groups=false",),
            Counter("tied groups filtered", total=(mk.replay_filtered_groups("tied"),)),
            "dynamic sampling (algo.drop_tied_groups=false)",
        ),
    )
}


class ArmError(ValueError):
    """An arm name that is not in ARMS."""


def select(names: str | None) -> list[Arm]:
    """The arms named in a comma list (None: all), `full` always first."""
    if names is None:
        return list(ARMS.values())
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in ARMS]
    if unknown or not wanted:
        raise ArmError(f"unknown arm {', '.join(unknown) or '(none given)'}; arms: {', '.join(ARMS)}")
    return [ARMS["full"]] + [ARMS[n] for n in ARMS if n in wanted and n != "full"]
