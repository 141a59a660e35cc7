"""Each stage of the loop alone, on the run's own model and workload (`kiln bench`, part a).

* Engine: the run's engine (`make_engine`, so the same backend and sampled lengths as in the loop,
  and the torch threads its actor has there: `rollout.torch_threads`, else a Ray actor's one),
  `requests` first-turn prompts of the run's training tasks (posed by the turn policy, with the
  rollout's stop ids) submitted at once; the engine keeps `rollout.max_batch` of them decoding and
  admits the next as rows finish.
  Capacity = tokens the engine itself counts as decoded per second while `rollout.max_batch` rows
  were decoding and more requests waited (its counters read 4× a second): the drain at the end,
  where a long tail of lengths leaves a few rows decoding alone, is not decoding at max_batch. The
  overall rate (all tokens ÷ the time until the last one finished) is reported beside it, and is
  the capacity where the batch was never seen full (an engine that reports no queue, or `requests`
  <= max_batch).
  Forced candidates are scored, not decoded, so none is submitted here. Beside it, in the same run
  (launch/bench/engine_yardsticks.py): plain HF `generate` on the same model and prompts, and the
  bound a decode step's memory traffic sets.
* Verifier: `verifier.num_actors` real `VerifierActor`s (modelled latency included) with an empty
  cache, sent `requests` attempts at once through the rollout's own verifier client. The attempts are
  the run's candidate mix: a `rollout.forced_fraction` share drawn from the forced-candidate pool,
  the rest the engine's own sampled responses from above.
  Capacity = verifications per minute with every one of the `verifier.max_concurrent_requests` worker slots
  busy: slots × actors ÷ the mean time one verification holds its slot (Little's law; each slot
  works through its verifications one after another). As for the engine, the drain at the end is
  left out: with a long-tailed modelled latency and a few requests per slot, the last slow
  verifications run nearly alone, and the overall rate (requests ÷ the time until the last reply,
  reported beside it) is mostly that drain. The slot times are taken with all slots busy at the
  start, so they include the contention of a full verifier (compiles waiting for compile workers,
  executions sharing the cores). Fewer requests than slots: the overall rate. The kernel verifier's
  precompiled headers are built before the timing starts (once per machine and toolchain, then
  reused by every run: a run's steady state, which a cold first minute would not show).
* Learner: the run's learner backend on one batch of the run's shape, on the torch threads the
  learner has in the loop: `algo.batch_groups` groups of `algo.group_size` first turns, each a
  sampled response from above or a forced candidate scored by the engine, in the run's proportion.
  One untimed step, then `steps` timed ones, all at learning rate 0: the weights stay those the
  batch was sampled with, so every step keeps what MirrorPop keeps in the first and does the same
  arithmetic (a moving policy would soon have MirrorPop drop the whole batch and leave steps that
  train nothing).
* Weight sync: the learner's `WeightServer` publishing the run's model to one engine process over
  the run's transport (gloo on CPU); the publish (until the engine received it) and publish → the
  engine's confirmation, after one untimed push.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import statistics
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from actors.policy.tokenizer import load_tokenizer
from actors.rollout.engine import GenerateRequest, Generation, SamplingParams
from actors.rollout.engines import make_engine, resolve_device
from actors.rollout.forced import CandidatePool
from actors.rollout.turns import Attempt, Prompt, TurnPolicy, TurnRules
from configs import KilnConfig
from launch.bench import engine_yardsticks
from launch.bench.engine_yardsticks import EngineYardsticks
from protocols import Episode, Task, Turn, VerifyRequest

log = logging.getLogger(__name__)

FULL_BATCH_POLL_S = 0.25  # how often the engine's counters are read while it decodes alone
PCH_WAIT_S = 600.0  # the verifier stage waits at most this long for its precompiled headers


@dataclass
class EngineStage:
    decoded_tokens_per_s: float  # the capacity: full_batch_tokens_per_s where measured, else overall
    requests: int
    decoded_tokens: int
    seconds: float
    max_batch: int
    torch_threads: int  # 0: torch's default in this process
    mean_response_tokens: float
    overall_tokens_per_s: float = 0.0  # all the decoded tokens ÷ the time until the last one finished
    full_batch_tokens_per_s: float | None = None  # while max_batch rows were decoding; None: never seen
    full_batch_s: float = 0.0  # how long the batch was seen full
    yardsticks: EngineYardsticks | None = None  # HF generate and the bandwidth bound, same run; None: not torch


@dataclass
class VerifierStage:
    verifications_per_min: float  # the capacity, all verifier actors together: with every slot busy
    per_actor_per_min: float
    requests: int
    seconds: float
    actors: int
    max_concurrent_requests: int  # per verifier actor
    forced_share: float  # of the requests, drawn from the forced-candidate pool
    compiled_share: float  # of the verifications, real compiles
    modelled_s_mean: float  # modelled GPU-side latency slept per verification
    stages: dict[str, int] = field(default_factory=dict)  # verifier stage reached -> verifications
    overall_per_min: float = 0.0  # requests ÷ the time until the last reply (the drain included)
    slot_s_mean: float = 0.0  # mean time one verification held its worker slot (modelled latency included)


@dataclass
class LearnerStage:
    step_s_median: float
    step_s: list[float]
    sequences: int
    tokens: int
    gradient_tokens: int
    torch_threads: int = 0


@dataclass
class SyncStage:
    transport: str
    bytes: int
    publish_s_median: float  # until the engine received every bucket
    confirmed_s_median: float  # until the engine confirmed the version loaded
    pushes: int


@dataclass
class Stages:
    engine: EngineStage
    verifier: VerifierStage
    learner: LearnerStage
    sync: SyncStage


@dataclass
class Workload:
    """What the stage measurements share: the tasks, the tokenizer, and the engine's sampled responses."""

    cfg: KilnConfig
    tasks: list[Task]
    tokenizer: object
    rng: random.Random
    sampled: list[tuple[Task, list[int], Generation]] = field(default_factory=list)  # (task, prompt, generation)

    @classmethod
    def of(cls, cfg: KilnConfig) -> Workload:
        from actors.buffer.task_source import load_task_set

        tasks = load_task_set(cfg.replay, cfg.verifier.backend).train
        return cls(cfg=cfg, tasks=tasks, tokenizer=load_tokenizer(cfg.model), rng=random.Random(cfg.rollout.seed))

    def params(self) -> SamplingParams:
        """The rollout actor's sampling settings, its stop ids included."""
        r = self.cfg.rollout
        return SamplingParams(
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            stop_token_ids=tuple(self.tokenizer.stop_ids),
        )

    def prompt(self, i: int) -> tuple[Task, list[int]]:
        """The first prompt of the i-th task (in turn), as the turn policy poses it in the loop."""
        policy = TurnPolicy(TurnRules.first_turn(self.cfg.rollout, self.cfg.model), self.tokenizer)
        for k in range(len(self.tasks)):
            task = self.tasks[(i + k) % len(self.tasks)]
            first = policy.next_prompt(Attempt.of(task), None)
            if isinstance(first, Prompt):
                return task, list(first.ids)
        raise ValueError("no training task fits model.max_seq_len with rollout.max_new_tokens of room")

    def forced_ids(self, text: str, prompt: list[int]) -> list[int]:
        """A forced candidate's tokens as the rollout scores them: with the end-of-turn token, cut to fit."""
        end = self.tokenizer.end_of_turn_id
        ids = self.tokenizer.encode(text) + ([int(end)] if end is not None else [])
        room = self.cfg.model.max_seq_len - len(prompt)
        return ids[: max(1, min(room, self.cfg.rollout.max_new_tokens))]

    def pool(self) -> CandidatePool | None:
        r = self.cfg.rollout
        if not r.forced_candidates:
            return None
        return CandidatePool(
            r.forced_candidates, seed=r.seed, fraction=r.forced_fraction, mix=r.forced_mix, unique=r.bench.unique_forced
        )


