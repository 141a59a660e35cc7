"""Every message that crosses an actor boundary in Kiln (docs/architecture.md).

One record type per message. Arrays are numpy arrays (or CPU torch tensors where noted) and travel
out of band, so token ids and log-probabilities never pass through Python lists.
"""

from __future__ import annotations

from dataclasses import field
from typing import ClassVar, Literal

import numpy as np

from protocols.schema import FloatArray, IntArray, JsonDict, MaskArray, Record, record

Backend = Literal["cuda", "cpu", "musa"]
# Furthest verifier stage a candidate reached (each stage gates the next; "done" = all passed).
Stage = Literal["extract", "compile", "run", "correctness", "legality", "performance", "done"]
# Why a candidate failed; None when it passed. "infra" is the system's fault, never the policy's.
ErrorClass = Literal["extract", "compile", "runtime", "timeout", "correctness", "cheating", "infra"]
ERROR_CLASSES: tuple[str, ...] = ErrorClass.__args__


# ----------------------------------------------------------------------------------------- tasks


@record
class KernelSpec(Record):
    """What a `kind="kernel"` task asks for: a faster native version of a PyTorch reference."""

    name: str
    reference: str  # source of the KernelBench-format reference module (Model, get_inputs, ...)
    backend: Backend
    level: int
    source_path: str = ""  # where the reference was loaded from, for humans and reports
    # Who wrote the reference: the operator's task set (trusted: it runs in the verifier's process) or a
    # client of the verifier service (untrusted code, like a candidate: it runs jailed). Set by the
    # service for every reference a request carries, never by the client.
    reference_origin: Literal["task_set", "client"] = "task_set"

    def check(self) -> None:
        if not self.reference.strip():
            raise ValueError("reference source is empty")
        if self.level < 0:
            raise ValueError(f"level must be >= 0, got {self.level}")


@record
class RepairContext(Record):
    """Buffered Dynamic Retry: a failed attempt and its feedback, served back as a repair task."""

    failed_code: str
    feedback: str
    attempt: int  # how many times this task has been served from the retry buffer
    origin_group: str  # group id whose samples all failed


@record
class Task(Record):
    """A unit of work for a rollout actor. Only kind="kernel" carries a KernelSpec, so a task of
    another reward actor's kind can never pose as a kernel task."""

    task_id: str
    kind: str
    split: Literal["train", "val"] = "train"
    kernel: KernelSpec | None = None
    payload: JsonDict = field(default_factory=dict)  # data for non-kernel reward actors; empty for kernel tasks
    repair: RepairContext | None = None

    def check(self) -> None:
        if not self.task_id:
            raise ValueError("task_id is empty")
        if not self.kind:
            raise ValueError("kind is empty")
        if (self.kind == "kernel") != (self.kernel is not None):
            raise ValueError("a KernelSpec goes with kind='kernel' and only with it")


@record
class TaskRequest(Record):
    """A rollout actor asks the task feed for work."""

    actor_id: str
    # "val" asks for held-out validation tasks: served outside admission control, never trained on.
    split: Literal["train", "val"] = "train"
    # The asking process (a replacement keeps its actor's id): once replay released a dead actor's
    # groups, its requests still queued or held must not open groups that nobody works on.
    incarnation: str = ""


@record
class TaskReply(Record):
    """The task feed's answer: a task to sample `group_size` times, or wait, or stop."""

    status: Literal["task", "wait", "stop"]
    task: Task | None = None
    group_id: str = ""
    group_size: int = 0
    retry_after_s: float = 0.0

    def check(self) -> None:
        if (self.status == "task") != (self.task is not None):
            raise ValueError("status 'task' goes with a task and only with it")
        if self.status == "task" and (not self.group_id or self.group_size < 1):
            raise ValueError("a task reply needs a group_id and group_size >= 1")
        if self.retry_after_s < 0:
            raise ValueError("retry_after_s must be >= 0")


@record
class TaskListRequest(Record):
    """Ask replay for a whole split of its task set: the learner's warm start reads the training
    tasks, an evaluation the validation tasks. Replay owns the task set and its split, so every actor
    sees the same one."""

    split: Literal["train", "val"]


@record
class TaskList(Record):
    split: Literal["train", "val"]
    tasks: list[Task]


# ------------------------------------------------------------------------------------ verifier


