"""The multi-turn episode loop of one task group (DESIGN.md §5): sample G attempts, verify each, and
ask the turn policy (actors/rollout/turns.py) what each attempt is asked next: a repair turn, a
performance turn, or nothing more.

`GroupRunner.run(reply)` returns the group's `Episode` records, one per attempt, each turn carrying
the prompt ids, response ids, behaviour logprobs, per-token weight versions and its VerifyResult.
Verification goes through `Verifier` (DEALER requests to the verifier or any reward actor, all of a
turn's attempts at once); one that does not answer in time is resent, then marked `infra`.
"""

from __future__ import annotations

import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from actors.rollout.engine import GenerateRequest, Generation, SamplingParams
from actors.rollout.turns import Attempt, Done, Prompt, TurnPolicy
from protocols import Episode, Task, TaskReply, Turn, VerifyRequest, VerifyResult, infra_result
from protocols.channels import ChannelTimeout, ReconnectingClient, RemoteError

log = logging.getLogger(__name__)


class Verifier:
    """Concurrent VerifyRequests over one DEALER per worker thread (zmq sockets are not thread-safe).
    `address` is the verifier pool ("a,b,..."), or a function that looks it up in the run's registry:
    each thread's client then follows restarted verifiers to their new addresses."""

    def __init__(self, address: str | Callable[[], str], *, timeout_s: float, retries: int,
                 concurrency: int = 16) -> None:
        self.address, self.timeout_s, self.retries = address, timeout_s, retries
        self._local = threading.local()
        self._clients: list[ReconnectingClient] = []
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="kiln-rollout-verify")
        self.stats = {"sent": 0, "infra": 0}

    def verify_all(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        return list(self._pool.map(self.verify, requests))

    def verify(self, request: VerifyRequest) -> VerifyResult:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = ReconnectingClient(self.address, timeout_s=self.timeout_s,
                                                             retries=self.retries)
            self._clients.append(client)
        self.stats["sent"] += 1
        try:
            result = client.request(request)
        except ChannelTimeout as err:
            return self.infra(request, f"no verifier answer: {err}")
        except RemoteError as err:
            return self.infra(request, f"verifier refused the request: {err}")
        if not isinstance(result, VerifyResult) or result.request_id != request.request_id:
            return self.infra(request, f"unexpected verifier answer {type(result).__name__}")
        return result

    def infra(self, request: VerifyRequest, message: str) -> VerifyResult:
        self.stats["infra"] += 1
        log.warning("attempt %s turn %d marked infra: %s", request.episode_id, request.turn, message)
        return infra_result(request, message)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for c in self._clients:
            c.close()


@dataclass
class _Attempt:
    episode_id: str
    sample_index: int
    prompt: Prompt | None  # the next turn's prompt; None once the turn policy said done
    turns: list[Turn] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)


class GroupRunner:
    """Runs one task group: generation through `generate`, verification through `verifier`, and what
    comes after each verdict through the turn policy (`actors.rollout.turns`)."""

    def __init__(self, *, actor_id: str, generate: Callable[[list[GenerateRequest]], list[Generation]],
                 verifier: Verifier, tokenizer, params: SamplingParams, policy: TurnPolicy,
                 force: Callable[[Task], str | None] | None = None) -> None:
        self.actor_id, self.generate, self.verifier = actor_id, generate, verifier
        # Forced-response mode (benchmarks, the CPU demo): the text to score instead of sampling.
        self.force = force
        self.tokenizer, self.params, self.policy = tokenizer, params, policy

    def run(self, reply: TaskReply) -> list[Episode]:
        task = reply.task
        first = self.policy.next_prompt(Attempt.of(task), None)
        if isinstance(first, Done):  # a task this actor cannot pose: replay takes it out of the feed
            return [self._unservable(reply, i, first.detail) for i in range(reply.group_size)]
        attempts = [_Attempt(episode_id=f"{reply.group_id}/{i}", sample_index=i, prompt=first)
                    for i in range(reply.group_size)]
        turn = 0
        while live := [a for a in attempts if a.prompt is not None]:
            self._turn(task, turn, live)
            turn += 1
        return [Episode(episode_id=a.episode_id, task=task, group_id=reply.group_id, sample_index=a.sample_index,
                        turns=a.turns, rewards=a.rewards, is_retry=task.repair is not None, actor_id=self.actor_id)
                for a in attempts]

    def _unservable(self, reply: TaskReply, index: int, message: str) -> Episode:
        episode_id = f"{reply.group_id}/{index}"
        request = VerifyRequest(request_id=f"{episode_id}/t0", task=reply.task, candidate="", episode_id=episode_id)
        gen = _empty(episode_id)
        turn = Turn(prompt_ids=np.zeros(0, np.int64), response_ids=gen.output_ids, logprobs=gen.logprobs,
                    versions=gen.versions, finish_reason=gen.finish_reason,
                    result=infra_result(request, f"cannot pose the task: {message}"))
        return Episode(episode_id=episode_id, task=reply.task, group_id=reply.group_id, sample_index=index,
                       turns=[turn], rewards=[0.0], is_retry=reply.task.repair is not None, actor_id=self.actor_id,
                       unservable=message)

    def _forced(self, task: Task) -> list[int] | None:
        text = self.force(task) if self.force is not None else None
        if text is None:
            return None
        return _forced_ids(self.tokenizer, text, self.params.max_new_tokens)

    def _turn(self, task: Task, turn: int, live: list[_Attempt]) -> None:
        # The turn policy sized every prompt to leave max_new_tokens of room in model.max_seq_len.
        gens = self.generate([
            GenerateRequest(request_id=f"{a.episode_id}/t{turn}/{uuid.uuid4().hex[:8]}", prompt_ids=list(a.prompt.ids),
                            params=self.params, forced_response=self._forced(task))
            for a in live])
        # The verifier sees the answer only: code inside a thinking block is never extracted.
        responses = [self.tokenizer.split_response(g.output_ids) for g in gens]
        results = self.verifier.verify_all([
            VerifyRequest(request_id=f"{a.episode_id}/t{turn}", task=task, candidate=r.answer,
                          episode_id=a.episode_id, turn=turn) for a, r in zip(live, responses)])
        for a, gen, response, result in zip(live, gens, responses, results):
            prompt = a.prompt
            a.turns.append(Turn(prompt_ids=np.asarray(prompt.ids, dtype=np.int64), response_ids=gen.output_ids,
                                logprobs=gen.logprobs, versions=gen.versions, finish_reason=gen.finish_reason,
                                text=response.answer, reasoning=response.reasoning, kind=prompt.kind, result=result))
            a.rewards.append(result.score)
            decision = self.policy.next_prompt(prompt.attempt.answered(prompt.kind, response), result)
            a.prompt = decision if isinstance(decision, Prompt) else None


def _forced_ids(tokenizer, text: str, max_new_tokens: int) -> list[int]:
    """A forced answer ends its turn as a sampled one would: with the end-of-turn token."""
    end = tokenizer.end_of_turn_id
    ids = tokenizer.encode(text) + ([int(end)] if end is not None else [])
    return ids[:max(1, max_new_tokens)]


def _empty(request_id: str) -> Generation:
    return Generation(request_id=request_id, output_ids=np.zeros(0, np.int64), logprobs=np.zeros(0, np.float32),
                      versions=np.zeros(0, np.int64), finish_reason="length")
