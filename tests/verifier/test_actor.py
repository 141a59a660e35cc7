"""VerifierActor over its real ZMQ ROUTER, in-process and as a Ray actor; reward actors by dotted path.

The plug-in classes below are test reward actors: one that misbehaves on command (raises, hangs,
returns garbage) and one that answers slowly, to show that replies leave in completion order.
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from actors.base import PluginError, as_ray_actor, load_plugin
from actors.buffer.examples import TextMatchTasks
from actors.verifier.actor import VerifierActor
from actors.verifier.examples import TextMatchReward
from actors.verifier.interface import RewardActor
from configs import ReplayConfig, VerifierConfig, load_config
from protocols import Task, TaskRequest, VerifyRequest, VerifyResult
from protocols.channels import RemoteError, RequestClient
from tasks.loader import load_tasks

TEXT_TASK = Task(task_id="text/reverse/abc", kind="text_match", payload={"prompt": "Reverse: abc\n", "answer": "cba"})


class Misbehaving(RewardActor):
    """Reward actor that does what the candidate text says."""

    def __init__(self, cfg: VerifierConfig) -> None:
        self.good = TextMatchReward(cfg)

    def verify(self, request: VerifyRequest):
        what = request.candidate
        if what == "raise":
            raise RuntimeError("plug-in bug")
        if what == "hang":
            threading.Event().wait()
        if what == "garbage":
            return {"passed": True}
        if what == "wrong-id":
            return self.good.verify(VerifyRequest(request_id="someone-else", task=request.task, candidate="cba"))
        if what == "nan":
            r = self.good.verify(request)
            r.score = float("nan")
            return r
        return self.good.verify(request)


class Slow(RewardActor):
    """Sleeps for the number of seconds the candidate names, then answers."""

    def __init__(self, cfg: VerifierConfig) -> None:
        self.good = TextMatchReward(cfg)

    def verify(self, request: VerifyRequest) -> VerifyResult:
        time.sleep(float(request.candidate))
        return self.good.verify(request)


def cfg_with(reward_actor: str | None, **extra) -> VerifierConfig:
    items = {"verifier.reward_actor": reward_actor, **extra}
    return load_config(None, [f"{k}={'null' if v is None else v}" for k, v in items.items()]).verifier


def request(candidate: str, task: Task = TEXT_TASK) -> VerifyRequest:
    return VerifyRequest(request_id=uuid.uuid4().hex, task=task, candidate=candidate)


@pytest.fixture
def running():
    actors = []

    def start(cfg: VerifierConfig):
        actor = VerifierActor(cfg)
        address = actor.start()["verifier"]
        actors.append(actor)
        return actor, address

    yield start
    for actor in actors:
        actor.stop()


# ------------------------------------------------------------------------------- plug-in loading


def test_example_reward_actor_loads_by_dotted_path_and_scores():
    cls = load_plugin("actors.verifier.examples.TextMatchReward", RewardActor, key="verifier.reward_actor")
    actor = cls(VerifierConfig())
    exact = actor.verify(request("cba\nbecause reversing"))
    assert exact.passed and exact.score == 1.0 and exact.error_class is None
    near, far = actor.verify(request("cb")), actor.verify(request("zzz"))
    assert -1.0 <= far.score < near.score < 0.5 and not near.passed and near.error_class == "correctness"
    other = actor.verify(request("x", Task(task_id="k", kind="other", payload={})))
    assert other.error_class == "infra" and other.score == 0.0


def test_example_reward_actor_scores_the_example_task_source():
    tasks = TextMatchTasks(ReplayConfig(), backend="cpu").tasks()
    actor = TextMatchReward(VerifierConfig())
    for task in tasks[:5]:
        assert actor.verify(request(task.payload["answer"], task)).score == 1.0


@pytest.mark.parametrize(
    "path, message",
    [
        ("no_such_module.Reward", "cannot import module 'no_such_module'"),
        ("actors.verifier.examples.Missing", "has no attribute 'Missing'"),
        ("actors.verifier.examples.KIND", "not a class"),
        ("Reward", "not a dotted path"),
        ("actors.base.Actor", r"lacks verify\(\), warm\(\), cancel\(\), close\(\) of RewardActor"),
    ],
)
def test_bad_dotted_path_fails_at_start_up(path, message):
    with pytest.raises(PluginError, match=message):
        VerifierActor(cfg_with(path))


# ----------------------------------------------------------------------------- serving over ZMQ


def test_actor_serves_the_example_reward_actor_named_in_the_config(running):
    actor, address = running(cfg_with("actors.verifier.examples.TextMatchReward"))
    with RequestClient(address, timeout_s=10.0, retries=0) as client:
        r = client.request(request("cba"))
    assert r.passed and r.score == 1.0 and r.task_id == TEXT_TASK.task_id
    assert actor.health().reward_actor == "actors.verifier.examples.TextMatchReward"


def test_misbehaving_reward_actor_yields_infra_and_the_actor_keeps_serving(running):
    actor, address = running(cfg_with("tests.verifier.test_actor.Misbehaving", **{"verifier.reward_timeout_s": 1.0}))
    with RequestClient(address, timeout_s=10.0, retries=0) as client:
        for what, needle in [
            ("raise", "raised RuntimeError: plug-in bug"),
            ("hang", "did not answer within 1 s"),
            ("garbage", "expected a VerifyResult, got dict"),
            ("wrong-id", "someone-else"),
            ("nan", "not a finite number"),
        ]:
            r = client.request(request(what))
            assert isinstance(r, VerifyResult) and r.error_class == "infra" and r.score == 0.0, what
            assert needle in r.feedback, (what, r.feedback)
        good = client.request(request("cba"))
        assert good.passed and good.score == 1.0
        with pytest.raises(RemoteError, match="answers VerifyRequest"):
            client.request(TaskRequest(actor_id="confused"))
    health = actor.health()
    assert health.infra == 5 and health.hung == 1 and health.rejected == 1 and health.replied == 6


def test_replies_leave_in_completion_order(running):
    _, address = running(cfg_with("tests.verifier.test_actor.Slow", **{"verifier.max_concurrent_requests": 4}))
    finished: list[str] = []

    def ask(delay: str) -> VerifyResult:
        with RequestClient(address, timeout_s=20.0, retries=0) as client:
            r = client.request(request(delay))
            finished.append(delay)
            return r

    started = time.monotonic()
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(ask, ["2.0", "0.1", "1.0"]))
    assert finished == ["0.1", "1.0", "2.0"]
    assert time.monotonic() - started < 3.5  # served concurrently, not one after another
    assert all(r.error_class == "correctness" for r in results)


def test_kernel_verifier_behind_the_actor(running, verifier_cache_dir):
    task = next(t for t in load_tasks("tasks/level1", "cpu") if t.task_id == "level1/01_relu")
    cfg = cfg_with(None, **{"verifier.cache_dir": str(verifier_cache_dir), "verifier.compile_baseline": "never"})
    actor, address = running(cfg)
    source = "import torch\nimport torch.nn as nn\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        return torch.relu(x)\n"
    with RequestClient(address, timeout_s=120.0, retries=0) as client:
        r = client.request(request(source, task))
        misrouted = client.request(request("cba"))
    assert r.error_class == "cheating" and "aten::relu" in r.feedback
    assert misrouted.error_class == "infra" and "cannot verify tasks of kind 'text_match'" in misrouted.feedback
    assert actor.health().reward_actor == "actors.verifier.verifier.KernelVerifier"


# ------------------------------------------------------------------------------------------ Ray


def test_runs_as_a_ray_actor(ray_session, verifier_cache_dir):
    ray = ray_session
    task = next(t for t in load_tasks("tasks/level1", "cpu") if t.task_id == "level1/01_relu")
    cfg = cfg_with(None, **{"verifier.cache_dir": str(verifier_cache_dir), "verifier.compile_baseline": "never"})
    handle = as_ray_actor(VerifierActor, num_cpus=0).remote(cfg)
    try:
        address = ray.get(handle.start.remote(), timeout=120)["verifier"]
        source = "import torch\nimport torch.nn as nn\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        return x.abs()\n"
        with RequestClient(address, timeout_s=120.0, retries=0) as client:
            r = client.request(request(source, task))
        assert r.error_class == "cheating" and "aten::abs" in r.feedback
        assert ray.get(handle.health.remote(), timeout=30).replied == 1
        ray.get(handle.stop.remote(), timeout=60)
    finally:
        ray.kill(handle)
