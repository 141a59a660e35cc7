"""RolloutActor end to end over real sockets: multi-turn episodes against the example reward actor and
against the real kernel verifier (cpu backend), a weight update mid-episode with exact per-token
versions, episodes kept and resent across a replay restart, a silent verifier (resend, then infra),
an engine crash (restart with the current weights, requests re-run), and the actor under Ray."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import numpy as np
import pytest

from actors.base import RunContext, as_ray_actor
from actors.buffer import ReplayActor
from actors.learner.weight_sync import WeightServer
from actors.policy.model import build_model
from actors.policy.prompts import shape_summary
from actors.policy.tokenizer import ByteTokenizer
from actors.rollout.actor import RolloutActor
from actors.rollout.engine import Generation, SamplingParams
from actors.rollout.episodes import Pipeline
from actors.rollout.turns import TurnPolicy, TurnRules
from actors.verifier.actor import VerifierActor
from configs import AlgoConfig, EvalConfig, ModelConfig, ReplayConfig, RolloutConfig, VerifierConfig
from protocols import Task, TaskReply, VerifyRequest, VerifyResult, decode, encode
from protocols.channels import ReplyServer
from protocols.registry import Registry
from tests.helpers.common import reference_logprobs, wait_for

TEXT_TASKS = "actors.buffer.examples.TextMatchTasks"
TEXT_REWARD = "actors.verifier.examples.TextMatchReward"
TINY = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, max_seq_len=1024)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def rollout_cfg(**kw) -> RolloutConfig:
    base = {
        "max_new_tokens": 8,
        "max_turns": 3,
        "max_batch": 8,
        "temperature": 1.0,
        "verify_reply_timeout_s": 30.0,
        "ack_timeout_s": 1.0,
        "task_wait_s": 1.0,
        "device": "cpu",
    }
    return RolloutConfig(**{**base, **kw})


def wrong_answer(request: VerifyRequest) -> VerifyResult:
    """A verifier's failure verdict on `request` (so attempts take their repair turns)."""
    return VerifyResult(
        request_id=request.request_id,
        task_id=request.task.task_id,
        passed=False,
        stage="correctness",
        error_class="correctness",
        q=0.0,
        score=-1.0,
        feedback="Wrong answer.",
    )


def start_replay(run_dir, *, tasks=TEXT_TASKS, G=2, B=1) -> ReplayActor:
    cfg = ReplayConfig(task_source=tasks, val_fraction=0.0) if tasks else ReplayConfig(tasks="tasks", val_fraction=0.0)
    replay = ReplayActor(
        cfg,
        AlgoConfig(group_size=G, batch_groups=B, total_steps=10, seed=1),
        RunContext(run_dir=str(run_dir), name="replay"),
    )
    replay.start()
    return replay


def rollout_actor(
    run_dir,
    cfg: RolloutConfig,
    model: ModelConfig = TINY,
    *,
    verifier: str,
    follow_learner: bool = False,
    name: str = "rollout-0",
) -> RolloutActor:
    """A rollout actor of the run in `run_dir`: it finds replay (and the learner) in the run's registry,
    where `verifier`'s address is registered as the verifier pool."""
    Registry(run_dir).register("verifier-0", "verifier", {"verifier": verifier})
    return RolloutActor(
        cfg, model, EvalConfig(), RunContext(run_dir=str(run_dir), name=name), follow_learner=follow_learner
    )


def stored_ids(replay) -> set[str]:
    return {i for ids in replay.episode_ids().values() for i in ids}


class ScriptedVerifier:
    """A real ROUTER that answers VerifyRequests with a fixed failure, optionally after a gate opens,
    or never (silent). Counts what it received."""

    def __init__(self, *, gate: threading.Event | None = None, silent: bool = False) -> None:
        self.server = ReplyServer()
        self.address = self.server.address
        self.gate, self.silent = gate, silent
        self.received: list[VerifyRequest] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        pending = []
        while not self._stop.is_set():
            req = self.server.recv(timeout_s=0.02)
            if req is not None:
                self.received.append(req.record)
                pending.append(req)
            if self.silent or (self.gate is not None and not self.gate.is_set()):
                continue
            for req in pending:
                r = req.record
                self.server.reply(req, wrong_answer(r))
            pending.clear()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.server.close()