def measure(cfg: KilnConfig, out: Path, *, engine_requests: int, verifier_requests: int, learner_steps: int) -> Stages:
    work = Workload.of(cfg)
    with torch_threads(loop_threads(cfg.rollout.torch_threads, cfg)):
        engine = make_engine(cfg.rollout, cfg.model, index=0, eos_token_ids=list(work.tokenizer.stop_ids))
        try:
            engine_stage = measure_engine(engine, work, engine_requests)
            log.info("engine alone: %.1f decoded tok/s", engine_stage.decoded_tokens_per_s)
            engine_stage.yardsticks = engine_yardsticks.measure(
                engine, [p for _, p, _ in work.sampled], engine_stage.mean_response_tokens, cfg.rollout.temperature
            )
            batch = learner_batch(engine, work)
        finally:
            engine.close()
    verifier_stage = measure_verifier(work, verifier_requests, out / "verifier-cache")
    log.info("verifier alone: %.1f verifications/min", verifier_stage.verifications_per_min)
    with torch_threads(loop_threads(cfg.learner.torch_threads, cfg)):
        learner_stage = measure_learner(cfg, batch, learner_steps)
    log.info("learner alone: %.2f s/step", learner_stage.step_s_median)
    sync_stage = measure_sync(cfg)
    log.info("weight sync alone: %.3f s", sync_stage.publish_s_median)
    return Stages(engine=engine_stage, verifier=verifier_stage, learner=learner_stage, sync=sync_stage)


