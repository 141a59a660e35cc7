"""The per-attempt episode pipeline (docs/rollout.md): every attempt of a task group flows on its own —
generate, verify, ask the turn policy (actors/rollout/turns.py) what comes next, and again — and a
group is complete when its last attempt is.

Everything runs on one asyncio event loop. An attempt awaits its engine request (the engine batches
it with every other attempt in flight) and then its verification (sent the moment its generation
ends, through the verifier pool's front); no attempt waits for a sibling, and no group waits for
another. `Pipeline.at_engine` counts the attempts at the engine, `Pipeline.at_verifiers` those waiting
on verifiers and `Pipeline.engine_tokens` the engine tokens the attempts at the engine reserve (each its
prompt plus max_new_tokens): what the rollout actor's admission (`rollout.max_attempts_at_engine`,
`rollout.max_attempts_at_verifiers`, `rollout.max_tokens_in_flight`, actors/decisions.py) weighs.

`Pipeline.run_group(reply)` returns the group's `Episode` records, one per attempt, each turn carrying
the prompt ids, response ids, behaviour logprobs, per-token weight versions and its VerifyResult.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from actors.rollout.engine import GenerateRequest, Generation, SamplingParams
from actors.rollout.turns import Attempt, Done, Prompt, TurnPolicy
from protocols import Episode, Task, TaskReply, Turn, VerifyRequest, VerifyResult, infra_result
from protocols.channels import ChannelTimeout, ReconnectingClient, RemoteError

log = logging.getLogger(__name__)


class Verifier:
    """A synchronous verifier client for callers outside the event loop (evaluation, `kiln eval`,
    `kiln rft`): concurrent VerifyRequests over one DEALER per worker thread (zmq sockets are not
    thread-safe). Training's attempts go through the pool's front instead (verify_pool.py).
    `address` is the verifier pool ("a,b,..."), or a function that looks it up in the run's registry:
    each thread's client then follows restarted verifiers to their new addresses."""

    def __init__(
        self, address: str | Callable[[], str], *, timeout_s: float, retries: int, concurrency: int = 16
    ) -> None:
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
            client = self._local.client = ReconnectingClient(
                self.address, timeout_s=self.timeout_s, retries=self.retries
            )
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


Generate = Callable[[GenerateRequest], Awaitable[Generation]]
Verify = Callable[[VerifyRequest], Awaitable[VerifyResult]]