def test_kernel_prompt_reads_shapes_statically_per_backend():
    reference = (
        "import torch\nbatch_size = 4096\ndim = 8192\nKILN_CPU_SHAPES = {'batch_size': 16}\n"
        "def get_inputs():\n    return [torch.randn(batch_size, dim, dtype=torch.float16)]\n"
    )
    assert shape_summary(reference, "cuda") == (
        "constants (sizes, parameters): batch_size = 4096, dim = 8192; dtypes: float16"
    )
    assert "batch_size = 16, dim = 8192" in shape_summary(reference, "cpu")
    assert shape_summary("def broken(:", "cpu") == "constants: see the reference"


def test_a_task_without_a_prompt_becomes_infra_episodes_not_a_crash():
    async def never(request):
        pytest.fail("nothing to generate or verify")

    pipeline = Pipeline(
        actor_id="r",
        generate=never,
        verify=never,
        tokenizer=ByteTokenizer(),
        params=SamplingParams(max_new_tokens=8),
        policy=TurnPolicy(TurnRules(max_turns=3, max_seq_len=64, max_new_tokens=8), ByteTokenizer()),
    )
    reply = TaskReply(status="task", task=Task(task_id="t", kind="text_match", payload={}), group_id="g7", group_size=2)
    episodes = asyncio.run(pipeline.run_group(reply))
    assert [e.episode_id for e in episodes] == ["g7/0", "g7/1"]
    for ep in episodes:
        decode(encode(ep))  # a valid record for replay
        (turn,) = ep.turns
        assert turn.result.error_class == "infra" and "payload['prompt']" in turn.result.feedback
        assert ep.rewards == [0.0]
    assert pipeline.inflight == 0


@pytest.mark.parametrize("decode_forced", [False, True])
def test_decode_forced_decodes_each_attempt_and_verifies_the_drawn_candidate(decode_forced):
    """rollout.bench.decode_forced (the realistic GPU workload): the engine gets a sampled request (no
    forced response) and decodes it, while the verifier and the next turn's dialogue get the drawn
    candidate, whole, though it is longer than max_new_tokens. Off, the candidate is the forced
    response the engine scores, cut there. Mutation: verifying the decoded text instead of the
    candidate fails the first case's verifier check."""
    candidate = "```python\nprint('kernel')  # " + "x" * 60 + "\n```"  # 85 bytes, max_new_tokens 64
    seen, asked = [], []

    async def generate(request):
        seen.append(request)
        ids = request.forced_response if request.forced_response is not None else [65] * 5
        return Generation(
            request_id=request.request_id,
            output_ids=np.asarray(ids, dtype=np.int64),
            logprobs=np.zeros(len(ids), np.float32),
            versions=np.zeros(len(ids), np.int64),
            finish_reason="stop",
            prompt_tokens=len(request.prompt_ids),
        )

    async def verify(request):
        asked.append(request)
        return wrong_answer(request)

    tok = ByteTokenizer()
    pipeline = Pipeline(
        actor_id="r",
        generate=generate,
        verify=verify,
        tokenizer=tok,
        params=SamplingParams(max_new_tokens=64),
        policy=TurnPolicy(TurnRules(max_turns=2, max_seq_len=512, max_new_tokens=64), tok),
        force=lambda task: candidate,
        decode_forced=decode_forced,
    )
    task = Task(task_id="t", kind="text_match", payload={"prompt": "write it", "answer": "x"})
    (episode,) = asyncio.run(pipeline.run_group(TaskReply(status="task", task=task, group_id="g", group_size=1)))
    assert len(episode.turns) == 2 and len(seen) == 2
    assert all((r.forced_response is None) == decode_forced for r in seen)
    expected = tok.encode(candidate) if decode_forced else tok.encode(candidate)[:64]  # a cut one: no code
    assert [r.candidate for r in asked] == [tok.split_response(expected).answer] * 2
    assert asked[0].candidate.endswith("```") == decode_forced  # its fence closed: code to extract
    first = episode.turns[0]
    assert first.response_ids.tolist() == ([65] * 5 if decode_forced else seen[0].forced_response)
    assert "kernel" in tok.decode(list(seen[1].prompt_ids))  # the dialogue carries the candidate


@pytest.fixture
def text_verifier():
    actor = VerifierActor(VerifierConfig(reward_actor=TEXT_REWARD, max_concurrent_requests=4))
    address = actor.start()["verifier"]
    yield address
    actor.stop()


