"""The verifier actor's health says whether its reward actor's one-off warm-up (warm(): the kernel
verifier's sandbox and precompiled headers) still runs: the driver's progress line names it as what
the run waits for on a cold machine (launch/observe/progress.py's waiting story)."""

from __future__ import annotations

import threading
import time

from actors.verifier.actor import VerifierActor
from actors.verifier.examples import TextMatchReward
from configs import load_config

WARM_GATE = threading.Event()


class SlowWarmReward(TextMatchReward):
    """The example reward actor with a warm-up that lasts until the test opens the gate."""

    def warm(self) -> None:
        WARM_GATE.wait(30)


def test_health_says_the_warm_up_runs_until_it_ends():
    cfg = load_config(None, [f"verifier.reward_actor={__name__}.SlowWarmReward"]).verifier
    actor = VerifierActor(cfg)
    WARM_GATE.clear()
    actor.start()
    try:
        assert actor.health().warming
        WARM_GATE.set()
        deadline = time.monotonic() + 10
        while actor.health().warming and time.monotonic() < deadline:
            time.sleep(0.05)
        health = actor.health()
        assert not health.warming and health.healthy  # the warm-up's thread ended; the actor serves on
    finally:
        WARM_GATE.set()
        actor.stop()
