"""`SGLangClient`: the `Engine` interface over SGLang's native HTTP API.

It drives a real SGLang server, a real `sglang-router` in front of several, or Kiln's embedded torch
engine behind `http_server.EngineServer` — the same code for all three. Requests go one HTTP call per
prompt, concurrently, so a router spreads them over its workers. Only the standard library is used.

Per-token weight versions: the embedded engine reports them (meta_info["kiln_token_versions"]);
SGLang reports one `weight_version` per response (meta_info["weight_version"], the string the last
update set), which is exact only when no update landed during the request. A multi-bucket update runs
between /pause_generation (mode in_place) and /continue_generation, so no token is sampled from a
half-loaded model; a response that spans an update still carries only the newer version, so exact
per-token versions with SGLang need pause mode "abort" (in-flight requests aborted and resubmitted).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from actors.rollout.engine import Engine, EngineError, GenerateRequest, Generation
from protocols import EngineHealth


class SGLangClient(Engine):
    def __init__(self, url: str, *, timeout_s: float = 600.0, max_concurrency: int = 256) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="kiln-sglang-client")
        self._version = -1
        self._updating = False  # generation paused for a multi-bucket update in progress
        self._staging: bool | None = None  # the server stages buckets (Kiln's engine); asked once

    # --------------------------------------------------------------------------------- HTTP

    def call(self, method: str, path: str, body: dict | None = None, timeout_s: float | None = None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:500]
            raise EngineError(f"{method} {path}: HTTP {err.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as err:
            raise EngineError(f"{method} {path}: {err}") from None
        try:
            return json.loads(raw) if raw.strip() else None
        except (json.JSONDecodeError, UnicodeDecodeError):  # routers answer some probes in plain text
            return raw.decode(errors="replace")

    # ---------------------------------------------------------------------------- interface

    def generate(self, requests: list[GenerateRequest]) -> list[Generation]:
        return list(self._pool.map(self._generate_one, requests))

    def submit(self, request: GenerateRequest) -> Future:
        # One HTTP request per prompt on the client's bounded pool (max_concurrency at once).
        return self._pool.submit(self._generate_one, request)

    def _generate_one(self, req: GenerateRequest) -> Generation:
        p = req.params
        sampling = {
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k or -1,
            "max_new_tokens": p.max_new_tokens,
            "ignore_eos": p.ignore_eos,
        }
        if p.stop_token_ids:
            sampling["stop_token_ids"] = list(p.stop_token_ids)
        body = {"input_ids": req.prompt_ids, "sampling_params": sampling, "return_logprob": True, "rid": req.request_id}
        if req.forced_response is not None:
            body["kiln_forced_output_ids"] = req.forced_response
        out = self.call("POST", "/generate", body)
        if isinstance(out, list):
            out = out[0]
        return parse_generation(req, out)

    def abort(self, request_ids: Iterable[str] | None = None) -> None:
        if request_ids is None:
            self.call("POST", "/abort_request", {"rid": "", "abort_all": True})
        for rid in request_ids or ():
            self.call("POST", "/abort_request", {"rid": rid})

    def pause(self) -> None:
        # in_place: running requests keep their state and continue after /continue_generation
        self.call("POST", "/pause_generation", {"mode": "in_place"})

    def resume(self) -> None:
        self.call("POST", "/continue_generation", {})

    def release_memory(self) -> None:
        self.call("POST", "/release_memory_occupation", {})

    def resume_memory(self) -> None:
        self.call("POST", "/resume_memory_occupation", {})

    def update_weights_from_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        # SGLang's /update_weights_from_tensor carries CUDA IPC handles, so it only works from a process
        # on the server's own GPU; that path belongs to the colocated learner (a later issue).
        raise EngineError("an HTTP engine loads weights from disk or a distributed group, not from in-process tensors")

    def update_weights_from_disk(self, path: str, version: int) -> None:
        out = self.call("POST", "/update_weights_from_disk", {"model_path": path, "weight_version": str(version)})
        if not (out or {}).get("success"):
            raise EngineError(f"update_weights_from_disk failed: {out}")
        self._version = version

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        # Body fields: SGLang's InitWeightsUpdateGroupReqInput.
        self._expect_success(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: int,
        group_name: str = "weight_update_group",
        *,
        last: bool = True,
        flat: bool = False,
    ) -> None:
        # Body fields: SGLang's UpdateWeightsFromDistributedReqInput. SGLang loads each bucket into the
        # live model at once, so a multi-bucket version runs with generation paused in place (from the
        # first bucket until the last one has loaded), and only the last bucket carries weight_version
        # (a string there) and flush_cache=true. Kiln's own server stages buckets instead (flush_cache=
        # false = more follow) and must not be paused: its 'finish' policy waits for running requests.
        pause = not last and not self._updating and not self._stages_buckets()
        if pause:
            self.pause()
        self._updating = self._updating or pause
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name, "flush_cache": last}
        if flat:  # SGLang's bucketed receive: one broadcast of the bucket's tensors concatenated (one dtype)
            body["load_format"] = "flattened_bucket"
        if last:
            body["weight_version"] = str(version)
        try:
            self._expect_success("/update_weights_from_distributed", body)
        except EngineError:
            self._end_update()
            raise
        if last:
            self._end_update()
            self._version = version

    def _end_update(self) -> None:
        if self._updating:
            self._updating = False
            self.resume()

    def _stages_buckets(self) -> bool:
        """Whether the server is Kiln's torch engine, which applies a multi-bucket version atomically."""
        if self._staging is None:
            info = self.call("GET", "/server_info", timeout_s=10)
            self._staging = isinstance(info, dict) and str(info.get("version", "")).startswith("kiln")
        return self._staging

    def _expect_success(self, path: str, body: dict) -> None:
        out = self.call("POST", path, body)
        if not isinstance(out, dict) or not out.get("success"):
            raise EngineError(f"{path} failed: {out}")

    @property
    def weight_version(self) -> int:
        try:
            return int(self.call("GET", "/model_info", timeout_s=10)["weight_version"])
        except (EngineError, KeyError, TypeError, ValueError):
            return self._version

    def health(self) -> EngineHealth:
        try:
            self.call("GET", "/health", timeout_s=10)
            return EngineHealth(alive=True, version=self._version, url=self.url)
        except EngineError as err:
            return EngineHealth(alive=False, version=self._version, url=self.url, error=str(err))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def parse_generation(req: GenerateRequest, out: dict) -> Generation:
    """A /generate response (SGLang's shape) as a Generation; raises EngineError when malformed."""
    try:
        meta = out["meta_info"]
        pairs = meta["output_token_logprobs"]
        ids = np.asarray([int(p[1]) for p in pairs], dtype=np.int64)
        logprobs = np.asarray([float(p[0]) for p in pairs], dtype=np.float32)
        versions = meta.get("kiln_token_versions")
        if versions is None:
            versions = [int(meta.get("weight_version") or 0)] * len(ids)
        reason = meta["finish_reason"]["type"] if meta.get("finish_reason") else "abort"
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise EngineError(f"malformed /generate response for {req.request_id}: {err!r}") from None
    if reason not in ("stop", "length", "abort"):
        raise EngineError(f"unknown finish_reason {reason!r}")
    return Generation(
        request_id=req.request_id,
        output_ids=ids,
        logprobs=logprobs,
        versions=np.asarray(versions, dtype=np.int64),
        finish_reason=reason,
        prompt_tokens=int(meta.get("prompt_tokens", len(req.prompt_ids))),
        seconds=float(meta.get("e2e_latency", 0.0)),
    )
