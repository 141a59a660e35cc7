"""The keys of a run's metric rows: one name per figure, in one place.

A metric row is a flat `{key: float}` (the `Metrics` record's `values`, a line of RUN_DIR/metrics.jsonl,
a TensorBoard scalar). The learner writes its step's figures, the driver aggregates the rollout side's
group reports, replay's health and the progress rows, and the live view, the report, `kiln sft`,
`kiln eval` and the benchmarks read them back. Each writer and reader imports its keys from here, so a
renamed figure is renamed everywhere at once and a reader cannot ask for a key no writer spells.

A key is `section/name`. Families with a variable last part (a verdict class, a filter reason, an
actor) have a prefix constant and a function that builds one member; readers match the prefix.
This module is torch-free and imports nothing, so actors and `launch/` alike can import it.
"""

from __future__ import annotations

# ---------------------------------------------------------------------------- learner, per RL step

TRAIN = "train/"  # the step's algorithm figures (`StepResult.metrics`), each under this prefix


def train(name: str) -> str:
    """The key of one of the step's algorithm figures (`StepResult.metrics[name]`)."""
    return TRAIN + name


TRAIN_LOSS = train("loss")  # policy loss, mean over the step's updates
TRAIN_GRAD_NORM = train("grad_norm")  # mean over the step's updates
TRAIN_GRAD_NORM_MAX = train("grad_norm_max")
TRAIN_STEP_S = train("step_s")  # seconds of the step
TRAIN_TOKENS = train("tokens")  # tokens in the batch
TRAIN_TRAINED_TOKENS = train("trained_tokens")  # tokens that carried gradient
TRAIN_TOKENS_PER_S = train("tokens_per_s")
TRAIN_SEQUENCES = train("sequences")  # sequences in the batch
TRAIN_OFF_POLICY_KEPT = train("off_policy_kept")  # kept sequences made by an older version than the batch's
TRAIN_KEPT_FRACTION = train("kept_fraction")  # MirrorPop: share of sequences kept
TRAIN_MIRRORPOP_DROPPED = train("mirrorpop_dropped")  # MirrorPop: sequences dropped
TRAIN_MIRRORPOP_TOKEN_MASKED = train("mirrorpop_token_masked")  # MirrorPop: tokens of kept sequences masked (δ_tok)
TRAIN_ENTROPY = train("entropy")  # of π_prox at the trained positions
TRAIN_RESPONSE_LENGTH = train("response_length")
TRAIN_CLIPPED = train("clipped")  # token-updates whose ratio the PPO clip cut
TRAIN_CLIP_LOW_FRACTION = train("clip_low_fraction")
TRAIN_CLIP_HIGH_FRACTION = train("clip_high_fraction")
TRAIN_IS_TRUNCATED = train("is_truncated")  # tokens whose importance weight was truncated at C
TRAIN_IS_TRUNCATED_FRACTION = train("is_truncated_fraction")

WEIGHTS_VERSION = "weights/version"  # the version the step made
WEIGHTS_SYNC_S = "weights/sync_s"  # seconds of its push to the engines

# ---------------------------------------------------------------------------- supervised steps

SFT_LOSS = "sft/loss"
SFT_STEP_S = "sft/step_s"
SFT_GRAD_NORM = "sft/grad_norm"
SFT_TOKENS = "sft/tokens"
SFT_TRAINED_TOKENS = "sft/trained_tokens"
SFT_EPOCH = "sft/epoch"
SFT_LR = "sft/lr"
SFT_HELDOUT_LOSS = "sft/heldout_loss"
# The learner's warm start, once, when it ends (`WarmStartReport`)
SFT_FIRST_LOSS = "sft/first_loss"
SFT_FINAL_LOSS = "sft/final_loss"
SFT_STEPS = "sft/steps"
SFT_SECONDS = "sft/seconds"

# ---------------------------------------------------------------------------- rollout side, per step window