def check_episode(ep, max_turns):
    assert 1 <= len(ep.turns) <= max_turns
    assert ep.rewards == [t.result.score for t in ep.turns]
    for k, turn in enumerate(ep.turns):
        assert len(turn.response_ids) == len(turn.logprobs) == len(turn.versions) >= 1
        assert turn.result.request_id == f"{ep.episode_id}/t{k}"
        passed = turn.result.passed
        assert (k == len(ep.turns) - 1) or not passed  # an attempt stops at its first pass


def test_multi_turn_episodes_against_the_example_reward_actor(tmp_path, text_verifier):
    replay = start_replay(tmp_path, G=2, B=2)
    actor = rollout_actor(tmp_path, rollout_cfg(), verifier=text_verifier)
    seen = []
    actor.sender.submit = lambda ep, submit=actor.sender.submit: (seen.append(ep), submit(ep))[1]
    try:
        actor.start()
        wait_for(lambda: actor.health().acked >= 8, what="8 acked episodes", actor=actor)
        assert stored_ids(replay) >= set(actor.acked_episode_ids())
        for ep in seen:
            check_episode(ep, 3)
            assert ep.task.kind == "text_match" and ep.is_retry == (ep.task.repair is not None)
            first = actor.tokenizer.decode(ep.turns[0].prompt_ids)
            assert first.startswith(ep.task.payload["prompt"])
            if ep.task.repair is not None:  # a Buffered-Dynamic-Retry task starts from its feedback
                assert ep.task.repair.feedback.strip() in first
            else:
                assert first == ep.task.payload["prompt"]
            if len(ep.turns) > 1:  # the repair turn carries the failed answer and the reward's feedback
                assert ep.turns[0].result.feedback in actor.tokenizer.decode(ep.turns[1].prompt_ids)
            for turn in ep.turns:
                assert (
                    np.abs(
                        reference_logprobs(actor.engine.model, turn.prompt_ids, turn.response_ids) - turn.logprobs
                    ).mean()
                    < 1e-4
                )
                assert (turn.versions == 0).all()
        assert any(len(ep.turns) == 3 for ep in seen)  # a random tiny model fails: full repair chains
    finally:
        actor.stop()
        replay.stop()


def test_multi_turn_episodes_against_the_cpu_kernel_verifier(tmp_path):
    verifier = VerifierActor(
        VerifierConfig(backend="cpu", cache_dir=str(tmp_path / "vcache"), max_concurrent_requests=2)
    )
    address = verifier.start()["verifier"]
    replay = start_replay(tmp_path, tasks=None, G=2, B=1)
    model = dataclasses.replace(TINY, max_seq_len=4096)  # byte-level prompts of whole reference files
    actor = rollout_actor(tmp_path, rollout_cfg(max_turns=2, max_new_tokens=16), model, verifier=address)
    seen = []
    actor.sender.submit = lambda ep, submit=actor.sender.submit: (seen.append(ep), submit(ep))[1]
    try:
        actor.start()
        wait_for(lambda: actor.health().acked >= 4, timeout_s=120, what="4 acked kernel episodes", actor=actor)
        for ep in seen:
            check_episode(ep, 2)
            assert ep.task.kind == "kernel" and len(ep.turns) == 2
            first = actor.tokenizer.decode(ep.turns[0].prompt_ids)
            assert ep.task.kernel.reference.strip() in first and "ModelNew" in first and "fallback" in first
            r0 = ep.turns[0].result
            assert r0.stage == "extract" and r0.score == -1.0  # random bytes hold no code
            assert r0.feedback.strip() in actor.tokenizer.decode(ep.turns[1].prompt_ids)
    finally:
        actor.stop()
        replay.stop()
        verifier.stop()


