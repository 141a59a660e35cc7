"""The per-attempt pipeline and the verifier pool's front, over real sockets: one slow verification
holds up neither its siblings' next turns nor other groups' generation; a dead verifier's requests go
to a live one at once (no reply timeout), and none is verified twice into an episode."""

from __future__ import annotations

import threading
import time

import pytest

from actors.base import RunContext
from actors.rollout.actor import RolloutActor
from configs import EvalConfig
from protocols.channels import ReplyServer
from protocols.registry import Registry
from tests.helpers.common import wait_for
from tests.rollout.test_actor import TINY, rollout_cfg, start_replay, wrong_answer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class HoldingVerifier:
    """A real ROUTER answering every VerifyRequest with a failure (so attempts take repair turns),
    except the ones `hold(request)` picks, which wait until `release` is set. Records when each
    request arrived."""

    def __init__(self, hold=lambda request: False, *, delay_s: float = 0.0) -> None:
        self.server = ReplyServer()
        self.address = self.server.address
        self.hold, self.delay_s = hold, delay_s
        self.release = threading.Event()
        self.arrived: dict[str, float] = {}
        self.answered: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        held = []
        while not self._stop.is_set():
            req = self.server.recv(timeout_s=0.01)
            if req is not None:
                self.arrived.setdefault(req.record.request_id, time.monotonic())
                if self.hold(req.record):
                    held.append(req)
                else:
                    self._answer(req)
            if self.release.is_set():
                for r in held:
                    self._answer(r)
                held.clear()

    def _answer(self, req) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)
        r = req.record
        self.answered.append(r.request_id)
        self.server.reply(req, wrong_answer(r))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.server.close()


def actor_for(run_dir, cfg, name="rollout-0") -> RolloutActor:
    return RolloutActor(cfg, TINY, EvalConfig(), RunContext(run_dir=str(run_dir), name=name), follow_learner=False)


def test_one_slow_verification_delays_neither_its_siblings_nor_other_groups(tmp_path):
    slow: list[str] = []

    def hold(request) -> bool:  # the first request of all: attempt 0 of the first group, turn 0
        if not slow:
            slow.append(request.request_id)
        return request.request_id == slow[0]

    verifier = HoldingVerifier(hold)
    Registry(tmp_path).register("verifier-0", "verifier", {"verifier": verifier.address})
    replay = start_replay(tmp_path, G=2, B=2)
    actor = actor_for(tmp_path, rollout_cfg(max_turns=3, max_new_tokens=4, max_attempts_at_engine=8))
    seen = []
    actor.sender.submit = lambda ep, submit=actor.sender.submit: (seen.append(ep), submit(ep))[1]
    try:
        actor.start()
        wait_for(lambda: slow, what="the first verify request", actor=actor)
        group = slow[0].rsplit("/", 2)[0]
        sibling = f"{group}/{1 - int(slow[0].rsplit('/', 2)[1])}"
        # the sibling goes through all its turns while the held verification waits
        wait_for(lambda: f"{sibling}/t2" in verifier.arrived, what="the sibling's third turn", actor=actor)
        # and other groups are generated and verified meanwhile, to the end of their attempts
        wait_for(
            lambda: any(not e.episode_id.startswith(group + "/") for e in seen),
            what="another group's episodes",
            actor=actor,
        )
        others = {rid.rsplit("/", 2)[0] for rid in verifier.arrived} - {group}
        assert others, "no other group was generated while one verification was held"
        assert slow[0] not in verifier.answered and not any(e.group_id == group for e in seen)
        verifier.release.set()
        wait_for(lambda: any(e.group_id == group for e in seen), what="the held group's episodes", actor=actor)
        held = [e for e in seen if e.group_id == group]
        assert len(held) == 2 and all(len(e.turns) == 3 for e in held)  # a complete group, every turn
        assert actor.health().verify_infra == 0
    finally:
        actor.stop()
        replay.stop()
        verifier.close()


def test_a_dead_verifiers_requests_go_to_a_live_one_at_once(tmp_path):
    # The first verifier takes requests and never answers; it dies with them outstanding. The reply
    # timeout is far longer than the test: the requests must move on the death itself.
    first = HoldingVerifier(lambda request: True)
    second = HoldingVerifier()
    registry = Registry(tmp_path)
    registry.register("verifier-0", "verifier", {"verifier": first.address})
    replay = start_replay(tmp_path, G=2, B=2)
    actor = actor_for(
        tmp_path, rollout_cfg(max_turns=1, max_new_tokens=4, verify_reply_timeout_s=300.0, max_attempts_at_engine=4)
    )
    seen = []
    actor.sender.submit = lambda ep, submit=actor.sender.submit: (seen.append(ep), submit(ep))[1]
    try:
        actor.start()
        wait_for(lambda: len(first.arrived) >= 2, what="requests held by the first verifier", actor=actor)
        registry.register("verifier-1", "verifier", {"verifier": second.address})
        time.sleep(1.0)  # the front sees the second verifier; the first keeps what it holds
        held = set(first.arrived)
        killed_at = time.monotonic()
        first.close()  # dies with its requests outstanding (its registry entry is still there)
        wait_for(lambda: held <= set(second.answered), timeout_s=10.0, what="the held requests re-sent", actor=actor)
        assert time.monotonic() - killed_at < 5.0
        wait_for(
            lambda: {e.episode_id for e in seen} >= {r.rsplit("/", 1)[0] for r in held},
            what="the moved attempts' episodes",
            actor=actor,
        )
        assert actor.health().verify_infra == 0 and actor.verify_stats["moved"] >= len(held)
        for ep in seen:  # one verdict per turn, from the live verifier
            assert [t.result.request_id for t in ep.turns] == [f"{ep.episode_id}/t0"]
    finally:
        actor.stop()
        replay.stop()
        second.close()


