"""A reward actor for the service's tests: it answers in the time the candidate asks for
("sleep 1.5"), passes "pass" and fails anything else, and puts a host detail in its diagnostics (what
a remote client must not see). Closing it (its actor stopped) ends every call it holds at once;
cancelling a call (the service's deadline passed) ends that one, and is recorded."""

from __future__ import annotations

import threading
import time

from actors.verifier.interface import RewardActor
from protocols import VerifyRequest, VerifyResult


class PacedReward(RewardActor):
    def __init__(self, cfg, **args) -> None:
        self.closed = threading.Event()
        self.calls: dict[str, threading.Event] = {}  # in flight, by request id: set by cancel()
        self.cancelled: list[str] = []  # request ids whose call cancel() ended

    def verify(self, request: VerifyRequest) -> VerifyResult:
        words = request.candidate.split()
        if words[:1] == ["sleep"]:
            ended = self.calls[request.request_id] = threading.Event()
            deadline = time.monotonic() + float(words[1])
            while time.monotonic() < deadline and not ended.is_set() and not self.closed.is_set():
                ended.wait(0.02)
            del self.calls[request.request_id]
            if self.closed.is_set():
                raise RuntimeError("the verifier stopped under this call")
            if ended.is_set():
                raise RuntimeError("this call was cancelled")
        passed = "pass" in words
        return VerifyResult(
            request_id=request.request_id,
            task_id=request.task.task_id,
            passed=passed,
            stage="done" if passed else "correctness",
            error_class=None if passed else "correctness",
            q=1.0 if passed else 0.0,
            score=1.0 if passed else -1.0,
            feedback="ok" if passed else "wrong",
            diagnostics={
                "toolchain": "g++-12|secret-flags",
                "sandbox": {"limits": {"machine_mb": 24000, "memory_mb": 512}},
            },
            timings={"total": 0.01},
        )

    def cancel(self, request_id: str) -> bool:
        ended = self.calls.get(request_id)
        if ended is None:
            return False
        self.cancelled.append(request_id)
        ended.set()
        return True

    def close(self) -> None:
        self.closed.set()
