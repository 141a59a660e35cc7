"""How an engine joins the learner's weights over gloo (docs/training.md, "Faults"): an engine that
restarts rejoins and keeps receiving; an engine rejoining a restarted learner at the version it
serves does not hold the learner's next step; a join between a step and its publish gets the new
version, never the stepped weights under the old label; a join whose group cannot form falls back to
disk."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from actors.rollout.engine import EngineError, GenerateRequest, SamplingParams
from protocols.registry import Registry
from tests.helpers.weights import PROMPT, T, assert_serves, rollout_actor, serving, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_restarted_engine_rejoins_over_gloo_and_keeps_receiving(tmp_path):
    model = tiny_model(seed=6)
    with serving(tmp_path, model) as (server, endpoints):
        actor = rollout_actor(tmp_path, endpoints, "phoenix")
        try:
            actor.start()
            first = actor.engine
            assert first.weight_version == 1

            def crash(step):
                raise RuntimeError("simulated device fault")

            first.step_hook = crash
            params = SamplingParams(temperature=T, max_new_tokens=4, ignore_eos=True)
            (gen,) = actor.generate([GenerateRequest("again", PROMPT, params)])  # restarted, re-bootstrapped
            assert actor.engine is not first and gen.versions.tolist() == [1] * 4
            assert actor.health().weights.bootstraps == 2 and server.stats["joins"] == 2
            with torch.no_grad():
                model.model.norm.weight.mul_(1.5)
            report = server.publish(2, model.named_parameters)  # reaches the new engine's group only
            assert report.engines == 1 and not report.dropped
            assert server.wait_confirmed(2, ["phoenix"], timeout_s=30) and actor.engine.weight_version == 2
            assert_serves(actor, model)
        finally:
            actor.stop()


def test_an_engine_rejoining_at_the_current_version_does_not_hold_the_learners_step(tmp_path):
    # The learner restarted at the version the engine serves (it restored that step's checkpoint): the
    # engine rejoins, and its end of the group forms when its process gets around to it (here 1.5 s
    # late). The learner's step must not wait for that, and its next publish reaches the engine.
    model = tiny_model(seed=8)
    actor = None
    try:
        with serving(tmp_path, model) as (_, endpoints):
            actor = rollout_actor(tmp_path, endpoints, "steady")
            actor.start()
        assert actor.engine.weight_version == 1  # and the learner it joined is gone (stopped above)
        engine = actor.engine
        joining = threading.Event()
        join_group = engine.init_weights_update_group

        def late_join(*args, **kwargs):
            joining.set()
            time.sleep(1.5)
            return join_group(*args, **kwargs)

        engine.init_weights_update_group = late_join
        with serving(tmp_path, model) as (second, endpoints):  # its successor, restored at version 1
            Registry(tmp_path).register("learner", "learner", endpoints)
            assert joining.wait(10), "the engine did not rejoin the new learner"
            started = time.monotonic()
            with second.updating():  # the learner's next step
                waited = time.monotonic() - started
                with torch.no_grad():
                    model.model.norm.weight.mul_(1.25)
            assert waited < 0.5, f"the step waited {waited:.2f} s for an engine's group to form"
            report = second.publish(2, model.named_parameters)  # waits for the group, then pushes into it
            assert report.engines == 1 and not report.dropped and second.stats["joins"] == 1
            assert second.wait_confirmed(2, ["steady"], timeout_s=30) and engine.weight_version == 2
            assert_serves(actor, model)
    finally:
        if actor is not None:
            actor.stop()


def test_a_join_between_a_step_and_its_publish_gets_the_new_version_not_the_old_label(tmp_path):
    # Between the learner's optimizer step and the publish of its version, the weights are no published
    # version: an engine joining then must not receive them labelled with the version before the step.
    model = tiny_model(seed=9)
    with serving(tmp_path, model) as (server, endpoints):
        actor = rollout_actor(tmp_path, endpoints, "late")
        try:
            # the step: weights of version 2 from here on, published below
            with server.updating(), torch.no_grad():
                model.model.norm.weight.mul_(0.8)
            joined = threading.Thread(target=actor.start, daemon=True)
            joined.start()
            time.sleep(1.0)
            assert joined.is_alive(), "the engine joined with the stepped weights before their version was published"
            server.publish(2, model.named_parameters)
            joined.join(30)
            assert not joined.is_alive() and actor.engine.weight_version == 2
            assert_serves(actor, model)
        finally:
            actor.stop()


def test_a_failed_group_join_falls_back_to_disk(tmp_path, monkeypatch):
    model = tiny_model(seed=4)

    def refuse(self, *args, **kw):
        raise EngineError("no route to the learner's rendezvous")

    from actors.rollout.torch_engine import TorchEngine

    monkeypatch.setattr(TorchEngine, "init_weights_update_group", refuse)
    with serving(tmp_path, model, version=7, join_timeout_s=2) as (server, endpoints):
        actor = rollout_actor(tmp_path, endpoints, "fallback")
        try:
            actor.start()
            assert actor.engine.weight_version == 7
            assert actor.health().weights.disk_fallbacks == 1 and server.stats["disk_fallbacks"] == 1
            assert (tmp_path / "weights" / "v7" / "model.safetensors").exists()
            assert_serves(actor, model)
        finally:
            actor.stop()
