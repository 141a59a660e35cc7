"""The rollout actor's front to a verifier service (`verifier.remote`, `kiln serve`) instead of the
run's own verifier actors (verify_pool.py): the same `verify(request) -> VerifyResult`, over HTTP.

Each attempt is one blocking `POST /v1/verify` with the task's reference inline and the rollout's
reply timeout as its deadline. The verdict comes back as the record the local pool returns, under the
attempt's own request and task ids. What the service does not answer (its deadline passed, it is
unreachable, it refused the request) is resent `retries` times, then answered `infra`: the system's
fault, never the policy's, as with local verifiers. The service itself retries a job whose verifier
died, and charges a second death to the candidate.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os

from protocols import VerifyRequest, VerifyResult, infra_result
from protocols.verifier_client import AsyncVerifierClient, ServiceError

log = logging.getLogger(__name__)

TOKEN_VARIABLE = "KILN_SERVE_TOKEN"


class RemoteVerifier:
    def __init__(self, url: str, *, timeout_s: float, retries: int, stats: dict[str, int] | None = None) -> None:
        self.url = url
        self.timeout_s, self.retries = timeout_s, retries
        self.stats = stats if stats is not None else {}
        for key in ("sent", "infra", "resent"):
            self.stats.setdefault(key, 0)
        # A blocking verify waits for its verdict: the HTTP exchange outlives the deadline a little.
        self.client = AsyncVerifierClient(url, os.environ.get(TOKEN_VARIABLE) or None, timeout_s=timeout_s + 30.0)

    async def verify(self, request: VerifyRequest) -> VerifyResult:
        self.stats["sent"] += 1
        kernel = request.task.kernel
        if kernel is None:
            self.stats["infra"] += 1
            return infra_result(request, f"the verifier service judges kernel tasks, not {request.task.kind!r}")
        why = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self.stats["resent"] += 1
            try:
                result = await self.client.verify(
                    request.candidate, reference=kernel.reference, deadline_s=self.timeout_s
                )
            except ServiceError as err:
                why = str(err)
                log.warning("verifier service %s: %s (attempt %s)", self.url, why, request.request_id)
                continue
            return dataclasses.replace(result, request_id=request.request_id, task_id=request.task.task_id)
        self.stats["infra"] += 1
        return infra_result(request, f"the verifier service did not answer: {why}"[:300])

    def depths(self) -> dict[str, int]:
        return {}

    async def close(self) -> None:
        await self.client.close()
        await asyncio.sleep(0)
