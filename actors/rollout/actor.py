"""`RolloutActor` (docs/architecture.md, docs/rollout.md): asks the task feed for work, runs every attempt of every task
group through the per-attempt pipeline (actors/rollout/episodes.py) on one event loop, and sends
each group's `Episode` records to replay when its last attempt is done, keeping each until replay
acknowledges it. Admission (actors/decisions.py, in attempts): a new group whenever fewer than
`rollout.max_attempts_at_engine` attempts are at the engine, queued or generating (0 = 2 ×
`rollout.max_batch`; attempts being verified do not count), fewer than `rollout.max_attempts_at_verifiers`
wait on verifiers (0 = 2 × `rollout.max_batch`), the attempts at the engine leave room in `rollout.max_tokens_in_flight` for one more (each reserves its prompt plus
max_new_tokens; 0 = 2 × max_batch × model.max_seq_len), and replay's admission control gives one. Verification goes
through the actor's front to the verifier pool (actors/rollout/verify_pool.py).

Prompts are chat conversations rendered by the model's tokenizer (actors/policy/tokenizer.py); the
turn policy (actors/rollout/turns.py) decides each next turn. Every request stops at the tokenizer's
stop ids: the checkpoint's eos ids and the chat template's end-of-turn token.

Peers come from the run's registry (`RunContext.registry`): replay ("replay"), the verifier pool
(every actor of role "verifier") and the learner's weight endpoints ("learner"). Each is looked up
again when it stops answering, so a restarted peer is found at its new address.

Weights: following the learner (`follow_learner`), a `WeightClient` brings the engine to the learner's
current version before it serves and then applies every announced version; the engine applies each
between decode steps (policy `rollout.on_weight_update`), so every token's version is exact. Without
a learner the engine serves its initial weights (rollout-only mode).

Evaluation: `evaluate()` samples every validation task `eval.samples` times (first turn only, at the
evaluation's sampling settings, never from forced candidates) with the current weights, verifies them
like training samples and returns the verified attempts (actors/rollout/evaluation.py, the path
`kiln eval` shares); it asks replay, which owns the task set and its split, for the validation tasks.

Timeline: the actor records when its engine is generating (a generate call in flight) and when it
loads new weights (protocols.timeline); its `busy_s` is that time, the engine's real work.

Robustness: an engine that crashes is restarted, fetches the current weights before it serves, and
the requests that were in flight are run again; an episode is never dropped before its ack
(`EpisodeSender`), so a replay restart loses nothing. Runs in-process and as a Ray actor
(`as_ray_actor(RolloutActor)`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from actors import decisions
from actors.base import Actor, RunContext
from actors.policy.tokenizer import load_tokenizer
from actors.rollout.engine import Engine, EngineError, GenerateRequest, Generation, SamplingParams
from actors.rollout.engines import make_engine
from actors.rollout.episodes import Pipeline, Verifier
from actors.rollout.evaluation import (
    EvalAttempt,
    eval_max_new_tokens,
    eval_params,
    first_turn_answers,
    verified_attempts,
)
from actors.rollout.forced import CandidatePool
from actors.rollout.health import RolloutHealth, WeightSyncHealth
from actors.rollout.remote_verifier import RemoteVerifier
from actors.rollout.reporting import Reporter, group_report
from actors.rollout.turns import TurnPolicy, TurnRules
from actors.rollout.verify_pool import VerifierPool
from actors.rollout.weight_client import WeightClient
from configs import EvalConfig, ModelConfig, RolloutConfig
from protocols import Episode, Task, TaskList, TaskListRequest, TaskReply, TaskRequest
from protocols.channels import ChannelTimeout, NoServer, ReconnectingClient, RemoteError
from protocols.episodes import EpisodeSender
from protocols.timeline import SpanRecorder
from protocols.witness import ACKED, WitnessLog

log = logging.getLogger(__name__)

ENGINE_RESTARTS_PER_CALL = 3
EVAL_CONCURRENCY = 4  # validation tasks in flight at once (their samples batch together in the engine)
TASK_LIST_TIMEOUT_S = 60.0


def _reporter(ctx: RunContext, actor_id: str, *, send_episodes: bool, episode_log: bool) -> Reporter:
    """Group reports (and a sampled episode per group) to the driver; with `episode_log` (rollout-only
    mode), every episode to disk as well."""
    log_path = None
    if episode_log:
        (ctx.path / "episodes_log").mkdir(parents=True, exist_ok=True)
        log_path = str(ctx.path / "episodes_log" / f"{actor_id}.kiln")
    metrics = ctx.registry.address("driver", "metrics") or None
    return Reporter(metrics, send_episodes=send_episodes, episode_log=log_path)


def _candidate_pool(rollout: RolloutConfig, index: int) -> CandidatePool | None:
    """Forced-response candidates (benchmarks, the CPU demo), when the config names any."""
    if not rollout.forced_candidates:
        return None
    return CandidatePool(
        rollout.forced_candidates,
        seed=rollout.seed + index,
        fraction=rollout.forced_fraction,
        mix=rollout.forced_mix,
        unique=rollout.bench.unique_forced,
    )


class RolloutActor(Actor):
    role = "rollout"

    def __init__(
        self,
        rollout: RolloutConfig,
        model: ModelConfig,
        evaluation: EvalConfig,
        ctx: RunContext,
        *,
        follow_learner: bool = True,
        send_episodes: bool = False,
        episode_log: bool = False,
        remote_verifier: str = "",
    ) -> None:
        """`send_episodes` sends each group's episodes to the driver (its readable dumps);
        `episode_log` appends every episode to RUN_DIR/episodes_log/<name>.kiln (rollout-only mode);
        `remote_verifier`: the URL of a verifier service that verifies the attempts (verifier.remote)."""
        super().__init__(ctx)
        self.remote_verifier = remote_verifier
        self.cfg, self.model_cfg, self.eval_cfg, self.ctx = rollout, model, evaluation, ctx
        self.actor_id, self.index = ctx.name or f"rollout-{ctx.rank}", ctx.rank
        self.incarnation = uuid.uuid4().hex[:12]  # this process: its replacement asks under the same actor id
        registry = ctx.registry
        self.timeline = SpanRecorder(self.actor_id, registry.address("driver", "metrics") or None)
        # The learner's weight endpoints ("weights", "announce", "announce_sync"); none while it starts.
        self.weights = (
            WeightClient(
                self.actor_id, lambda: _weight_endpoints(registry.endpoints("learner")), timeline=self.timeline
            )
            if follow_learner
            else None
        )
        self.tokenizer = load_tokenizer(model)
        # Where a response ends: generation_config.json's eos ids and the chat template's end of turn.
        # Every request carries them, so an SGLang server (which knows only the config's eos) stops there too.
        self.eos = self.tokenizer.stop_ids
        self.params = SamplingParams(
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            max_new_tokens=rollout.max_new_tokens,
            stop_token_ids=tuple(self.eos),
        )
        # The in-flight budgets: attempts generating or being verified, and the engine tokens the ones at
        # the engine reserve (admission stops at either).
        self.attempt_budget = decisions.attempt_budget(rollout.max_attempts_at_engine, rollout.max_batch)
        self.verify_budget = decisions.verifier_budget(rollout.max_attempts_at_verifiers, rollout.max_batch)
        self.token_budget = decisions.token_budget(rollout.max_tokens_in_flight, rollout.max_batch, model.max_seq_len)
        self.verify_stats: dict[str, int] = {}  # the verifier pool front's counters (sent, moved, infra, ...)
        replay = registry.resolver("replay", "replay")
        self.sender = EpisodeSender(
            replay, timeout_s=rollout.ack_timeout_s, witness=WitnessLog(ctx.path, ACKED, self.actor_id)
        )
        self._feed = ReconnectingClient(replay, timeout_s=rollout.task_wait_s, retries=0)
        self.engine: Engine | None = None
        self.stats = {
            "groups": 0,
            "episodes": 0,
            "engine_restarts": 0,
            "waits": 0,
            "feed_timeouts": 0,
            "group_errors": 0,
        }
        self._finished = False
        self.reporter = _reporter(ctx, self.actor_id, send_episodes=send_episodes, episode_log=episode_log)
        # The episode sender and the reporter block on their sockets: the event loop calls them on this
        # one thread (which also keeps each socket on one thread). The task feed has a thread of its own:
        # replay holds an ask it cannot serve yet (up to replay.retry_after_s), which must not hold up
        # the episodes of a group that just finished.
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-rollout-io")
        self._asks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-rollout-feed")
        self._engine_lock = threading.Lock()
        self._preparing = threading.Lock()
        self._prepared: Engine | None = None  # built by prepare() (a standby), taken by start()
        self._pipeline_now: Pipeline | None = None
        self.pool = _candidate_pool(rollout, self.index)

    # ------------------------------------------------------------------------------ lifecycle

    def start(self) -> dict[str, str]:
        with self._preparing:  # a standby started while still preparing waits for its engine
            prepared, self._prepared = self._prepared, None
        self.engine = self._start_engine(prepared)
        if self.weights is not None:
            self.spawn(lambda: self.weights.run(self._stop), "weights")
        self.spawn(self._loop, "episodes")
        # No endpoint to announce (it only asks others), but the registry is where the run's tools
        # find each actor's process (a chaos run's kills: launch/bench/chaos.py).
        self.ctx.registry.register(self.actor_id, self.role, {})
        return {}

    def prepare(self) -> None:
        """Build the engine (its model, on the rollout's devices) and nothing else: no weights are asked
        for, no task is fetched. A warm standby (the supervisor's spare rollout actor) is prepared ahead,
        so that taking over from a dead one costs only joining the learner for its weights."""
        with self._preparing:
            if self._prepared is None:
                self._prepared = self._build_engine()

    def stop(self) -> None:
        # Close the engine first: a generation in flight fails at once instead of holding the join.
        # A group cut short was never emitted; replay re-issues its task once the group expires.
        self._stop.set()
        if self.engine is not None:
            self.engine.close()
        super().stop()
        for close in (self.sender.close, self._feed.close, self.reporter.close, self.timeline.close):
            close()
        if self.weights is not None:
            self.weights.close()

    def health(self) -> RolloutHealth:
        engine = self.engine.health() if self.engine is not None else None
        return RolloutHealth(
            role=self.role,
            alive=not self.stopping,
            looping=self.threads_running,
            finished=self._finished,
            busy_s=self.timeline.busy_s(),
            actor_id=self.actor_id,
            **self.stats,
            unacked=self.sender.unacked,
            acked=len(self.sender.acked),
            verify_infra=self.verify_stats.get("infra", 0),
            inflight=self._pipeline_now.inflight if self._pipeline_now else 0,
            at_engine=self._pipeline_now.at_engine if self._pipeline_now else 0,
            at_verifiers=self._pipeline_now.at_verifiers if self._pipeline_now else 0,
            engine_tokens_reserved=self._pipeline_now.engine_tokens if self._pipeline_now else 0,
            engine_alive=engine is not None and engine.alive,
            decoded_tokens=engine.tokens if engine is not None else 0,
            engine=engine,
            weights=WeightSyncHealth(**self.weights.health()) if self.weights is not None else None,
        )

    def acked_episode_ids(self) -> list[str]:
        return list(self.sender.acked)

    # ------------------------------------------------------------------------------ weights

    def update_weights_from_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.engine.update_weights_from_tensors(tensors, version)

    def update_weights_from_disk(self, path: str, version: int) -> None:
        self.engine.update_weights_from_disk(path, version)

    def weight_version(self) -> int:
        return self.engine.weight_version

    # ------------------------------------------------------------------------------ engine

    def _build_engine(self) -> Engine:
        return make_engine(
            self.cfg, self.model_cfg, index=self.index, eos_token_ids=self.eos, gpu_ids=self.ctx.slot.device_ids()
        )

    def _start_engine(self, engine: Engine | None = None) -> Engine:
        """`engine` (one prepared ahead) or a new one, with the learner's current weights loaded."""
        engine = engine or self._build_engine()
        if self.weights is not None:  # a late or restarted engine loads the current weights before serving
            try:
                self.weights.bootstrap(engine)
            except Exception:
                engine.close()
                raise
        return engine

    async def vigil(self, poll_s: float = 0.1) -> None:
        """`Actor.vigil`, awaited: with an async method this class is an asyncio actor under Ray, whose
        plain methods run on its event loop, so a blocking wait would hold every other call."""
        while not self.ended():
            await asyncio.sleep(poll_s)

    async def generate_one(self, request: GenerateRequest) -> Generation:
        """One request on the engine; a crashed engine is restarted (off the event loop, so the other
        attempts' verifications go on) and the request runs again."""
        loop = asyncio.get_running_loop()
        for attempt in range(ENGINE_RESTARTS_PER_CALL + 1):
            engine = self.engine
            try:
                with self.timeline.span("generating"):  # overlapping attempts: one span while any runs
                    return await asyncio.wrap_future(engine.submit(request))
            except EngineError as err:
                if self.stopping or attempt == ENGINE_RESTARTS_PER_CALL:
                    raise
                await loop.run_in_executor(None, self._restart_engine, engine, err)
        raise AssertionError("unreachable")

    def generate(self, requests: list[GenerateRequest]) -> list[Generation]:
        """Synchronous generation (evaluation, tools and tests call it on their own thread), with the same
        engine restart."""
        for attempt in range(ENGINE_RESTARTS_PER_CALL + 1):
            engine = self.engine
            try:
                with self.timeline.span("generating"):
                    return engine.generate(requests)
            except EngineError as err:
                if self.stopping or attempt == ENGINE_RESTARTS_PER_CALL:
                    raise
                self._restart_engine(engine, err)
        raise AssertionError("unreachable")

    def _restart_engine(self, failed: Engine, err: Exception) -> None:
        with self._engine_lock:
            if self.engine is not failed:  # another attempt's failure restarted it already
                return
            log.error("%s: engine failed (%s); restarting it", self.actor_id, err)
            self.stats["engine_restarts"] += 1
            try:
                failed.close()
            except Exception:
                log.exception("%s: closing the failed engine", self.actor_id)
            self.engine = self._start_engine()

    # ------------------------------------------------------------------------------ episodes

    def _pipeline(self, verifier: VerifierPool, max_turns: int) -> Pipeline:
        policy = TurnPolicy(
            TurnRules.from_config(self.cfg, self.model_cfg, self.eval_cfg, max_turns=max_turns), self.tokenizer
        )
        return Pipeline(
            actor_id=self.actor_id,
            generate=self.generate_one,
            verify=verifier.verify,
            tokenizer=self.tokenizer,
            params=self.params,
            policy=policy,
            force=self.pool.draw if self.pool is not None else None,
            first_attempt_tokens=self.model_cfg.max_seq_len,
            decode_forced=self.cfg.bench.decode_forced,
        )

    def _verifier_pool(self) -> VerifierPool | RemoteVerifier:
        if self.remote_verifier:  # verifier.remote: a verifier service answers instead of the run's actors
            return RemoteVerifier(
                self.remote_verifier,
                timeout_s=self.cfg.verify_reply_timeout_s,
                retries=self.cfg.verify_retries,
                stats=self.verify_stats,
            )
        return VerifierPool(
            self.ctx.registry.pool_resolver("verifier", "verifier"),
            timeout_s=self.cfg.verify_reply_timeout_s,
            retries=self.cfg.verify_retries,
            stats=self.verify_stats,
        )

    def evaluate(self) -> list[EvalAttempt]:
        """First-turn attempts at every validation task (`eval.samples` each) with the current weights,
        sampled at the evaluation's settings (eval.temperature, eval.top_p; never forced candidates)
        and verified by the training verifier; nothing goes to replay. Returns one `EvalAttempt` per
        attempt, which the driver turns into the table `kiln eval` writes (launch/stages/eval/); [] when
        there is no validation task."""
        tasks = self._validation_tasks()
        if not tasks:
            return []
        rules = TurnRules.first_turn(self.cfg, self.model_cfg)
        policy = TurnPolicy(
            dataclasses.replace(rules, max_new_tokens=eval_max_new_tokens(self.eval_cfg, self.cfg)), self.tokenizer
        )
        params = eval_params(self.eval_cfg, self.cfg, self.eos)

        def one(task: Task) -> list[EvalAttempt]:
            pairs = [(task, sample) for sample in range(self.eval_cfg.samples)]
            answers = first_turn_answers(
                pairs, generate=self.generate, tokenizer=self.tokenizer, policy=policy, params=params
            )
            return verified_attempts(answers, verifier.verify_all)

        # Evaluation is a driver's call on its own thread: a synchronous verifier client of its own.
        verifier = Verifier(
            self.ctx.registry.pool_resolver("verifier", "verifier"),
            timeout_s=self.cfg.verify_reply_timeout_s,
            retries=self.cfg.verify_retries,
        )
        try:
            with ThreadPoolExecutor(max_workers=EVAL_CONCURRENCY, thread_name_prefix="kiln-rollout-eval") as pool:
                return [attempt for attempts in pool.map(one, tasks) for attempt in attempts]
        finally:
            verifier.close()

    def _validation_tasks(self) -> list[Task]:
        """The validation split, from replay (which owns the task set and its split)."""
        client = ReconnectingClient(self.ctx.registry.resolver("replay", "replay"), timeout_s=TASK_LIST_TIMEOUT_S)
        try:
            reply = client.request(TaskListRequest(split="val"))
        finally:
            client.close()
        if not isinstance(reply, TaskList):
            # the peer broke the protocol; not a caller's type error
            raise RuntimeError(f"replay answered {type(reply).__name__} to a task-list request")  # noqa: TRY004
        return reply.tasks

    def _loop(self) -> None:
        """The episode loop's thread: one event loop carries every attempt of this actor."""
        try:
            asyncio.run(self._serve())
        finally:
            self._asks.shutdown(wait=True)
            self._io.shutdown(wait=True)

    async def _serve(self) -> None:
        """Admit task groups while the actor's rooms leave admission capacity (fewer attempts at the engine
        and at the verifiers than their budgets, engine tokens to spare) and replay's admission control
        says yes; run each group's attempts through the pipeline; send each group's episodes to replay
        when its last attempt is done."""
        loop = asyncio.get_running_loop()
        io = lambda fn, *args: loop.run_in_executor(self._io, fn, *args)  # sender/reporter thread
        verifier = self._verifier_pool()
        pipeline = self._pipeline(verifier, self.cfg.max_turns)
        self._pipeline_now = pipeline
        groups: set[asyncio.Task] = set()
        try:
            while not self.stopping:
                capacity = decisions.admission_capacity(
                    decisions.engine_room(pipeline.at_engine, self.attempt_budget),
                    decisions.verifier_room(pipeline.at_verifiers, self.verify_budget),
                    decisions.engine_token_room(pipeline.engine_tokens, self.token_budget, pipeline.attempt_tokens),
                )
                if not decisions.may_start_group(capacity):
                    pipeline.room.clear()
                    await self._until(pipeline.room, 0.2)
                    continue
                if self.sender.unacked:
                    # Offered before the ask, which replay may hold until the window has room: the window
                    # can be waiting for exactly these episodes (their groups stay running without them).
                    await io(self.sender.pump)
                reply = await loop.run_in_executor(self._asks, self._ask_for_task)
                if reply is None or reply.status == "wait":
                    self.stats["waits"] += 1
                    await io(self.sender.pump)
                    await self._until(None, reply.retry_after_s if reply else 0.2)
                    continue
                if reply.status == "stop":
                    break
                group = asyncio.create_task(self._group(pipeline, reply, io))
                groups.add(group)
                group.add_done_callback(groups.discard)
                # One turn of the loop: the group's task counts its attempts in flight (and puts them at
                # the engine) before the next admission reads the counts, so a group overshoots the
                # budgets by at most G - 1 attempts, not by a second group.
                await asyncio.sleep(0)
            while groups and not self.stopping:  # the feed said stop: finish what is in flight
                await asyncio.wait(groups, timeout=0.2)
            if not self.stopping:
                while not self.stopping and not await io(self.sender.flush, 1.0):
                    pass
                # A stopped actor is not finished: the supervisor must see it dead (an in-process kill is a stop).
                self._finished = not self.stopping
        finally:
            for group in groups:
                group.cancel()
            await asyncio.gather(*groups, return_exceptions=True)
            await verifier.close()

    async def _group(self, pipeline: Pipeline, reply: TaskReply, io) -> None:
        started = time.monotonic()
        try:
            episodes = await pipeline.run_group(reply)
        except asyncio.CancelledError:
            raise
        except Exception:
            if self.stopping:
                return
            # Nothing of this group was emitted; replay re-issues its task when the group expires.
            log.exception("%s: group %s failed", self.actor_id, reply.group_id)
            self.stats["group_errors"] += 1
            return
        await io(self._emit, reply, episodes, time.monotonic() - started)

    def _emit(self, reply: TaskReply, episodes: list[Episode], seconds: float) -> None:
        """On the io thread: hand the group's episodes to the sender (kept until acked) and report it."""
        for episode in episodes:
            self.sender.submit(episode)
        self.reporter.group(group_report(self.actor_id, reply, episodes, seconds), episodes)
        self.stats["groups"] += 1
        self.stats["episodes"] += len(episodes)
        self.sender.pump()

    async def _until(self, event: asyncio.Event | None, timeout_s: float) -> None:
        """Wait for `event` (or just `timeout_s`), waking early when the actor stops."""
        deadline = time.monotonic() + timeout_s
        while not self.stopping and (left := deadline - time.monotonic()) > 0:
            if event is None:
                await asyncio.sleep(min(left, 0.1))
                continue
            try:
                await asyncio.wait_for(event.wait(), timeout=min(left, 0.1))
                return
            except TimeoutError:
                pass

    def _ask_for_task(self) -> TaskReply | None:
        try:
            reply = self._feed.request(TaskRequest(actor_id=self.actor_id, incarnation=self.incarnation))
        except NoServer:  # replay has not registered yet
            return None
        except ChannelTimeout:  # replay may be restarting on a new address: the client looks it up again
            self.stats["feed_timeouts"] += 1
            return None
        except RemoteError as err:
            log.warning("%s: task feed refused: %s", self.actor_id, err)
            return None
        if not isinstance(reply, TaskReply):
            log.warning("%s: task feed answered %s", self.actor_id, type(reply).__name__)
            return None
        return reply


def _weight_endpoints(entry: dict[str, str]) -> dict[str, str]:
    """The learner's weight endpoints once it serves them ({} before: its rank rendezvous registers first)."""
    return entry if "weights" in entry else {}