def loop_threads(configured: int, cfg: KilnConfig) -> int:
    """The torch intra-op threads an actor has in the loop: its `torch_threads` setting, else a Ray
    actor's default (one), else (in-process) this process's."""
    import torch

    if configured:
        return configured
    return 1 if cfg.cluster.use_ray else torch.get_num_threads()


@contextlib.contextmanager
def torch_threads(n: int):
    """This process's intra-op pool at `n` threads inside the block (a stage measured as the loop runs it)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------------------------- engine


def measure_engine(engine, work: Workload, requests: int, poll_s: float = FULL_BATCH_POLL_S) -> EngineStage:
    """The requests all at once. With a long tail of lengths the batch drains at the end (a few long
    responses decode alone), which is no longer decoding at max_batch: the engine's counters, read
    every `poll_s` while it runs, give the rate over the stretch in which max_batch rows
    were decoding and more waited, and that is the capacity. An engine that reports no queue (SGLang),
    or `requests` <= max_batch, gets the overall rate."""
    r, params = work.cfg.rollout, work.params()
    # Warm-up: a forced scoring and a two-token generation build whatever the first calls build (the
    # slot cache; on GPU the decode step, compiled and captured). The generation goes to the engine
    # under the benchmark's length wrapper, so the measured requests draw the loop's lengths.
    _task, prompt = work.prompt(0)
    bare = engine
    while hasattr(bare, "inner"):
        bare = bare.inner
    warm = time.perf_counter()
    bare.generate(
        [
            GenerateRequest("warm", prompt, params, forced_response=prompt[:8]),
            GenerateRequest("warm-decode", prompt, dataclasses.replace(params, max_new_tokens=2)),
        ]
    )
    log.info("engine warm-up (the first scoring and decode steps): %.1f s", time.perf_counter() - warm)
    asked = [work.prompt(i) for i in range(requests)]
    before = engine.health().tokens
    readings: list[tuple[float, int, bool]] = []  # (time, decoded so far, max_batch rows decoding)
    done = threading.Event()

    def watch() -> None:
        while not done.wait(poll_s):
            h = engine.health()
            # Full while requests still wait: the engine refills a finished row's slot from the queue at
            # the next step.
            full = h.queued > 0 and h.running >= r.max_batch
            readings.append((time.perf_counter(), h.tokens, full))

    watcher = threading.Thread(target=watch, name="kiln-bench-engine-watch", daemon=True)
    started = time.perf_counter()
    watcher.start()
    try:
        gens = engine.generate([GenerateRequest(f"bench-{i}", p, params) for i, (_, p) in enumerate(asked)])
    finally:
        done.set()
        watcher.join()
    seconds = time.perf_counter() - started
    decoded = engine.health().tokens - before
    if decoded <= 0:  # an engine that does not count (SGLang reports no counter): count what came back
        decoded = sum(len(g.output_ids) for g in gens)
    work.sampled = [(t, p, g) for (t, p), g in zip(asked, gens, strict=True)]
    full = [(t, n) for t, n, is_full in readings if is_full]
    full_rate, full_s = None, 0.0
    if len(full) >= 2 and full[-1][0] > full[0][0]:
        full_s = full[-1][0] - full[0][0]
        full_rate = (full[-1][1] - full[0][1]) / full_s
    import torch

    overall = decoded / seconds
    return EngineStage(
        decoded_tokens_per_s=full_rate if full_rate else overall,
        requests=requests,
        decoded_tokens=decoded,
        seconds=seconds,
        max_batch=r.max_batch,
        torch_threads=torch.get_num_threads(),
        mean_response_tokens=decoded / max(requests, 1),
        overall_tokens_per_s=overall,
        full_batch_tokens_per_s=full_rate,
        full_batch_s=full_s,
    )


# ------------------------------------------------------------------------------------ learner


def learner_batch(engine, work: Workload):
    """One batch of the run's shape: B groups of G first turns; each attempt is forced with the pool's
    probability (its candidate scored by the engine) or one of the engine's sampled responses."""
    from actors.buffer.packing import pack_batch

    cfg, pool = work.cfg, work.pool()
    params = work.params()
    episodes, sampled = [], iter(work.sampled * (1 + cfg.algo.batch_groups * cfg.algo.group_size))
    for g in range(cfg.algo.batch_groups):
        for i in range(cfg.algo.group_size):
            task, prompt, gen = next(sampled)
            text = pool.draw(task) if pool is not None else None
            if text is not None:
                forced = work.forced_ids(text, prompt)
                (gen,) = engine.generate([GenerateRequest(f"forced-{g}-{i}", prompt, params, forced_response=forced)])
            turn = Turn(
                prompt_ids=np.asarray(prompt, np.int64),
                response_ids=gen.output_ids,
                logprobs=gen.logprobs,
                versions=gen.versions,
                finish_reason=gen.finish_reason,
            )
            episodes.append(
                Episode(
                    episode_id=f"bench-{g}/{i}",
                    task=task,
                    group_id=f"bench-{g}",
                    sample_index=i,
                    turns=[turn],
                    rewards=[0.0],
                )
            )
    advantages = work.rng.choices([-1.0, 1.0], k=len(episodes))  # any non-zero advantages: every token trains
    return pack_batch(episodes, [[a] for a in advantages], version=0, train_turns=cfg.algo.train_turns)