def test_weight_update_mid_episode_gives_exact_per_token_versions(tmp_path, text_verifier):
    replay = start_replay(tmp_path, G=2, B=1)
    actor = rollout_actor(
        tmp_path, rollout_cfg(max_new_tokens=24, max_turns=1, on_weight_update="abort"), verifier=text_verifier
    )
    seen = []
    actor.sender.submit = lambda ep, submit=actor.sender.submit: (seen.append(ep), submit(ep))[1]
    old = build_model(TINY)
    new = build_model(dataclasses.replace(TINY, seed=21))
    try:
        actor.start()
        engine = actor.engine
        reached = threading.Event()

        def pause_at_step_5(step):
            if step == 5:
                engine.pause()
                reached.set()

        engine.step_hook = pause_at_step_5
        assert reached.wait(60)
        actor.update_weights_from_tensors(new.state_dict().items(), version=1)
        engine.resume()
        wait_for(lambda: actor.health().acked >= 4, what="4 acked episodes", actor=actor)
        turns = [ep.turns[0] for ep in seen]
        mixed = [t for t in turns if 0 in t.versions and 1 in t.versions]
        assert mixed, "the update landed mid-generation"
        for t in turns:
            assert (np.diff(t.versions) >= 0).all()  # versions never go back within a response
            v = t.versions
            ref = np.where(
                v == 0,
                reference_logprobs(old, t.prompt_ids, t.response_ids),
                reference_logprobs(new, t.prompt_ids, t.response_ids),
            )
            assert np.abs(ref - t.logprobs).mean() < 1e-4
        # The update landed between decode steps 5 and 6: a response begun in the first admission has
        # exactly 5 tokens of version 0; one admitted a step or more later (admissions are batched
        # by free slots, so arrival order decides which) has fewer, never more. All of it is version 1 after.
        before = [int((t.versions == 0).sum()) for t in mixed]
        for t, n in zip(mixed, before, strict=True):
            assert t.versions.tolist() == [0] * n + [1] * (len(t.versions) - n)
        assert max(before) == 5, before
    finally:
        actor.stop()
        replay.stop()


def test_unacknowledged_episodes_are_resent_after_a_replay_restart(tmp_path):
    gate = threading.Event()
    verifier = ScriptedVerifier(gate=gate)
    replay = start_replay(tmp_path, G=2, B=1)
    actor = rollout_actor(
        tmp_path, rollout_cfg(max_turns=1, ack_timeout_s=0.3, task_wait_s=0.3), verifier=verifier.address
    )  # it looks replay up again after a timeout
    try:
        actor.start()
        wait_for(lambda: len(verifier.received) >= 2, what="the first group's verify requests")
        replay.stop()  # replay goes down while the episodes are being verified
        gate.set()
        wait_for(
            lambda: actor.health().episodes >= 2 and actor.sender.stats.timeouts >= 1,
            what="episodes held while replay is down",
        )
        assert actor.health().unacked >= 2
        replay = start_replay(tmp_path, G=2, B=1)  # recovers its state from disk, on a new port
        wait_for(lambda: actor.health().unacked == 0 and actor.health().acked >= 2, what="resent episodes", actor=actor)
        assert set(actor.acked_episode_ids()) <= stored_ids(replay)
        assert actor.acked_episode_ids()[:2] == [
            f"{verifier.received[0].episode_id.rsplit('/', 1)[0]}/{i}" for i in range(2)
        ]
    finally:
        actor.stop()
        replay.stop()
        verifier.close()


def test_a_silent_verifier_gets_a_resend_then_the_attempt_is_marked_infra(tmp_path):
    verifier = ScriptedVerifier(silent=True)
    replay = start_replay(tmp_path, G=2, B=1)
    actor = rollout_actor(
        tmp_path, rollout_cfg(verify_reply_timeout_s=0.3, verify_retries=1), verifier=verifier.address
    )
    seen = []
    actor.sender.submit = lambda ep, submit=actor.sender.submit: (seen.append(ep), submit(ep))[1]
    try:
        actor.start()
        wait_for(lambda: actor.health().acked >= 2, what="infra episodes acked", actor=actor)
        first_group = seen[:2]
        for ep in first_group:
            assert len(ep.turns) == 1  # no repair turn after an infra failure
            r = ep.turns[0].result
            assert r.error_class == "infra" and r.score == 0.0 and not r.passed
        ids = [r.request_id for r in verifier.received]
        assert all(ids.count(f"{ep.episode_id}/t0") == 2 for ep in first_group)  # sent, then resent once
        assert actor.health().verify_infra >= 2
    finally:
        actor.stop()
        replay.stop()
        verifier.close()