ROLLOUT_SAMPLES = "rollout/samples"
ROLLOUT_GROUPS = "rollout/groups"
ROLLOUT_REPAIR_PASSES = "rollout/repair_passes"  # episodes whose repair turn passed after a failed turn
# Turns of the window's episodes (a turn after a failed turn is a repair turn, one after a passed turn a
# performance turn: a pass ends an attempt unless it was slow)
ROLLOUT_FIRST_TURN_PASSES = "rollout/first_turn_passes"  # episodes whose first turn passed
ROLLOUT_REPAIR_TURNS = "rollout/repair_turns"
ROLLOUT_REPAIR_TURN_PASSES = "rollout/repair_turn_passes"  # repair turns that passed
ROLLOUT_OPTIMIZE_TURNS = "rollout/optimize_turns"  # performance turns taken
# PrimeEcho's anchor at work: episodes whose first turn scored below their best (α > 0), so the first
# turn pulled the reward below the best turn's score (plus bonus); none when α = 0
ROLLOUT_ANCHORED_EPISODES = "rollout/anchored_episodes"
ROLLOUT_SAMPLES_PER_S = "rollout/samples_per_s"
ROLLOUT_TOKENS_PER_S = "rollout/tokens_per_s"
REWARD_MEAN = "reward/mean"
REWARD_PASS_RATE = "reward/pass_rate"
REPLAY_BDR_SHARE = "replay/bdr_share"  # share of the window's groups that were repair groups (BDR)

VERIFIER = "verifier/"  # verdicts of the window's verified attempts, by stage reached and error class
VERIFIER_DONE = "verifier/done"  # attempts that passed every stage
VERIFIER_ERROR = "verifier/error/"


def verifier_stage(stage: str) -> str:
    return VERIFIER + stage


def verifier_error(error_class: str) -> str:
    return VERIFIER_ERROR + error_class


# Whole-run counts
RUN_GROUPS = "run/groups"
RUN_UNTIED_GROUPS = "run/untied_groups"
RUN_DISTINCT_SOURCES = "run/distinct_sources"
RUN_RESTARTS = "run/restarts"

BUSY = "busy/"  # an actor's share of the window spent inside its timeline spans


def busy(actor: str) -> str:
    return BUSY + actor


BUSY_LEARNER = busy("learner")

# ---------------------------------------------------------------------------- replay, per step

STALENESS_MEAN = "staleness/mean"
STALENESS_MAX = "staleness/max"
STALENESS_LAG = "staleness/lag_"  # trained samples by how many versions they lagged


def staleness_lag(lag: int) -> str:
    return f"{STALENESS_LAG}{lag}"


REPLAY_EMITTED = "replay/emitted"
REPLAY_TRAINED = "replay/trained"
REPLAY_FILTERED = "replay/filtered"
REPLAY_PENDING = "replay/pending"
REPLAY_INVARIANT_OK = "replay/invariant_ok"  # 1.0 while emitted = trained + filtered + pending
REPLAY_RETRY_BUFFER = "replay/retry_buffer"
REPLAY_RETRY_ADMITTED = "replay/retry_admitted"
REPLAY_RETRY_SERVED = "replay/retry_served"
REPLAY_RETRY_TRAINED = "replay/retry_trained"
# trained turns after the first that carried their own per-turn advantage (0 with algo.turn_credit=episode
# or algo.train_turns=first): the ablation of per-turn credit checks it
REPLAY_TURN_CREDITED_TURNS = "replay/turn_credited_turns"
REPLAY_FILTERED_GROUPS = "replay/filtered_groups/"


def replay_filtered_groups(reason: str) -> str:
    return REPLAY_FILTERED_GROUPS + reason


# ---------------------------------------------------------------------------- progress rows (wall clock)

PROGRESS = "progress/"
PROGRESS_ELAPSED_S = "progress/elapsed_s"  # marks a progress row
PROGRESS_GROUPS = "progress/groups"
PROGRESS_EPISODES = "progress/episodes"
PROGRESS_TRAINABLE = "progress/trainable"
PROGRESS_RETRY_BUFFER = "progress/retry_buffer"
PROGRESS_PASS_RATE = "progress/pass_rate"
PROGRESS_DECODED_TOKENS_PER_S = "progress/decoded_tokens_per_s"
PROGRESS_FILTERED = "progress/filtered/"
PROGRESS_VERDICT = "progress/verdict/"


def progress_filtered(reason: str) -> str:
    return PROGRESS_FILTERED + reason


def progress_verdict(outcome: str) -> str:
    return PROGRESS_VERDICT + outcome


# ---------------------------------------------------------------------------- evaluation

EVAL = "eval/"  # `kiln eval`'s summary (pass@k, avg@n, faster_*, counts), Overall then per level
EVAL_FINAL = "eval/final"  # 1.0 on the evaluation after the last step
EVAL_TASKS = "eval/tasks"
EVAL_FASTER_EAGER = "eval/faster_eager"
EVAL_FASTER_COMPILE = "eval/faster_compile"