# ------------------------------------------------------------------------------- admission budgets


def test_with_every_verification_held_admission_stops_at_the_verification_budget(tmp_path):
    """Attempts waiting on verifiers count against their own budget: with every verification held, the
    actor starts and generates groups until that budget is reached, past the engine's batch and its
    engine budget. No group starts after that; the attempts the engine still held arrive at the verifier
    too, so it overshoots by at most the engine's budget plus G - 1."""
    verifier = HoldingVerifier(lambda request: True)
    Registry(tmp_path).register("verifier-0", "verifier", {"verifier": verifier.address})
    replay = start_replay(tmp_path, G=2, B=10)  # a window of (1 + 0 + 1) x 10 groups: the actor's budgets bind
    actor = actor_for(tmp_path, rollout_cfg(max_turns=1, max_new_tokens=4, max_batch=4, max_attempts_at_verifiers=15))
    try:
        actor.start()
        budget = actor.verify_budget
        assert budget == 15 and actor.attempt_budget == 8  # odd, so the last group of G = 2 overshoots it
        wait_for(lambda: len(verifier.arrived) >= budget, what="a budget's worth of held verifications", actor=actor)
        time.sleep(1.0)  # admission would go on here if the budget did not hold it
        h = actor.health()
        assert budget < h.inflight <= budget + actor.attempt_budget + 1
        time.sleep(0.5)
        assert actor.health().inflight == h.inflight  # no group came after it
        assert (
            h.at_engine == 0 and h.engine_tokens_reserved == 0 and len(verifier.arrived) == h.at_verifiers == h.inflight
        )
    finally:
        verifier.release.set()
        actor.stop()
        replay.stop()
        verifier.close()


def test_attempts_waiting_on_verifiers_leave_the_engine_its_whole_budget(tmp_path):
    """The engine's budget counts only the attempts at the engine: with every verification held, the
    engine goes on taking new groups, a full batch and a queue behind it, long after as many attempts as
    its budget wait on the verifier (an engine room that counted them would stop at 8)."""
    verifier = HoldingVerifier(lambda request: True)
    Registry(tmp_path).register("verifier-0", "verifier", {"verifier": verifier.address})
    replay = start_replay(tmp_path, G=2, B=20)
    actor = actor_for(tmp_path, rollout_cfg(max_turns=1, max_new_tokens=4, max_batch=4, max_attempts_at_verifiers=40))
    try:
        actor.start()
        assert actor.attempt_budget == 8
        wait_for(lambda: len(verifier.arrived) >= 24, what="three engine budgets' worth at the verifier", actor=actor)
        h = actor.health()
        assert h.at_verifiers >= 24 and h.inflight == h.at_engine + h.at_verifiers
    finally:
        verifier.release.set()
        actor.stop()
        replay.stop()
        verifier.close()


def test_attempts_at_the_engine_stop_admission_at_the_token_budget(tmp_path):
    """The token budget counts the attempts at the engine, each its prompt plus max_new_tokens: with the
    engine paused, requests pile up there until one more attempt's expected reservation no longer fits,
    far below the attempt budget; once the engine decodes again, the attempts leave it and admission goes on."""
    verifier = HoldingVerifier()
    Registry(tmp_path).register("verifier-0", "verifier", {"verifier": verifier.address})
    replay = start_replay(tmp_path, G=2, B=10)
    tokens = 128  # a few of this workload's attempts (prompts of about 15 tokens, 4 new)
    actor = actor_for(
        tmp_path,
        rollout_cfg(max_turns=1, max_new_tokens=4, max_batch=4, max_attempts_at_engine=16, max_tokens_in_flight=tokens),
    )
    try:
        actor.start()
        actor.engine.pause()
        wait_for(lambda: actor.health().at_engine >= 2, what="attempts waiting at the paused engine", actor=actor)
        time.sleep(1.0)
        h = actor.health()
        time.sleep(0.5)
        assert actor.health().inflight == h.inflight  # admission stopped
        pipeline = actor._pipeline_now
        assert h.at_engine == h.inflight < actor.attempt_budget  # the token budget stopped it, not the attempts
        assert h.engine_tokens_reserved == pipeline.engine_tokens
        # it stopped where one more attempt's expected reservation does not fit, overshooting by at most G - 1
        assert h.engine_tokens_reserved + pipeline.attempt_tokens > tokens
        assert h.engine_tokens_reserved <= tokens + (2 - 1) * TINY.max_seq_len
        assert h.at_engine >= 4  # more than the first group: the expected reservation follows the mean
        groups = actor.health().groups
        actor.engine.resume()
        wait_for(
            lambda: actor.health().groups >= groups + h.inflight // 2 + 1, what="groups after the resume", actor=actor
        )
    finally:
        actor.engine.resume()
        actor.stop()
        replay.stop()
        verifier.close()
