"""Clients of the verifier service (`kiln serve`, launch/serve): `VerifierClient` (blocking, the
standard library's HTTP) and `AsyncVerifierClient` (asyncio, aiohttp). Both return the service's
verdicts as `VerifyResult` records (protocols.verdict_json) and raise `ServiceError` with the server's
one line for anything else.

    client = VerifierClient("http://verifier:8470", token=os.environ["KILN_TOKEN"])
    result = client.verify(candidate=text, task_id="level1/01_relu")
    result.score, result.passed, result.feedback

A 429 (the queue is full) is waited out as the server's Retry-After says, up to `busy_retries` times; a
job past its deadline raises `ServiceTimeout`.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

from protocols.records import VerifyResult
from protocols.verdict_json import from_json


class ServiceError(RuntimeError):
    """The service refused or failed a request: its status and one line."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class ServiceTimeout(ServiceError):
    """The job's deadline passed before its verdict."""


def _body(candidate: str, reference: str | None, task_id: str | None, deadline_s: float | None) -> dict:
    if (reference is None) == (task_id is None):
        raise ValueError("give the reference or a task_id, one of them")
    body: dict = {"candidate": candidate}
    body.update({"reference": reference} if reference is not None else {"task_id": task_id})
    if deadline_s is not None:
        body["deadline_s"] = deadline_s
    return body


def _verdict(status: int, data: object, request_id: str = "") -> VerifyResult:
    if status == 504 or isinstance(data, dict) and data.get("status") == "expired":
        raise ServiceTimeout(status, str(data.get("error") if isinstance(data, dict) else data))
    if not isinstance(data, dict) or "verdict" not in data:
        raise ServiceError(status, f"the answer carries no verdict: {str(data)[:200]}")
    return from_json(data["verdict"], request_id or str(data.get("id", "")))


class VerifierClient:
    def __init__(self, url: str, token: str | None = None, timeout_s: float = 3600.0, busy_retries: int = 10) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s  # of one HTTP exchange (a blocking verify waits for its verdict)
        self.busy_retries = busy_retries

    def verify(
        self, candidate: str, reference: str | None = None, task_id: str | None = None, deadline_s: float | None = None
    ) -> VerifyResult:
        status, data = self._call("POST", "/v1/verify", _body(candidate, reference, task_id, deadline_s))
        return _verdict(status, data)

    def verify_batch(self, requests: list[dict]) -> list[VerifyResult | ServiceError]:
        """Each of `requests` is verify()'s keyword arguments; a job that timed out is its ServiceTimeout."""
        body = {
            "requests": [
                _body(r["candidate"], r.get("reference"), r.get("task_id"), r.get("deadline_s")) for r in requests
            ]
        }
        _status, data = self._call("POST", "/v1/verify/batch", body)
        out: list[VerifyResult | ServiceError] = []
        for item in data["results"]:
            try:
                out.append(_verdict(200, item))
            except ServiceError as err:
                out.append(err)
        return out

    def submit(
        self, candidate: str, reference: str | None = None, task_id: str | None = None, deadline_s: float | None = None
    ) -> str:
        """Queue a verification; its job id."""
        _status, data = self._call("POST", "/v1/jobs", _body(candidate, reference, task_id, deadline_s))
        return str(data["id"])

    def result(self, job_id: str, wait_s: float = 0.0, poll_s: float = 0.5) -> VerifyResult | None:
        """The job's verdict; None while it runs (after waiting up to `wait_s`)."""
        end = time.monotonic() + wait_s
        while True:
            status, data = self._call("GET", f"/v1/jobs/{job_id}")
            if data.get("status") in ("done", "expired"):
                return _verdict(status, data, job_id)
            if time.monotonic() >= end:
                return None
            time.sleep(poll_s)

    def health(self) -> dict:
        return self._call("GET", "/health", allow=(503,))[1]

    def _call(self, method: str, path: str, body: dict | None = None, allow: tuple[int, ...] = ()) -> tuple[int, dict]:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        for attempt in range(self.busy_retries + 1):
            req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    return resp.status, json.loads(resp.read())
            except urllib.error.HTTPError as err:
                text = err.read()
                try:
                    answer = json.loads(text)
                except json.JSONDecodeError:
                    answer = {"error": text.decode(errors="replace")[:300]}
                if err.code == 429 and attempt < self.busy_retries:
                    time.sleep(float(err.headers.get("Retry-After") or 1))
                    continue
                if err.code == 504 or err.code in allow:
                    return err.code, answer
                raise ServiceError(err.code, str(answer.get("error", answer))) from None
            except urllib.error.URLError as err:
                raise ServiceError(0, f"cannot reach {self.url}: {err.reason}") from None
        raise ServiceError(429, "the service stayed busy")


class AsyncVerifierClient:
    """`VerifierClient`'s calls as coroutines, over one aiohttp session (close it: `await client.close()`)."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 3600.0, busy_retries: int = 10) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self.busy_retries = busy_retries
        self._session = None

    async def verify(
        self, candidate: str, reference: str | None = None, task_id: str | None = None, deadline_s: float | None = None
    ) -> VerifyResult:
        status, data = await self._call("POST", "/v1/verify", _body(candidate, reference, task_id, deadline_s))
        return _verdict(status, data)

    async def submit(
        self, candidate: str, reference: str | None = None, task_id: str | None = None, deadline_s: float | None = None
    ) -> str:
        _status, data = await self._call("POST", "/v1/jobs", _body(candidate, reference, task_id, deadline_s))
        return str(data["id"])

    async def result(self, job_id: str, wait_s: float = 0.0, poll_s: float = 0.5) -> VerifyResult | None:
        end = time.monotonic() + wait_s
        while True:
            status, data = await self._call("GET", f"/v1/jobs/{job_id}")
            if data.get("status") in ("done", "expired"):
                return _verdict(status, data, job_id)
            if time.monotonic() >= end:
                return None
            await asyncio.sleep(poll_s)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        import aiohttp

        if self._session is None:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            self._session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        for attempt in range(self.busy_retries + 1):
            try:
                async with self._session.request(method, self.url + path, json=body) as resp:
                    try:
                        answer = await resp.json(content_type=None)
                    except (json.JSONDecodeError, aiohttp.ContentTypeError):
                        answer = {"error": (await resp.text())[:300]}
                    if resp.status == 429 and attempt < self.busy_retries:
                        await asyncio.sleep(float(resp.headers.get("Retry-After") or 1))
                        continue
                    if resp.status < 300 or resp.status == 504:
                        return resp.status, answer
                    raise ServiceError(resp.status, str(answer.get("error", answer)))
            except aiohttp.ClientConnectionError as err:
                raise ServiceError(0, f"cannot reach {self.url}: {err}") from None
        raise ServiceError(429, "the service stayed busy")
