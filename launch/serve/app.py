"""The service's HTTP API (aiohttp). Every answer is JSON except /metrics; every error is one line,
`{"error": "..."}`, with a 4xx/5xx status, and the server keeps serving. The API reference is in
docs/verifier.md ("The verifier service").

Kiln's endpoints:
  POST /v1/verify            {candidate, reference | task_id, deadline_s?} -> the verdict (blocks)
  POST /v1/verify/batch      {requests: [...]} (at most serve.batch_max) -> {results: [...]} (blocks)
  POST /v1/jobs              the same body as /v1/verify -> 202 {id} (asynchronous)
  GET  /v1/jobs/{id}         {id, status} and, once ended, the verdict or the timeout line
  GET  /health               {status, verifiers, queued, running}: open to anyone, no details
  GET  /metrics              Prometheus text: queue depth, verdicts by class, latency, busy workers
KernelGYM's (kernelgym.py): POST /evaluate, POST /evaluate/batch, GET /status/{task_id},
GET /results/{task_id}.

A verdict is `protocols.verdict_json`'s record, redacted for a remote client. Jobs belong to the
client whose token made them: another client's id is unknown (404).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

from aiohttp import web

from configs import ServeConfig
from launch.serve import kernelgym, metrics
from launch.serve.auth import Tokens
from launch.serve.dispatch import Dispatcher
from launch.serve.queue import Job, JobState, QueueFull
from protocols import KernelSpec, Task, VerifyRequest, verdict_json

POLL_S = 0.05  # how often a blocking request looks at its job


class BadRequest(ValueError):
    """A request the service refuses (400, or `status`), one line."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Service:
    cfg: ServeConfig
    backend: str  # the verifier's device backend (cpu or cuda)
    tokens: Tokens
    dispatcher: Dispatcher
    tasks: dict[str, Task]  # the task set a request may name by id


SERVICE = web.AppKey("service", Service)


def error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers or None)


def build_app(service: Service) -> web.Application:
    app = web.Application(client_max_size=service.cfg.max_body_bytes, middlewares=[_errors, _auth])
    app[SERVICE] = service
    app.router.add_post("/v1/verify", verify_one)
    app.router.add_post("/v1/verify/batch", verify_batch)
    app.router.add_post("/v1/jobs", submit)
    app.router.add_get("/v1/jobs/{id}", job_status)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", prometheus)
    app.router.add_post("/evaluate", kg_evaluate)
    app.router.add_post("/evaluate/batch", kg_batch)
    app.router.add_get("/status/{id}", kg_status)
    app.router.add_get("/results/{id}", kg_results)
    return app


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except BadRequest as err:
        retry = getattr(err, "retry_after", None)
        return error(err.status, str(err), **({"Retry-After": str(retry)} if retry else {}))
    except web.HTTPRequestEntityTooLarge:
        return error(413, f"the body is larger than serve.max_body_bytes ({request.app[SERVICE].cfg.max_body_bytes})")
    except web.HTTPException as err:
        return error(err.status, err.reason)


@web.middleware
async def _auth(request: web.Request, handler):
    if request.path == "/health":
        return await handler(request)
    client = request.app[SERVICE].tokens.client(request.headers.get("Authorization"))
    if client is None:
        return error(401, "a token is required: 'Authorization: Bearer <token>' with a token of serve.token_file")
    request["client"] = client
    return await handler(request)


# ------------------------------------------------------------------------------------ reading


async def _body(request: web.Request) -> object:
    raw = await request.read()  # aiohttp refuses more than client_max_size before this returns
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BadRequest(f"the body is not JSON: {err}") from None


def _source(body: dict, key: str, limit: int) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value.strip():
        raise BadRequest(f"{key} is required, a non-empty string")
    if len(value) > limit:
        raise BadRequest(f"{key} is {len(value)} characters, more than serve.max_source_chars ({limit})", 413)
    return value


def _deadline(service: Service, value: object) -> float:
    if value is None:
        return service.cfg.deadline_s
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= service.cfg.max_deadline_s:
        raise BadRequest(f"deadline_s must be a number in (0, {service.cfg.max_deadline_s:g}]")
    return float(value)


