"""`RolloutActor` (DESIGN.md §2, §5): asks the task feed for work, runs each task group through the
multi-turn episode loop on its engine, and sends the `Episode` records to replay, keeping each until
replay acknowledges it.

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

import dataclasses
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

import torch

from actors.base import Actor, RunContext
from actors.policy.tokenizer import load_tokenizer
from actors.rollout.engine import Engine, EngineError, GenerateRequest, Generation, SamplingParams
from actors.rollout.engines import make_engine
from actors.rollout.episodes import GroupRunner, Verifier
from actors.rollout.evaluation import EvalAttempt, eval_max_new_tokens, eval_params, first_turn_answers, verified_attempts
from actors.rollout.forced import CandidatePool
from actors.rollout.health import RolloutHealth, WeightSyncHealth
from actors.rollout.reporting import Reporter, group_report
from actors.rollout.turns import TurnPolicy, TurnRules
from actors.rollout.weight_client import WeightClient
from configs import EvalConfig, ModelConfig, RolloutConfig
from protocols import Task, TaskList, TaskListRequest, TaskReply, TaskRequest
from protocols.channels import ChannelTimeout, NoServer, ReconnectingClient, RemoteError
from protocols.episodes import EpisodeSender
from protocols.timeline import SpanRecorder

log = logging.getLogger(__name__)

ENGINE_RESTARTS_PER_CALL = 3
EVAL_CONCURRENCY = 4  # validation tasks in flight at once (their samples batch together in the engine)
TASK_LIST_TIMEOUT_S = 60.0


class RolloutActor(Actor):
    role = "rollout"

    def __init__(self, rollout: RolloutConfig, model: ModelConfig, evaluation: EvalConfig, ctx: RunContext, *,
                 follow_learner: bool = True, send_episodes: bool = False, episode_log: bool = False) -> None:
        """`send_episodes` sends each group's episodes to the driver (its readable dumps);
        `episode_log` appends every episode to RUN_DIR/episodes_log/<name>.kiln (rollout-only mode)."""
        super().__init__()
        self.cfg, self.model_cfg, self.eval_cfg, self.ctx = rollout, model, evaluation, ctx
        self.actor_id, self.index = ctx.name or f"rollout-{ctx.rank}", ctx.rank
        registry = ctx.registry
        self.timeline = SpanRecorder(self.actor_id, registry.address("driver", "metrics") or None)
        # The learner's weight endpoints ("weights", "announce", "announce_sync"); none while it starts.
        self.weights = WeightClient(self.actor_id, lambda: _weight_endpoints(registry.endpoints("learner")),
                                    timeline=self.timeline) if follow_learner else None
        self.tokenizer = load_tokenizer(model)
        # Where a response ends: generation_config.json's eos ids and the chat template's end of turn.
        # Every request carries them, so an SGLang server (which knows only the config's eos) stops there too.
        self.eos = self.tokenizer.stop_ids
        self.params = SamplingParams(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                                     max_new_tokens=rollout.max_new_tokens, stop_token_ids=tuple(self.eos))
        self.verifier = Verifier(registry.pool_resolver("verifier", "verifier"),
                                 timeout_s=rollout.verify_reply_timeout_s, retries=rollout.verify_retries)
        replay = registry.resolver("replay", "replay")
        self.sender = EpisodeSender(replay, timeout_s=rollout.ack_timeout_s)
        self._feed = ReconnectingClient(replay, timeout_s=rollout.task_wait_s, retries=0)
        self.engine: Engine | None = None
        self.stats = {"groups": 0, "episodes": 0, "engine_restarts": 0, "waits": 0, "feed_timeouts": 0,
                      "group_errors": 0}
        self._finished = False
        # Group reports (and a sampled episode per group) to the driver; every episode to disk in
        # rollout-only mode.
        log_path = None
        if episode_log:
            (ctx.path / "episodes_log").mkdir(parents=True, exist_ok=True)
            log_path = str(ctx.path / "episodes_log" / f"{self.actor_id}.kiln")
        self.reporter = Reporter(registry.address("driver", "metrics") or None, send_episodes=send_episodes,
                                 episode_log=log_path)
        self._runner: GroupRunner | None = None
        # Groups run on `rollout.concurrent_groups` threads, so the engine batches several groups'
        # samples while others wait on the verifier; the feed, the sender and the reporter are shared
        # and taken under this lock.
        self._io = threading.Lock()
        self._engine_lock = threading.Lock()
        self._workers = 0
        self.pool = (CandidatePool(rollout.forced_candidates, seed=rollout.seed + self.index,
                                   fraction=rollout.forced_fraction, mix=rollout.forced_mix,
                                   unique=rollout.bench.unique_forced)
                     if rollout.forced_candidates else None)

    # ------------------------------------------------------------------------------ lifecycle

    def start(self) -> dict[str, str]:
        self.engine = self._start_engine()
        if self.weights is not None:
            self.spawn(lambda: self.weights.run(self._stop), "weights")
        self._runner = self._group_runner(self.cfg.max_turns)
        self._workers = self.cfg.concurrent_groups
        for i in range(self.cfg.concurrent_groups):
            self.spawn(self._loop, f"episodes-{i}")
        return {}

    def stop(self) -> None:
        # Close the engine first: a generation in flight fails at once instead of holding the join.
        # A group cut short was never emitted; replay re-issues its task once the group expires.
        self._stop.set()
        if self.engine is not None:
            self.engine.close()
        super().stop()
        for close in (self.verifier.close, self.sender.close, self._feed.close, self.reporter.close,
                      self.timeline.close):
            close()
        if self.weights is not None:
            self.weights.close()

    def health(self) -> RolloutHealth:
        engine = self.engine.health() if self.engine is not None else {"alive": False}
        return RolloutHealth(role=self.role, alive=not self.stopping, looping=self.threads_running,
                             finished=self._finished, busy_s=self.timeline.busy_s(), actor_id=self.actor_id,
                             **self.stats,
                             unacked=self.sender.unacked, acked=len(self.sender.acked),
                             verify_infra=self.verifier.stats["infra"], engine_alive=bool(engine.get("alive")),
                             decoded_tokens=int(engine.get("tokens", 0)), engine=engine,
                             weights=WeightSyncHealth(**self.weights.health()) if self.weights is not None else None)

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

    def _start_engine(self) -> Engine:
        engine = make_engine(self.cfg, self.model_cfg, index=self.index, eos_token_ids=self.eos,
                             gpu_ids=self.ctx.slot.device_ids())
        if self.weights is not None:  # a late or restarted engine loads the current weights before serving
            try:
                self.weights.bootstrap(engine)
            except Exception:
                engine.close()
                raise
        return engine

    def generate(self, requests: list[GenerateRequest]) -> list[Generation]:
        """Generate on the engine; a crashed engine is restarted and the requests run again."""
        for attempt in range(ENGINE_RESTARTS_PER_CALL + 1):
            engine = self.engine
            try:
                with self.timeline.span("generating"):
                    return engine.generate(requests)
            except EngineError as err:
                if self.stopping or attempt == ENGINE_RESTARTS_PER_CALL:
                    raise
                with self._engine_lock:
                    if self.engine is not engine:  # another group's thread restarted it already
                        continue
                    log.error("%s: engine failed (%s); restarting it", self.actor_id, err)
                    self.stats["engine_restarts"] += 1
                    try:
                        engine.close()
                    except Exception:
                        log.exception("%s: closing the failed engine", self.actor_id)
                    self.engine = self._start_engine()
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------------------ episodes

    def _group_runner(self, max_turns: int) -> GroupRunner:
        policy = TurnPolicy(TurnRules.from_config(self.cfg, self.model_cfg, max_turns=max_turns), self.tokenizer)
        return GroupRunner(actor_id=self.actor_id, generate=self.generate, verifier=self.verifier,
                           tokenizer=self.tokenizer, params=self.params, policy=policy,
                           force=self.pool.draw if self.pool is not None else None)

    def evaluate(self) -> list[EvalAttempt]:
        """First-turn attempts at every validation task (`eval.samples` each) with the current weights,
        sampled at the evaluation's settings (eval.temperature, eval.top_p; never forced candidates)
        and verified by the training verifier; nothing goes to replay. Returns one `EvalAttempt` per
        attempt, which the driver turns into the table `kiln eval` writes (launch/eval/); [] when
        there is no validation task."""
        tasks = self._validation_tasks()
        if not tasks:
            return []
        rules = TurnRules.from_config(self.cfg, self.model_cfg, max_turns=1)
        policy = TurnPolicy(dataclasses.replace(rules, max_new_tokens=eval_max_new_tokens(self.eval_cfg, self.cfg)),
                            self.tokenizer)
        params = eval_params(self.eval_cfg, self.cfg, self.eos)

        def one(task: Task) -> list[EvalAttempt]:
            pairs = [(task, sample) for sample in range(self.eval_cfg.samples)]
            answers = first_turn_answers(pairs, generate=self.generate, tokenizer=self.tokenizer, policy=policy,
                                         params=params)
            return verified_attempts(answers, self.verifier.verify_all)

        with ThreadPoolExecutor(max_workers=EVAL_CONCURRENCY, thread_name_prefix="kiln-rollout-eval") as pool:
            return [attempt for attempts in pool.map(one, tasks) for attempt in attempts]

    def _validation_tasks(self) -> list[Task]:
        """The validation split, from replay (which owns the task set and its split)."""
        client = ReconnectingClient(self.ctx.registry.resolver("replay", "replay"), timeout_s=TASK_LIST_TIMEOUT_S)
        try:
            reply = client.request(TaskListRequest(split="val"))
        finally:
            client.close()
        if not isinstance(reply, TaskList):
            raise RuntimeError(f"replay answered {type(reply).__name__} to a task-list request")
        return reply.tasks

    def _loop(self) -> None:
        """One group at a time on this thread; `rollout.concurrent_groups` threads run this loop."""
        runner = self._runner
        while not self.stopping:
            with self._io:
                reply = self._ask_for_task()
                if reply is None or reply.status == "wait":
                    self.stats["waits"] += 1
                    self.sender.pump()
            if reply is None or reply.status == "wait":
                self._stop.wait(reply.retry_after_s if reply else 0.2)
                continue
            if reply.status == "stop":
                break
            started = time.monotonic()
            try:
                episodes = runner.run(reply)
            except Exception:
                if self.stopping:
                    return
                # Nothing of this group was emitted; replay re-issues its task when the group expires.
                log.exception("%s: group %s failed", self.actor_id, reply.group_id)
                with self._io:
                    self.stats["group_errors"] += 1
                self._stop.wait(1.0)
                continue
            with self._io:
                for episode in episodes:
                    self.sender.submit(episode)
                self.reporter.group(group_report(self.actor_id, reply, episodes, time.monotonic() - started),
                                    episodes)
                self.stats["groups"] += 1
                self.stats["episodes"] += len(episodes)
                self.sender.pump()
        with self._io:
            self._workers -= 1
            if self._workers:
                return
            while not self.stopping and not self.sender.flush(timeout_s=1.0):
                pass
            # A stopped actor is not finished: the supervisor must see it dead (an in-process kill is a stop).
            self._finished = not self.stopping

    def _ask_for_task(self) -> TaskReply | None:
        try:
            reply = self._feed.request(TaskRequest(actor_id=self.actor_id))
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
