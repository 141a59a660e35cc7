"""The reward-actor interface: how a user replaces the kernel verifier with their own reward.

A reward actor is a plain class named by dotted path in `verifier.reward_actor`:

    class MyReward:
        def __init__(self, cfg: configs.VerifierConfig) -> None: ...
        def verify(self, request: protocols.VerifyRequest) -> protocols.VerifyResult: ...
        def close(self) -> None: ...          # optional: release processes, files, devices

`verify` gets the whole request (its `task.kind` and `task.payload` or `task.kernel`, the raw model
output in `candidate`) and returns a VerifyResult for the same `request_id` and `task_id`, with
`passed`, `stage`, `error_class` (null when passed), `q` in [0, 1], `score` (the reward) and a short
`feedback` text that the next repair turn shows the model. It may be called from several threads at
once. The VerifierActor runs each call under a timeout and answers `infra` (score 0, excluded from
training) when a call raises, hangs, or returns something that is not a valid VerifyResult for that
request, and keeps serving. The kernel verifier (`actors.verifier.verifier.KernelVerifier`) and the
example `actors.verifier.examples.TextMatchReward` implement this interface.
"""

from __future__ import annotations

import importlib
from typing import Protocol, runtime_checkable

from configs import VerifierConfig
from protocols import VerifyRequest, VerifyResult

DEFAULT_REWARD_ACTOR = "actors.verifier.verifier.KernelVerifier"


@runtime_checkable
class RewardActor(Protocol):
    def __init__(self, cfg: VerifierConfig) -> None: ...

    def verify(self, request: VerifyRequest) -> VerifyResult: ...


class RewardActorError(ValueError):
    """`verifier.reward_actor` does not name a usable reward-actor class."""


def load_reward_actor(path: str | None) -> type:
    """The class named by `path` ("package.module.Class"); None means the kernel verifier."""
    path = path or DEFAULT_REWARD_ACTOR
    module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise RewardActorError(f"verifier.reward_actor={path!r} is not a dotted path 'package.module.Class'")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or the module itself failed while importing
        raise RewardActorError(f"verifier.reward_actor={path!r}: cannot import {module_name}: "
                               f"{type(err).__name__}: {err}") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise RewardActorError(f"verifier.reward_actor={path!r}: module {module_name} has no {attr!r}")
    if not isinstance(cls, type):
        raise RewardActorError(f"verifier.reward_actor={path!r} is a {type(cls).__name__}, not a class")
    if not callable(getattr(cls, "verify", None)):
        raise RewardActorError(f"verifier.reward_actor={path!r}: {attr} has no verify(request) method")
    return cls