def _task(service: Service, body: dict) -> Task:
    if ("reference" in body) == ("task_id" in body):
        raise BadRequest("give the reference (its source) or a task_id of the service's task set, one of them")
    if "task_id" in body:
        task_id = body["task_id"]
        if not isinstance(task_id, str) or task_id not in service.tasks:
            raise BadRequest(
                f"unknown task_id {str(task_id)[:100]!r} (GET /health lists how many tasks are served)", 404
            )
        return service.tasks[task_id]
    return inline_task(_source(body, "reference", service.cfg.max_source_chars), service.backend)


def inline_task(reference: str, backend: str, name: str = "inline") -> Task:
    """A task of a reference sent by the client (its id: the source's digest, so one reference is one
    task to the verdict cache and the baselines). The client's code: it runs jailed, as a candidate
    does (`reference_origin`, actors/verifier/jailed_reference.py), and its id is in a namespace of its
    own, so no client's source ever stands for a task of the operator's set."""
    import hashlib

    digest = hashlib.sha256(reference.encode()).hexdigest()[:16]
    spec = KernelSpec(name=name, reference=reference, backend=backend, level=0, reference_origin="client")
    return Task(task_id=f"inline/{digest}", kind="kernel", kernel=spec)


def _job(service: Service, client: str, body: object, **tags) -> Job:
    if not isinstance(body, dict):
        raise BadRequest("a verification request is a JSON object")
    task = _task(service, body)
    candidate = _source(body, "candidate", service.cfg.max_source_chars)
    now = time.monotonic()
    job_id = uuid.uuid4().hex
    request = VerifyRequest(request_id=job_id, task=task, candidate=candidate)
    return Job(job_id, client, request, now, now + _deadline(service, body.get("deadline_s")), tags=tags)


def _admit(service: Service, jobs: list[Job]) -> None:
    """Queue every job, or none (a batch is admitted whole): 429 with Retry-After when it does not fit."""
    dispatcher = service.dispatcher
    with dispatcher.lock:
        queue = dispatcher.queue
        mine = sum(1 for j in queue.jobs.values() if j.client == jobs[0].client and j.state is JobState.QUEUED)
        if queue.depth + len(jobs) > queue.capacity or mine + len(jobs) > queue.per_client:
            raise _busy(service, f"the queue cannot take {len(jobs)} more job(s) now")
        try:
            for job in jobs:
                queue.admit(job)
        except QueueFull as err:  # not reached: checked above under the same lock
            raise _busy(service, str(err)) from None
        dispatcher.lock.notify_all()


def _busy(service: Service, why: str) -> BadRequest:
    err = BadRequest(f"{why}; retry after {service.cfg.retry_after_s} s", 429)
    err.retry_after = service.cfg.retry_after_s
    return err


async def _ended(job: Job) -> None:
    while not job.ended:
        await asyncio.sleep(POLL_S)


def _job_json(job: Job) -> dict:
    out = {"id": job.job_id, "status": job.state.value}
    if job.state is JobState.DONE and job.result is not None:
        out["verdict"] = verdict_json.to_json(job.result, remote=True)
    elif job.state is JobState.EXPIRED:
        out["error"] = job.why
    return out


def _mine(service: Service, client: str, job_id: str) -> Job:
    job = service.dispatcher.get(job_id)
    if job is None or job.client != client:
        raise BadRequest(
            f"no job {job_id[:64]!r} of this client (results are kept {service.cfg.keep_results_s:g} s)", 404
        )
    return job


# ----------------------------------------------------------------------------------- handlers


