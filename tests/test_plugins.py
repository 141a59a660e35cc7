"""The plug-in contract: every kind (engine, reward actor, task source) is named by dotted path in the
config and loaded by the one loader, `actors.base.load_plugin`, which checks it against its interface.

Each shipped plug-in is loaded through the config field a user would set and then used for real; a
class that lacks a method of its interface is refused with one line naming the method.
"""

from __future__ import annotations

import pytest

from actors.base import PluginError, load_plugin
from actors.buffer.task_source import TaskSource, load_task_set
from actors.rollout.engine import Engine, GenerateRequest, SamplingParams
from actors.rollout.engines import engine_class, make_engine
from actors.verifier.actor import VerifierActor
from actors.verifier.interface import RewardActor
from configs import load_config
from protocols import VerifyRequest


class VerifyOnly:
    """A reward actor written without subclassing the interface: it lacks the optional hooks."""

    def __init__(self, cfg) -> None: ...

    def verify(self, request): ...


class VerifyOnlySubclass(RewardActor):
    """The same, subclassing the interface: it inherits `warm` and `close`."""

    def __init__(self, cfg) -> None: ...

    def verify(self, request): ...


def test_engine_by_dotted_path_builds_from_config_and_generates():
    cfg = load_config(
        None, ["rollout.engine=actors.rollout.torch_engine.TorchEngine", "rollout.max_batch=2", "model.path=null"]
    )  # the byte-level random model: no checkpoint to build
    engine = make_engine(cfg.rollout, cfg.model, index=0, eos_token_ids=[])
    try:
        out = engine.generate([GenerateRequest("r0", [256, 65, 66], SamplingParams(max_new_tokens=4))])[0]
        assert isinstance(engine, Engine) and len(out.output_ids) == 4 and len(out.logprobs) == 4
        assert out.logprobs.max() <= 0.0
    finally:
        engine.close()
    assert engine_class("torch") is engine_class("actors.rollout.torch_engine.TorchEngine")


def test_reward_actor_by_dotted_path_serves_its_kind():
    from actors.buffer.examples import TextMatchTasks
    from configs import ReplayConfig

    cfg = load_config(None, ["verifier.reward_actor=actors.verifier.examples.TextMatchReward"]).verifier
    actor = VerifierActor(cfg)
    task = TextMatchTasks(ReplayConfig(), "cpu").tasks()[0]
    actor.start()
    try:
        result = actor.reward_cls(cfg).verify(
            VerifyRequest(request_id="x", task=task, candidate=task.payload["answer"])
        )
        assert result.passed and result.score == 1.0
    finally:
        actor.stop()


def test_reward_actor_args_reach_the_constructor_of_the_served_reward_actor():
    import asyncio
    import difflib

    from actors.buffer.examples import TextMatchTasks
    from actors.rollout.verify_pool import VerifierPool
    from configs import ConfigError, ReplayConfig

    task = TextMatchTasks(ReplayConfig(), "cpu").tasks()[0]
    near_miss = task.payload["answer"][:-1] + "#"
    overlap = difflib.SequenceMatcher(None, near_miss, task.payload["answer"]).ratio()
    for args, weight in (([], 1.5), (["verifier.reward_actor_args={partial_credit: 0.5}"], 0.5)):
        cfg = load_config(None, ["verifier.reward_actor=actors.verifier.examples.TextMatchReward", *args]).verifier
        actor = VerifierActor(cfg)
        address = actor.start()["verifier"]

        async def ask(address=address):  # through the actor's socket, as a rollout asks
            pool = VerifierPool(address, timeout_s=10.0, retries=0)
            try:
                return await pool.verify(VerifyRequest(request_id="x", task=task, candidate=near_miss))
            finally:
                await pool.close()

        try:
            result = asyncio.run(ask())
        finally:
            actor.stop()
        assert result.score == pytest.approx(-1.0 + weight * overlap)
    with pytest.raises(ConfigError, match="reward_actor_args are the constructor arguments of a plug-in"):
        load_config(None, ["verifier.reward_actor_args={partial_credit: 0.5}"])


def test_task_source_by_dotted_path_feeds_the_split():
    cfg = load_config(None, ["replay.task_source=actors.buffer.examples.TextMatchTasks"])
    tasks = load_task_set(cfg.replay, "cpu")
    assert tasks.train and all(t.kind == "text_match" for t in tasks.train + tasks.val)
    assert load_plugin("actors.buffer.examples.TextMatchTasks", TaskSource, key="replay.task_source")


def test_optional_hooks_come_from_the_interface_not_from_getattr():
    with pytest.raises(PluginError, match=r"lacks warm\(\), cancel\(\), close\(\) of RewardActor \(subclass "):
        load_plugin(f"{__name__}.VerifyOnly", RewardActor, key="verifier.reward_actor")
    cls = load_plugin(f"{__name__}.VerifyOnlySubclass", RewardActor, key="verifier.reward_actor")
    cls(None).warm()  # inherited no-op hooks
    assert cls(None).cancel("a request") is False
    cls(None).close()


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("rollout.engine", "no_such.Engine", "rollout.engine='no_such.Engine': cannot import module 'no_such'"),
        (
            "rollout.engine",
            "actors.buffer.examples.TextMatchTasks",
            r"lacks from_config\(\), generate\(\), submit\(\), abort\(\)",
        ),
        ("replay.task_source", "actors.verifier.examples.TextMatchReward", r"lacks tasks\(\) of TaskSource"),
        ("verifier.reward_actor", "actors.buffer.examples.KIND", "names a str, not a class"),
    ],
)
def test_a_bad_plug_in_is_one_line_naming_the_field(key, value, message):
    cfg = load_config(None, [f"{key}={value}"])
    with pytest.raises(PluginError, match=message) as err:
        if key == "rollout.engine":
            make_engine(cfg.rollout, cfg.model, index=0, eos_token_ids=[])
        elif key == "replay.task_source":
            load_task_set(cfg.replay, "cpu")
        else:
            VerifierActor(cfg.verifier)
    assert "\n" not in str(err.value)