def test_a_restarted_verifier_is_found_through_the_registry(tmp_path):
    first = ScriptedVerifier()
    replay = start_replay(tmp_path, G=2, B=2)
    actor = rollout_actor(
        tmp_path, rollout_cfg(max_turns=1, verify_reply_timeout_s=0.5, verify_retries=2), verifier=first.address
    )
    second = None
    try:
        actor.start()
        wait_for(lambda: len(first.received) >= 2, what="requests to the first verifier", actor=actor)
        first.close()  # the verifier dies; its replacement registers under the same name, on a new port
        second = ScriptedVerifier()
        Registry(tmp_path).register("verifier-0", "verifier", {"verifier": second.address})
        wait_for(lambda: len(second.received) >= 2, what="requests to the restarted verifier", actor=actor)
        wait_for(lambda: actor.health().acked >= 4, what="episodes verified by the new verifier", actor=actor)
    finally:
        actor.stop()
        replay.stop()
        if second is not None:
            second.close()


def test_a_crashed_engine_restarts_with_the_current_weights_and_reruns_its_requests(tmp_path, text_verifier):
    current = build_model(dataclasses.replace(TINY, seed=31))
    learner = WeightServer(tmp_path / "learner", transport="disk")
    endpoints = learner.start()
    learner.publish(5, current.named_parameters)
    Registry(tmp_path).register("learner", "learner", endpoints)
    replay = start_replay(tmp_path, G=2, B=1)
    actor = rollout_actor(
        tmp_path, rollout_cfg(max_turns=1, max_new_tokens=12), verifier=text_verifier, follow_learner=True
    )
    seen = []
    actor.sender.submit = lambda ep, submit=actor.sender.submit: (seen.append(ep), submit(ep))[1]
    crashed = []

    def crash_once(step):
        if not crashed:
            crashed.append(step)
            raise RuntimeError("simulated device fault")

    try:
        actor.start()
        first_engine = actor.engine
        assert first_engine.weight_version == 5  # fetched before serving
        first_engine.step_hook = crash_once
        wait_for(lambda: actor.health().acked >= 2, what="episodes after the restart", actor=actor)
        assert crashed and actor.stats["engine_restarts"] == 1 and actor.engine is not first_engine
        assert actor.engine.weight_version == 5
        for ep in seen:
            turn = ep.turns[0]
            assert (turn.versions == 5).all()
            assert np.abs(reference_logprobs(current, turn.prompt_ids, turn.response_ids) - turn.logprobs).mean() < 1e-4
        assert learner.wait_confirmed(5, [actor.actor_id], timeout_s=10)
        assert actor.health().weights.bootstraps == 2  # at start and after the restart
    finally:
        actor.stop()
        replay.stop()
        learner.stop()


def test_rollout_actor_runs_as_a_ray_actor(tmp_path, text_verifier, ray_session):
    ray = ray_session
    replay = start_replay(tmp_path, G=2, B=1)
    Registry(tmp_path).register("verifier-0", "verifier", {"verifier": text_verifier})
    actor = as_ray_actor(RolloutActor, num_cpus=1).remote(
        rollout_cfg(), TINY, EvalConfig(), RunContext(run_dir=str(tmp_path), name="ray-rollout"), follow_learner=False
    )
    try:
        assert ray.get(actor.start.remote(), timeout=120) == {}
        wait_for(lambda: ray.get(actor.health.remote()).acked >= 4, timeout_s=120, what="Ray actor episodes")
        acked = ray.get(actor.acked_episode_ids.remote())
        assert set(acked) <= stored_ids(replay)
        assert ray.get(actor.weight_version.remote()) == 0
    finally:
        ray.get(actor.stop.remote(), timeout=60)
        ray.kill(actor)
        replay.stop()


def test_a_group_that_fails_is_counted_and_the_loop_keeps_serving(tmp_path, text_verifier):
    replay = start_replay(tmp_path, G=2, B=2)
    actor = rollout_actor(tmp_path, rollout_cfg(max_turns=1, max_new_tokens=4), verifier=text_verifier)
    try:
        actor.start()
        working_start = actor._start_engine
        restarts = []

        def unavailable():  # the first restart finds no device; later ones succeed
            restarts.append(1)
            if len(restarts) == 1:
                raise RuntimeError("no device available")
            return working_start()

        actor._start_engine = unavailable

        def crash(step):
            raise RuntimeError("simulated device fault")

        actor.engine.step_hook = crash
        wait_for(
            lambda: actor.health().group_errors >= 1 and actor.health().acked >= 2,
            what="a failed group, then acked episodes",
            actor=actor,
        )
        assert actor.health().looping and len(restarts) >= 2
    finally:
        actor.stop()
        replay.stop()
