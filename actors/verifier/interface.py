"""The reward-actor interface: how a user replaces the kernel verifier with their own reward.

A reward actor is a plain class named by dotted path in `verifier.reward_actor`:

    class MyReward:
        def __init__(self, cfg: configs.VerifierConfig, **args) -> None: ...   # args: verifier.reward_actor_args
        def verify(self, request: protocols.VerifyRequest) -> protocols.VerifyResult: ...
        def warm(self) -> None: ...           # optional: slow preparation, on a background thread
        def cancel(self, request_id) -> bool: ...  # optional: end a call nobody waits for any more
        def close(self) -> None: ...          # optional: release processes, files, devices

Optional hooks get a default by subclassing `RewardActor`; `actors.base.load_plugin` checks the class.
A reward actor that runs work on GPUs sets the class attribute `takes_slot = True` and is then also
constructed with `slot=`: its actor's placement (`actors.base.Slot`, whose GPUs it should use; None
outside a run, where it may use every device its process sees). The kernel verifier does.

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

from typing import Protocol

from configs import VerifierConfig
from protocols import VerifyRequest, VerifyResult

DEFAULT_REWARD_ACTOR = "actors.verifier.verifier.KernelVerifier"


class RewardActor(Protocol):
    """The reward-actor interface. `verify` is required; `warm`, `cancel` and `close` are optional hooks with
    default bodies, which a plug-in inherits by subclassing this class (the shipped ones do)."""

    takes_slot: bool = False  # True: constructed with slot= too (its actor's placement, above)

    def __init__(self, cfg: VerifierConfig, **args) -> None: ...

    def verify(self, request: VerifyRequest) -> VerifyResult:
        """The verdict on `request`; may be called from several threads at once."""
        ...

    def warm(self) -> None:
        """Slow one-off preparation (precompiled headers, a process pool), run on a background thread
        once the actor serves, so start-up is not held up by it."""

    def cancel(self, request_id: str) -> bool:
        """End the call verifying `request_id` early: its caller no longer waits (a service's deadline
        passed). The call then returns whatever it returns (the service has answered already); True
        when such a call was found. By default nothing is cancelled: the call runs to its end."""
        return False

    def close(self) -> None:
        """Release processes, files and devices when the actor stops."""