@record
class VerifyRequest(Record):
    """Verify one candidate (raw model output or plain source) against its task."""

    request_id: str
    task: Task
    candidate: str
    episode_id: str = ""
    turn: int = 0


@record
class VerifyResult(Record):
    """The verifier's verdict: stage reached, error class, q, speedups, MooreEval score, feedback."""

    request_id: str
    task_id: str
    passed: bool
    stage: Stage
    error_class: ErrorClass | None
    q: float  # fraction of correctness trials passed, in [0, 1]
    score: float  # MooreEval reward s
    speedup_eager: float | None = None
    speedup_compile: float | None = None
    feedback: str = ""  # short natural-language text, the next repair turn's prompt
    diagnostics: JsonDict = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage
    source_hash: str = ""
    cached: bool = False

    def check(self) -> None:
        if not 0.0 <= self.q <= 1.0:
            raise ValueError(f"q must lie in [0, 1], got {self.q}")
        if self.passed and self.error_class is not None:
            raise ValueError("a passed result has no error_class")
        if not self.passed and self.error_class is None:
            raise ValueError("a failed result names its error_class")


def infra_result(request: VerifyRequest, message: str) -> VerifyResult:
    """The answer when the system failed, not the candidate (the verifier did not answer, a reward actor
    raised or hung): score 0 and error class "infra", so replay excludes it from training. The verifier
    builds it, and so does a rollout actor whose verifier never answered."""
    return VerifyResult(
        request_id=request.request_id,
        task_id=request.task.task_id,
        passed=False,
        stage="run",
        error_class="infra",
        q=0.0,
        score=0.0,
        feedback=f"Verifier infrastructure error (not caused by the candidate): {message}",
        diagnostics={"error": message},
    )


# ------------------------------------------------------------------------------------ episodes


# What a turn's prompt asked: the task, a repair after a failed verdict, or a faster version of a
# kernel that passed but was slow (a performance turn).
TurnKind = Literal["first", "repair", "optimize"]


@record(schema=2)
class Turn(Record):
    """One prompt -> response step of an episode, with exact behaviour log-probabilities."""

    prompt_ids: IntArray
    response_ids: IntArray
    logprobs: FloatArray  # log softmax(logits / T) of each sampled token (docs/rollout.md)
    versions: IntArray  # weight version that produced each response token
    finish_reason: Literal["stop", "length", "abort"]
    # The decoded answer without its thinking: what the verifier saw, what later turns show as the
    # assistant's message, what the retry buffer keeps.
    text: str = ""
    reasoning: str = ""  # the response's thinking text (a thinking model's <think> block); never verified
    kind: TurnKind = "first"
    result: VerifyResult | None = None

    def check(self) -> None:
        n = len(self.response_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"response_ids, logprobs and versions differ in length "
                f"({n}, {len(self.logprobs)}, {len(self.versions)})"
            )


@record(schema=2)
class Episode(Record):
    """One sample of a group: all its turns and their per-turn rewards s_k."""

    episode_id: str
    task: Task
    group_id: str
    sample_index: int
    turns: list[Turn]
    rewards: list[float]  # per-turn scores from the verifier / reward actor
    is_retry: bool = False
    actor_id: str = ""
    # Why the rollout could not pose this task at all (its first prompt alone does not fit
    # model.max_seq_len, or it has no prompt); "" = served. Replay takes such a task out of the feed.
    unservable: str = ""

    def check(self) -> None:
        if not self.episode_id or not self.group_id:
            raise ValueError("episode_id and group_id must be set")
        if not self.turns:
            raise ValueError("an episode has at least one turn")
        if len(self.rewards) != len(self.turns):
            raise ValueError(f"{len(self.rewards)} rewards for {len(self.turns)} turns")


@record
class EpisodeAck(Record):
    """Replay's receipt for an episode, sent only after the episode is stored durably."""

    episode_id: str
    status: Literal["stored", "duplicate", "rejected"]
    reason: str = ""


# ------------------------------------------------------------------------------------- learner