async def verify_one(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    job = _job(service, request["client"], await _body(request))
    _admit(service, [job])
    await _ended(job)
    return web.json_response(_job_json(job), status=504 if job.state is JobState.EXPIRED else 200)


async def _batch(request: web.Request, key: str, most: int, make) -> tuple[object, list[Job]]:
    """The body's list `key` (1 to `most` items) made into jobs by `make`, admitted whole, and waited
    for; (the body, the jobs in order). An item's refusal names its index."""
    service = request.app[SERVICE]
    body = await _body(request)
    items = body.get(key) if isinstance(body, dict) else None
    if not isinstance(items, list) or not items:
        raise BadRequest(f'a batch is {{"{key}": [...]}}, at least one')
    if len(items) > most:
        raise BadRequest(f"a batch holds at most {most} {key}, not {len(items)}", 413)
    jobs = []
    for n, item in enumerate(items):
        try:
            jobs.append(make(service, request["client"], item))
        except BadRequest as err:
            raise BadRequest(f"{key}[{n}]: {err}", err.status) from None
    _admit(service, jobs)
    for job in jobs:
        await _ended(job)
    return body, jobs


async def verify_batch(request: web.Request) -> web.Response:
    _, jobs = await _batch(request, "requests", request.app[SERVICE].cfg.batch_max, _job)
    return web.json_response({"results": [_job_json(j) for j in jobs]})


async def submit(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    job = _job(service, request["client"], await _body(request))
    _admit(service, [job])
    return web.json_response({"id": job.job_id, "status": job.state.value}, status=202)


async def job_status(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    return web.json_response(_job_json(_mine(service, request["client"], request.match_info["id"])))


async def health(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    snap = service.dispatcher.snapshot()
    live = service.dispatcher.verifiers.live()
    return web.json_response(
        {
            "status": "healthy" if live else "unhealthy",
            "backend": service.backend,
            "verifiers": live,
            "queued": snap["queued"],
            "running": snap["running"],
            "tasks": len(service.tasks),
        },
        status=200 if live else 503,
    )


async def prometheus(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    text = metrics.render(service.dispatcher.snapshot(), service.dispatcher.verifiers.live())
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


# ---------------------------------------------------------------------------------- KernelGYM


def _kg_job(service: Service, client: str, body: object) -> Job:
    try:
        fields = kernelgym.parse(body)
    except kernelgym.KernelGymError as err:
        raise BadRequest(str(err)) from None
    for key in ("kernel_code", "reference_code"):
        _source(fields, key, service.cfg.max_source_chars)
    timeout = fields["requested"].get("timeout")
    job = _job(
        service,
        client,
        {"reference": fields["reference_code"], "candidate": fields["kernel_code"], "deadline_s": timeout},
        kernelgym_task_id=fields["task_id"],
        requested=fields["requested"],
    )
    mine = _kg_lookup(service, client, fields["task_id"])
    if mine is not None and not mine.ended:
        raise BadRequest(f"task_id {fields['task_id']!r} is already being evaluated", 409)
    return job


def _kg_lookup(service: Service, client: str, task_id: str) -> Job | None:
    """The newest job of this client made under KernelGYM task id `task_id`."""
    with service.dispatcher.lock:
        found = [
            j
            for j in service.dispatcher.queue.jobs.values()
            if j.client == client and j.tags.get("kernelgym_task_id") == task_id
        ]
    return max(found, key=lambda j: j.submitted) if found else None


async def kg_evaluate(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    job = _kg_job(service, request["client"], await _body(request))
    _admit(service, [job])
    await _ended(job)
    return web.json_response(kernelgym.response(job))


async def kg_batch(request: web.Request) -> web.Response:
    most = min(kernelgym.MAX_BATCH, request.app[SERVICE].cfg.batch_max)
    body, jobs = await _batch(request, "tasks", most, _kg_job)
    results = [kernelgym.response(j) for j in jobs]
    failed = sum(r["status"] != "completed" for r in results)
    return web.json_response(
        {
            "batch_id": str(body.get("batch_id", "")),
            "total_tasks": len(results),
            "completed_tasks": len(results) - failed,
            "failed_tasks": failed,
            "results": results,
            "batch_status": "completed" if not failed else "failed",
        }
    )


async def kg_status(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    job = _kg_lookup(service, request["client"], request.match_info["id"])
    if job is None:
        raise BadRequest(f"no task {request.match_info['id'][:100]!r} of this client", 404)
    status = kernelgym.response(job)["status"]
    return web.json_response({"task_id": request.match_info["id"], "status": status})


async def kg_results(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    job = _kg_lookup(service, request["client"], request.match_info["id"])
    if job is None:
        raise BadRequest(f"no task {request.match_info['id'][:100]!r} of this client", 404)
    return web.json_response(kernelgym.response(job))