def measure_learner(cfg: KilnConfig, batch, steps: int) -> LearnerStage:
    import dataclasses

    from actors.learner.backends import make_trainer

    device = resolve_device(cfg.learner.device)
    learner = dataclasses.replace(cfg.learner, lr=0.0)
    trainer = make_trainer(cfg.model, learner, cfg.algo, temperature=cfg.rollout.temperature, device=device)
    trainer.train_step(batch)  # untimed: allocations, the optimizer's state
    times, result = [], None
    for _ in range(steps):
        started = time.perf_counter()
        result = trainer.train_step(batch)
        times.append(time.perf_counter() - started)
    import torch

    return LearnerStage(
        step_s_median=statistics.median(times),
        step_s=times,
        sequences=len(batch.advantages),
        tokens=int(result.tokens),
        gradient_tokens=int(result.trained_tokens),
        torch_threads=torch.get_num_threads(),
    )


# ----------------------------------------------------------------------------------- verifier


def verify_requests(work: Workload, n: int) -> tuple[list[VerifyRequest], int]:
    """`n` attempts of the run's mix, and how many of them are forced: forced candidates in the pool's
    proportion, the engine's sampled responses otherwise."""
    pool, requests, forced = work.pool(), [], 0
    for i in range(n):
        task, _, gen = work.sampled[i % len(work.sampled)]
        text = pool.draw(task) if pool is not None else None
        forced += text is not None
        candidate = text if text is not None else work.tokenizer.split_response(gen.output_ids).answer
        requests.append(
            VerifyRequest(
                request_id=f"bench-{i}-{uuid.uuid4().hex[:8]}", task=task, candidate=candidate, episode_id=f"bench-{i}"
            )
        )
    return requests, forced