@record
class BatchRequest(Record):
    """The learner asks replay for a batch at its current weight version."""

    learner_id: str
    version: int
    # A learner restored from a checkpoint at version c continues at `version` > c: the versions in
    # (discarded_above, version) were rolled back, so replay filters the samples they produced
    # (`rolled_back`). Sent until replay first answers (it logs the request first); -1 = none.
    discarded_above: int = -1
    # RL steps in the history of these weights: the run ends at algo.total_steps of them. A rollback
    # loses steps but never version numbers (a version never names two weights), so after one the
    # step is below the version. -1 = the version (no rollback).
    step: int = -1

    @property
    def steps_taken(self) -> int:
        return self.version if self.step < 0 else self.step

    def check(self) -> None:
        if self.discarded_above >= self.version:
            raise ValueError(f"discarded_above {self.discarded_above} must be below version {self.version}")
        if self.step > self.version:
            raise ValueError(f"step {self.step} must not exceed version {self.version}")


@record
class TrainBatch(Record):
    """Sequences packed end to end; `cu_seqlens` holds the S+1 sequence boundaries."""

    version: int  # learner version this batch was assembled for
    episode_ids: list[str]  # [S], the episode each sequence comes from (one sequence per gradient-carrying turn)
    tokens: IntArray  # [N]
    cu_seqlens: IntArray  # [S + 1]
    loss_mask: MaskArray  # [N], 1 on gradient-carrying tokens
    behaviour_logprobs: FloatArray  # [N], μ; 0 where no token was sampled
    advantages: FloatArray  # [S], one per sequence
    versions: IntArray  # [N], producing weight version per token; -1 on prompt tokens

    def check(self) -> None:
        n, s = len(self.tokens), len(self.advantages)
        if len(self.cu_seqlens) != s + 1:
            raise ValueError(f"cu_seqlens has {len(self.cu_seqlens)} entries for {s} sequences")
        for name in ("loss_mask", "behaviour_logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} tokens")
        if s and (self.cu_seqlens[0] != 0 or self.cu_seqlens[-1] != n or np.any(np.diff(self.cu_seqlens) < 0)):
            raise ValueError("cu_seqlens must rise from 0 to the token count")


@record
class BatchReply(Record):
    status: Literal["batch", "wait", "stop"]
    batch: TrainBatch | None = None
    retry_after_s: float = 0.0

    def check(self) -> None:
        if (self.status == "batch") != (self.batch is not None):
            raise ValueError("status 'batch' goes with a batch and only with it")


@record
class VersionsSeenRequest(Record):
    """A restored learner asks replay for the highest weight version it has seen, to continue above it."""

    learner_id: str


@record
class VersionsSeen(Record):
    highest: int  # over learner batch requests and episode tokens (0 before any)


# ------------------------------------------------------------------------------------- weights


@record
class TensorSpec(Record):
    name: str  # HF parameter name
    dtype: str
    shape: list[int]


@record
class WeightAnnouncement(Record):
    """A new weight version is available; `transport` says how engines fetch it."""

    version: int
    manifest: list[TensorSpec]
    transport: Literal["nccl", "cuda_ipc", "gloo", "disk"]
    location: str = ""  # a directory for "disk", a rendezvous address for process groups
    bucket_bytes: int = 0
    # Process groups: every bucket holds one dtype and travels as one flat tensor, its tensors
    # concatenated in order (protocols.weights.plan_buckets(..., by_dtype=True)); False: one broadcast
    # per tensor.
    flat: bool = False


@record
class WeightRequest(Record):
    """A late or restarted engine asks for the current weights before it serves."""

    engine_id: str
    have_version: int = -1
    # "" = the learner's own transport (join its process group / get CUDA IPC handles); "disk" = the
    # fallback when that failed: the current version written as an HF checkpoint directory.
    transport: Literal["", "disk"] = ""


@record
class WeightHandles(Record):
    """CUDA IPC (same GPU): the learner's answer to a WeightRequest, one handle per bucket of `version`
    (`torch.multiprocessing.reductions.reduce_tensor` of a flat uint8 buffer, pickled). The buckets are
    `protocols.weights.plan_buckets(manifest, bucket_bytes)` (the engine checks that the counts agree);
    an engine rebuilds, copies and confirms."""

    version: int
    manifest: list[TensorSpec]
    bucket_bytes: int
    handles: list[bytes]

    transport: ClassVar[str] = "cuda_ipc"  # the transport that answers with handles (implied, not sent)


@record
class WeightsLoaded(Record):
    """An engine confirms the version it now serves (or why it could not load it)."""

    engine_id: str
    version: int
    ok: bool
    error: str = ""
    seconds: float = 0.0