class Pipeline:
    """Attempts of many groups in flight at once: generation through `generate`, verification through
    `verify`, and what comes after each verdict through the turn policy."""

    def __init__(
        self,
        *,
        actor_id: str,
        generate: Generate,
        verify: Verify,
        tokenizer,
        params: SamplingParams,
        policy: TurnPolicy,
        force: Callable[[Task], str | None] | None = None,
        first_attempt_tokens: int = 0,
        decode_forced: bool = False,
    ) -> None:
        self.actor_id, self.generate, self.verify = actor_id, generate, verify
        # Forced-response mode (benchmarks, the CPU demo): the text to score instead of sampling.
        self.force = force
        # Benchmarks (rollout.bench.decode_forced): a forced attempt is decoded as a sampled one is, and
        # the drawn candidate is its answer for the verifier and the dialogue.
        self.decode_forced = decode_forced
        self.tokenizer, self.params, self.policy = tokenizer, params, policy
        self.inflight = 0  # attempts admitted and not finished
        self.at_engine = 0  # attempts whose generate request is at the engine
        self.at_verifiers = 0  # attempts sent to verifiers and not answered
        self.engine_tokens = 0  # the tokens those reserve: prompt plus max_new_tokens each
        # What an attempt is expected to reserve before any has (the actor passes model.max_seq_len, the
        # most a prompt sized by the turn policy plus its response can take); then the mean so far.
        self._first_attempt_tokens = first_attempt_tokens or params.max_new_tokens
        self._reserved = [0, 0]  # generate requests sent, tokens they reserved
        # set whenever an attempt leaves the engine or a verifier, or finishes (admission may go on)
        self.room = asyncio.Event()

    @property
    def attempt_tokens(self) -> float:
        """The engine tokens one more attempt is expected to reserve."""
        sent, tokens = self._reserved
        return tokens / sent if sent else float(self._first_attempt_tokens)

    async def run_group(self, reply: TaskReply) -> list[Episode]:
        """The group's episodes once its last attempt is done. If an attempt fails (an engine that
        cannot be restarted), the others still run to their end, then the first error is raised."""
        task = reply.task
        first = self.policy.next_prompt(Attempt.of(task), None)
        if isinstance(first, Done):  # a task this actor cannot pose: replay takes it out of the feed
            return [self._unservable(reply, i, first.detail) for i in range(reply.group_size)]
        self.inflight += reply.group_size
        # The first turns' reservations are made here, before the first await, so the admission that
        # started this group reads them at its next check (the attempts' own coroutines start later).
        reserved = [self._reserve(first) for _ in range(reply.group_size)]
        results = await asyncio.gather(
            *(self._attempt(reply, i, first, reserved[i]) for i in range(reply.group_size)), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return list(results)

    def _reserve(self, prompt: Prompt) -> int:
        """Count one generate request at the engine: its prompt plus max_new_tokens (the turn policy sized
        every prompt to leave that much room in model.max_seq_len)."""
        reserved = len(prompt.ids) + self.params.max_new_tokens
        self.at_engine += 1
        self.engine_tokens += reserved
        self._reserved[0] += 1
        self._reserved[1] += reserved
        return reserved

    async def _attempt(self, reply: TaskReply, index: int, prompt: Prompt, reserved: int) -> Episode:
        """`reserved`: the first turn's reservation, made when the group was admitted."""
        task, episode_id = reply.task, f"{reply.group_id}/{index}"
        turns: list[Turn] = []
        try:
            while True:
                turn = len(turns)
                reserved = reserved or self._reserve(prompt)
                forced = self._forced(task)
                decoded = forced is not None and self.decode_forced  # sampled tokens, the candidate's answer
                try:
                    gen = await self.generate(
                        GenerateRequest(
                            request_id=f"{episode_id}/t{turn}/{uuid.uuid4().hex[:8]}",
                            prompt_ids=list(prompt.ids),
                            params=self.params,
                            forced_response=None if decoded else forced,
                        )
                    )
                finally:
                    self.at_engine -= 1
                    self.engine_tokens -= reserved
                    reserved = 0
                    self.room.set()
                # The verifier sees the answer only: code inside a thinking block is never extracted.
                response = self.tokenizer.split_response(np.asarray(forced) if decoded else gen.output_ids)
                self.at_verifiers += 1
                try:
                    result = await self.verify(
                        VerifyRequest(
                            request_id=f"{episode_id}/t{turn}",
                            task=task,
                            candidate=response.answer,
                            episode_id=episode_id,
                            turn=turn,
                        )
                    )
                finally:
                    self.at_verifiers -= 1
                    self.room.set()
                turns.append(
                    Turn(
                        prompt_ids=np.asarray(prompt.ids, dtype=np.int64),
                        response_ids=gen.output_ids,
                        logprobs=gen.logprobs,
                        versions=gen.versions,
                        finish_reason=gen.finish_reason,
                        text=response.answer,
                        reasoning=response.reasoning,
                        kind=prompt.kind,
                        result=result,
                    )
                )
                decision = self.policy.next_prompt(prompt.attempt.answered(prompt.kind, response), result)
                if not isinstance(decision, Prompt):
                    break
                prompt = decision
        finally:
            self.inflight -= 1
            self.room.set()
        return Episode(
            episode_id=episode_id,
            task=task,
            group_id=reply.group_id,
            sample_index=index,
            turns=turns,
            rewards=[t.result.score for t in turns],
            is_retry=task.repair is not None,
            actor_id=self.actor_id,
        )

    def _unservable(self, reply: TaskReply, index: int, message: str) -> Episode:
        episode_id = f"{reply.group_id}/{index}"
        request = VerifyRequest(request_id=f"{episode_id}/t0", task=reply.task, candidate="", episode_id=episode_id)
        gen = _empty(episode_id)
        turn = Turn(
            prompt_ids=np.zeros(0, np.int64),
            response_ids=gen.output_ids,
            logprobs=gen.logprobs,
            versions=gen.versions,
            finish_reason=gen.finish_reason,
            result=infra_result(request, f"cannot pose the task: {message}"),
        )
        return Episode(
            episode_id=episode_id,
            task=reply.task,
            group_id=reply.group_id,
            sample_index=index,
            turns=[turn],
            rewards=[0.0],
            is_retry=reply.task.repair is not None,
            actor_id=self.actor_id,
            unservable=message,
        )

    def _forced(self, task: Task) -> list[int] | None:
        """The drawn candidate's ids. Scored as the response, it is cut at max_new_tokens as a sampled
        response would be; decoded (`decode_forced`), it is the answer of a response whose tokens the
        engine decodes apart, so it stays whole: a real policy's tokenizer writes a kernel in a third of
        the byte tokenizer's tokens, and a cut one has no code to extract."""
        text = self.force(task) if self.force is not None else None
        if text is None:
            return None
        return _forced_ids(self.tokenizer, text, None if self.decode_forced else self.params.max_new_tokens)


class GroupRunner:
    """A synchronous façade for tools (`kiln rft`): one group through the per-attempt `Pipeline` on an
    event loop of its own, with a blocking `generate(requests)` and `verifier.verify_all(requests)`
    called on threads, one request per attempt at a time (each attempt still flows on its own)."""

    def __init__(
        self,
        *,
        actor_id: str,
        generate: Callable[[list[GenerateRequest]], list[Generation]],
        verifier,
        tokenizer,
        params: SamplingParams,
        policy: TurnPolicy,
        force: Callable[[Task], str | None] | None = None,
    ) -> None:
        self.actor_id, self.generate, self.verifier = actor_id, generate, verifier
        self.tokenizer, self.params, self.policy, self.force = tokenizer, params, policy, force

    def run(self, reply: TaskReply) -> list[Episode]:
        async def generate(request: GenerateRequest) -> Generation:
            return (await asyncio.to_thread(self.generate, [request]))[0]

        async def verify(request: VerifyRequest) -> VerifyResult:
            return (await asyncio.to_thread(self.verifier.verify_all, [request]))[0]

        pipeline = Pipeline(
            actor_id=self.actor_id,
            generate=generate,
            verify=verify,
            tokenizer=self.tokenizer,
            params=self.params,
            policy=self.policy,
            force=self.force,
        )
        return asyncio.run(pipeline.run_group(reply))


def _forced_ids(tokenizer, text: str, max_new_tokens: int | None) -> list[int]:
    """A forced answer ends its turn as a sampled one would: with the end-of-turn token (cut at
    `max_new_tokens` when given)."""
    end = tokenizer.end_of_turn_id
    ids = tokenizer.encode(text) + ([int(end)] if end is not None else [])
    return ids if max_new_tokens is None else ids[: max(1, max_new_tokens)]


def _empty(request_id: str) -> Generation:
    return Generation(
        request_id=request_id,
        output_ids=np.zeros(0, np.int64),
        logprobs=np.zeros(0, np.float32),
        versions=np.zeros(0, np.int64),
        finish_reason="length",
    )