def measure_verifier(work: Workload, n: int, cache: Path) -> VerifierStage:
    import dataclasses

    from actors.rollout.episodes import Verifier
    from actors.verifier.actor import VerifierActor
    from actors.verifier.verifier import KernelVerifier

    class SlotTimedVerifier(VerifierActor):
        """A verifier actor that records how long each verification holds its worker slot."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.slot_s: list[float] = []

        def verify(self, request: VerifyRequest):
            started = time.perf_counter()
            try:
                return super().verify(request)
            finally:
                self.slot_s.append(time.perf_counter() - started)  # list.append: safe across worker threads

    cfg = work.cfg
    vcfg = dataclasses.replace(cfg.verifier, cache_dir=str(cache / uuid.uuid4().hex[:8]))
    actors = [SlotTimedVerifier(vcfg) for _ in range(vcfg.num_actors)]
    for actor in actors:
        actor.start()
    requests, forced = verify_requests(work, n)
    client = Verifier(
        ",".join(a.server.address for a in actors),
        timeout_s=cfg.rollout.verify_reply_timeout_s,
        retries=cfg.rollout.verify_retries,
        concurrency=max(n, 1),
    )
    try:
        warm = VerifyRequest(request_id="warm", task=requests[0].task, candidate="no code", episode_id="warm")
        client.verify(warm)  # untimed: the sandbox and build services start on first use
        for actor in actors:  # and the precompiled headers every build uses (built once per machine)
            if isinstance(actor.impl, KernelVerifier):
                actor.impl.builds.wait_pch(PCH_WAIT_S)
        before = [a.health() for a in actors]
        for actor in actors:
            actor.slot_s.clear()  # the warm-up's verification is not timed
        started = time.perf_counter()
        results = client.verify_all(requests)
        seconds = time.perf_counter() - started
        after = [a.health() for a in actors]
    finally:
        client.close()
        for actor in actors:
            actor.stop()
    compiled = sum(a.compiled - b.compiled for a, b in zip(after, before, strict=True))
    modelled = sum(a.modelled_s - b.modelled_s for a, b in zip(after, before, strict=True))
    stages: dict[str, int] = {}
    for res in results:
        stages[res.stage] = stages.get(res.stage, 0) + 1
    overall = 60.0 * n / seconds
    slot_s = [s for a in actors for s in a.slot_s]
    slot_mean = statistics.fmean(slot_s) if slot_s else 0.0
    slots = vcfg.max_concurrent_requests * len(actors)
    per_min = 60.0 * slots / slot_mean if n > slots and slot_mean > 0 else overall
    return VerifierStage(
        verifications_per_min=per_min,
        per_actor_per_min=per_min / len(actors),
        requests=n,
        seconds=seconds,
        actors=len(actors),
        max_concurrent_requests=vcfg.max_concurrent_requests,
        forced_share=forced / max(n, 1),
        compiled_share=compiled / max(n, 1),
        modelled_s_mean=modelled / max(n, 1),
        stages=stages,
        overall_per_min=overall,
        slot_s_mean=slot_mean,
    )


# -------------------------------------------------------------------------------- weight sync


def measure_sync(cfg: KilnConfig, pushes: int = 3) -> SyncStage:
    """The learner's `WeightServer`, set up as the learner sets it up, publishing the run's model to one
    `TorchEngine` + `WeightClient` in its own process; `pushes` timed pushes after one untimed one
    (set-up: the group join, the engine's staging)."""
    import tempfile

    from actors.learner.weight_sync import WeightServer
    from actors.policy.model import build_model
    from actors.policy.weights import choose_transport
    from launch.bench.weight_sync import EngineProcess

    device = resolve_device(cfg.learner.device)
    colocated = cfg.cluster.layout == "colocated"
    ws = cfg.learner.weight_sync
    transport = choose_transport(ws.transport, device, colocated)
    engine_device = device
    if device.startswith("cuda") and not colocated:
        import torch

        engine_device = "cuda:1" if torch.cuda.device_count() > 1 else device
    model = build_model(cfg.model, device)
    publish, confirmed, nbytes = [], [], 0
    with tempfile.TemporaryDirectory() as run_dir:
        server = WeightServer(
            run_dir,
            transport,
            ws.bucket_mb,
            timeout_s=ws.process_group.push_timeout_s,
            join_timeout_s=ws.process_group.join_timeout_s,
            flat_buckets=ws.process_group.flat_buckets,
        )
        engine = None
        try:
            engine = EngineProcess(server.start(), cfg.model, engine_device, "bench-sync")
            for v in range(1, pushes + 2):
                start = time.perf_counter()
                report = server.publish(v, model.named_parameters)
                published = time.perf_counter() - start
                if not server.wait_confirmed(v, ["bench-sync"], timeout_s=ws.process_group.push_timeout_s):
                    raise TimeoutError(f"weight sync alone: version {v} was not confirmed: {server.health()}")
                if v > 1:
                    publish.append(published)
                    confirmed.append(time.perf_counter() - start)
                nbytes = report.bytes
        finally:
            if engine is not None:
                engine.stop()
            server.stop()
    return SyncStage(
        transport=transport,
        bytes=nbytes,
        publish_s_median=statistics.median(publish),
        confirmed_s_median=statistics.median(confirmed),
        pushes=len(publish),
    )