# ----------------------------------------------------------------------------- control, metrics


@record(schema=2)
class Control(Record):
    """The learner's one command on its announcement channel (colocated mode): "pause" asks every
    engine to give its accelerator memory back for the learner's step; the next `WeightAnnouncement`
    brings it back. Liveness and the rest of control go through Ray (the actors' health records)."""

    command: Literal["pause"]


@record
class EngineHealth(Record):
    """What an inference engine reports of itself (`Engine.health()`): carried in the rollout actor's
    health record, served by the embedded engine's HTTP front (/server_info), read by the weight
    client (alive, released) and the benchmarks (tokens, steps). The counters are the embedded torch
    engine's; an engine that does not count a thing (an SGLang server behind its client) reports 0."""

    alive: bool
    version: int = -1  # the weight version it serves; -1 when the engine does not say
    url: str = ""  # an HTTP engine's address
    error: str = ""  # why it is not alive, when known
    queued: int = 0  # requests waiting for a batch slot
    running: int = 0  # requests in the batch now
    paused: bool = False  # generation paused (a weight update in place)
    released: bool = False  # colocated: its accelerator memory given back for a learner step
    requests: int = 0  # requests received
    tokens: int = 0  # tokens generated
    steps: int = 0  # decode steps
    queued_steps: int = 0  # decode steps taken while requests waited in the engine's queue
    queued_rows: int = 0  # rows those steps decoded (÷ queued_steps: the batch's fill when work waits)
    graph_steps: int = 0  # decode steps replayed from a CUDA graph
    rebuilds: int = 0  # live rows prefilled again, each into its own slot (after new weights, or memory back)
    inserted: int = 0  # requests admitted into a free slot
    prefilled: int = 0  # context tokens the prefill computed (rows of one context share its prefill)
    placed: int = 0  # context tokens written into slots (÷ prefilled: rows served per prefilled token)
    updates: int = 0  # weight versions loaded
    aborted: int = 0  # requests aborted


@record(schema=2)
class Metrics(Record):
    source: str
    step: int
    ts: float
    values: dict[str, float]
    # episode ids by what the step did with them ("trained", "mirrorpop_dropped"), for the driver's dumps
    episodes: dict[str, list[str]] = field(default_factory=dict)


@record
class GroupReport(Record):
    """What a rollout actor did for one task group, pushed to the driver for the live view and the
    report (the episodes themselves go to replay; a few are sampled to the driver for dumps)."""

    actor_id: str
    group_id: str
    task_id: str
    is_retry: bool
    turn_scores: list[list[float]]  # per episode, the score s_k of each turn
    turn_passed: list[list[bool]]  # per episode, whether each turn passed
    stages: list[str]  # stage reached by every verified attempt (all turns)
    error_classes: list[str]  # error class of every failed attempt
    source_hashes: list[str]  # compiled source hash of every attempt that had one
    generated_tokens: int
    seconds: float  # wall time of the whole group (generation + verification, all turns)

    def check(self) -> None:
        if len(self.turn_scores) != len(self.turn_passed):
            raise ValueError("turn_scores and turn_passed differ in length")


# Activities of an actor's timeline (the benchmark's Gantt rows). "waiting" is what an actor does when
# it records none of the others: no actor records it, the timeline shows it as the gaps.
Activity = Literal["generating", "verifying", "training", "syncing"]


@record
class Span(Record):
    """One stretch of an actor's work on the timeline: from the first of the overlapping units of work
    (generate calls, verifications, learner steps) that it covers to the end of the last; times are
    wall-clock seconds (time.time()), comparable across processes and hosts."""

    activity: Activity
    start: float
    end: float
    units: int = 1  # units of work that began within it

    def check(self) -> None:
        if not self.end >= self.start:
            raise ValueError(f"span ends at {self.end} before it starts at {self.start}")
        if self.units < 0:
            raise ValueError(f"units must be >= 0, got {self.units}")


@record
class Timeline(Record):
    """An actor's spans since its last push, sent to the driver's metrics socket
    (protocols.timeline.SpanRecorder)."""

    actor_id: str
    spans: list[Span]


@record
class ErrorReply(Record):
    """Sent back on a request/reply channel when the request could not be decoded or handled."""

    message: str
