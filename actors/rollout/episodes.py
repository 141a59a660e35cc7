"""The multi-turn episode loop of one task group (DESIGN.md §5): sample G attempts, verify each,
build a repair turn for attempts that failed while turns < T, stop an attempt at its first pass.

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

from actors.policy.prompts import first_prompt, repair_prompt
from actors.rollout.engine import GenerateRequest, Generation, SamplingParams
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
    prompt: str
    turns: list[Turn] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    done: bool = False


class GroupRunner:
    """Runs one task group: generation through `generate`, verification through `verifier`."""

    def __init__(self, *, actor_id: str, generate: Callable[[list[GenerateRequest]], list[Generation]],
                 verifier: Verifier, tokenizer, params: SamplingParams, max_turns: int, max_seq_len: int,
                 force: Callable[[Task], str | None] | None = None) -> None:
        self.actor_id, self.generate, self.verifier = actor_id, generate, verifier
        # Forced-response mode (benchmarks, the CPU demo): the text to score instead of sampling.
        self.force = force
        self.tokenizer, self.params, self.max_turns = tokenizer, params, max_turns
        self.max_prompt_tokens = max_seq_len - 1  # room for at least one response token

    def run(self, reply: TaskReply) -> list[Episode]:
        task = reply.task
        try:
            prompt = first_prompt(task)
        except ValueError as err:  # a task this actor cannot pose: answer it as infra, keep serving
            return [self._unservable(reply, i, str(err)) for i in range(reply.group_size)]
        attempts = [_Attempt(episode_id=f"{reply.group_id}/{i}", sample_index=i, prompt=prompt)
                     for i in range(reply.group_size)]
        for turn in range(self.max_turns):
            live = [a for a in attempts if not a.done]
            if not live:
                break
            self._turn(task, turn, live, last=turn == self.max_turns - 1)
        return [Episode(episode_id=a.episode_id, task=task, group_id=reply.group_id, sample_index=a.sample_index,
                        turns=a.turns, rewards=a.rewards, is_retry=task.repair is not None, actor_id=self.actor_id)
                for a in attempts]

    def _unservable(self, reply: TaskReply, index: int, message: str) -> Episode:
        episode_id = f"{reply.group_id}/{index}"
        request = VerifyRequest(request_id=f"{episode_id}/t0", task=reply.task, candidate="", episode_id=episode_id)
        gen = _empty(episode_id)
        turn = Turn(prompt_ids=np.zeros(0, np.int64), response_ids=gen.output_ids, logprobs=gen.logprobs,
                    versions=gen.versions, finish_reason=gen.finish_reason,
                    result=self.verifier.infra(request, f"cannot build a prompt: {message}"))
        return Episode(episode_id=episode_id, task=reply.task, group_id=reply.group_id, sample_index=index,
                       turns=[turn], rewards=[0.0], is_retry=reply.task.repair is not None, actor_id=self.actor_id)

    def _forced(self, task: Task, prompt_len: int) -> list[int] | None:
        text = self.force(task) if self.force is not None else None
        if text is None:
            return None
        return _forced_ids(self.tokenizer, text, self.max_prompt_tokens + 1 - prompt_len, self.params.max_new_tokens)

    def _turn(self, task: Task, turn: int, live: list[_Attempt], last: bool) -> None:
        prompts = [self.tokenizer.prompt_ids(a.prompt) for a in live]
        requests = [VerifyRequest(request_id=f"{a.episode_id}/t{turn}", task=task, candidate="",
                                  episode_id=a.episode_id, turn=turn) for a in live]
        fits = [len(p) <= self.max_prompt_tokens for p in prompts]
        gens = iter(self.generate([
            GenerateRequest(request_id=f"{a.episode_id}/t{turn}/{uuid.uuid4().hex[:8]}", prompt_ids=p,
                            params=self.params, forced_response=self._forced(task, len(p)))
            for a, p, ok in zip(live, prompts, fits) if ok]))
        gens = [next(gens) if ok else None for ok in fits]
        texts = [self.tokenizer.decode(g.output_ids) if g else "" for g in gens]
        for r, text in zip(requests, texts):
            r.candidate = text
        verified = iter(self.verifier.verify_all([r for r, ok in zip(requests, fits) if ok]))
        # A prompt longer than the context is the configuration's fault (model.max_seq_len), not the
        # policy's: the attempt ends with an empty response marked infra, which replay leaves out.
        results = [next(verified) if ok else self.verifier.infra(
                       r, f"prompt of {len(p)} tokens exceeds model.max_seq_len - 1 = {self.max_prompt_tokens}")
                   for r, p, ok in zip(requests, prompts, fits)]
        for a, prompt, gen, text, result in zip(live, prompts, gens, texts, results):
            gen = gen or _empty(a.episode_id)
            a.turns.append(Turn(prompt_ids=np.asarray(prompt, dtype=np.int64), response_ids=gen.output_ids,
                                logprobs=gen.logprobs, versions=gen.versions, finish_reason=gen.finish_reason,
                                text=text, result=result))
            a.rewards.append(result.score)
            # A pass ends the attempt; so does infra (replay drops such an episode: more turns are waste).
            if result.passed or result.error_class == "infra" or last:
                a.done = True
            else:
                a.prompt = repair_prompt(task, text, result.feedback)


def _forced_ids(tokenizer, text: str, room: int, max_new_tokens: int) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    ids = tokenizer.encode(text) + ([int(eos)] if eos is not None else [])
    return ids[:max(1, min(room, max_new_tokens))]


def _empty(request_id: str) -> Generation:
    return Generation(request_id=request_id, output_ids=np.zeros(0, np.int64), logprobs=np.zeros(0, np.float32),
                      versions=np.zeros(0, np.int64), finish_reason="length")
