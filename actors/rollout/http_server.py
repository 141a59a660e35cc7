"""Serve an `Engine` over the subset of SGLang's native HTTP API that Kiln's client uses, so one
client (`http_client.SGLangClient`) drives the embedded engine, a real SGLang server, or a real
`sglang-router` in front of either. The target SGLang version and each endpoint's request/response
shape are documented in docs/rollout.md.

GET  /health, /health_generate        200 while the engine serves, 503 otherwise
GET  /model_info, /get_model_info     {"model_path", "tokenizer_path", "is_generation", "weight_version"}
GET  /server_info, /get_server_info   engine facts + {"version", "weight_version"}
GET  /v1/models                        the served model, OpenAI style (the router lists models)
POST /generate                         {"input_ids", "sampling_params", "return_logprob", "rid"}
POST /abort_request                    {"rid": str} or {"abort_all": true}
POST /pause_generation {"mode": "abort" | "in_place"}, /continue_generation
POST /release_memory_occupation, /resume_memory_occupation
POST /update_weights_from_disk         {"model_path", "weight_version"}
POST /init_weights_update_group        {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}
POST /update_weights_from_distributed  {"names", "dtypes", "shapes", "group_name", "weight_version", "flush_cache",
                                       "load_format"} (flush_cache=false: a bucket of a multi-bucket version;
                                       staged. load_format "flattened_bucket": the bucket comes as one flat
                                       broadcast, as in SGLang)
GET  /get_weight_version               {"weight_version"} (older SGLang; newer ones use /model_info)

Kiln extensions, ignored by SGLang clients: meta_info["kiln_token_versions"] (the weight version of
each output token) and the request field "kiln_forced_output_ids" (forced-response mode).
Bad requests get HTTP 400 {"error": {"message": ...}} and the server keeps serving.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from actors.rollout.engine import Engine, EngineError, GenerateRequest, Generation, RequestError, SamplingParams

log = logging.getLogger(__name__)

SAMPLING_KEYS = {"temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "ignore_eos"}
# SGLang sampling options that do not change what Kiln samples when left at these values.
NEUTRAL_KEYS = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "n": 1,
    "stop": None,
}


class BadRequest(ValueError):
    pass


def parse_sampling(raw: dict | None) -> SamplingParams:
    raw = dict(raw or {})
    for key, neutral in NEUTRAL_KEYS.items():
        if key in raw and raw.pop(key) not in (neutral, [], None):
            raise BadRequest(f"sampling_params.{key} is not supported by the torch engine")
    unknown = set(raw) - SAMPLING_KEYS
    if unknown:
        raise BadRequest(f"unknown sampling_params {sorted(unknown)}")
    if raw.get("top_k") == -1:  # SGLang's "off"
        raw["top_k"] = 0
    if raw.get("temperature") == 0:  # SGLang's greedy; a tiny T samples the argmax
        raw["temperature"] = 1e-5
    try:
        raw["stop_token_ids"] = tuple(int(t) for t in raw.get("stop_token_ids") or ())
        return SamplingParams(**raw)
    except (TypeError, ValueError) as err:
        raise BadRequest(f"bad sampling_params: {err}") from None


def parse_generate(body: dict) -> tuple[list[GenerateRequest], bool]:
    """The engine requests of a /generate body, and whether the caller sent a batch."""
    ids = body.get("input_ids")
    if "text" in body:
        raise BadRequest("send input_ids: the torch engine does not tokenize")
    if not isinstance(ids, list) or not ids:
        raise BadRequest("input_ids must be a non-empty list of token ids (or a list of such lists)")
    batched = isinstance(ids[0], list)
    prompts = ids if batched else [ids]
    n = len(prompts)
    params = body.get("sampling_params")
    params = params if isinstance(params, list) else [params] * n
    rids = body.get("rid") or [uuid.uuid4().hex for _ in range(n)]
    rids = rids if isinstance(rids, list) else [rids]
    forced = body.get("kiln_forced_output_ids")
    forced = (forced if batched else [forced]) if forced is not None else [None] * n
    if not (len(params) == len(rids) == len(forced) == n):
        raise BadRequest("sampling_params, rid and kiln_forced_output_ids must match input_ids in length")
    out = []
    for prompt, p, rid, f in zip(prompts, params, rids, forced, strict=True):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt + (f or [])):
            raise BadRequest("token ids must be integers")
        out.append(GenerateRequest(request_id=str(rid), prompt_ids=prompt, params=parse_sampling(p), forced_response=f))
    return out, batched


def generation_json(g: Generation, decode: Callable[[list[int]], str], weight_version: int) -> dict:
    ids = g.output_ids.tolist()
    finish = {"type": g.finish_reason}
    if g.finish_reason == "length":
        finish["length"] = len(ids)
    elif g.finish_reason == "stop" and ids:
        finish["matched"] = ids[-1]
    elif g.finish_reason == "abort":
        finish["message"] = "aborted"
    return {
        "text": decode(ids),
        "output_ids": ids,
        "meta_info": {
            "id": g.request_id,
            "finish_reason": finish,
            "prompt_tokens": g.prompt_tokens,
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "e2e_latency": g.seconds,
            "output_token_logprobs": [[lp, tok, None] for lp, tok in zip(g.logprobs.tolist(), ids, strict=True)],
            "weight_version": str(int(g.versions[-1]) if len(ids) else weight_version),
            "kiln_token_versions": g.versions.tolist(),
        },
    }


class EngineServer:
    """An HTTP front for one engine on `host:port` (0 = OS-chosen)."""

    def __init__(
        self,
        engine: Engine,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model_path: str = "",
        decode: Callable[[list[int]], str] = lambda ids: "",
    ) -> None:
        self.engine, self.model_path, self.decode = engine, model_path, decode
        self.httpd = ThreadingHTTPServer((host, port), _handler(self))
        self.httpd.daemon_threads = True
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self._thread: threading.Thread | None = None
        self.stats = {"requests": 0, "bad_requests": 0}

    def start(self) -> str:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="kiln-engine-http", daemon=True)
        self._thread.start()
        return self.url

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread:
            self._thread.join(timeout=10)

    # Each route returns (status, JSON-able body or None for an empty 200); a method's routes answer
    # None for a path they do not serve.
    def route(self, method: str, path: str, body: dict) -> tuple[int, object]:
        routes = {"GET": self._get, "POST": self._post}.get(method)
        answer = routes(path, body) if routes is not None else None
        return answer if answer is not None else (404, {"error": {"message": f"no route {method} {path}"}})

    def _get(self, path: str, body: dict) -> tuple[int, object] | None:
        e = self.engine
        if path in ("/health", "/health_generate"):
            return (200, None) if e.health().alive else (503, {"error": {"message": "engine down"}})
        if path in ("/model_info", "/get_model_info"):
            return 200, {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "weight_version": str(e.weight_version),
            }
        if path in ("/server_info", "/get_server_info"):
            return 200, {
                "version": "kiln-torch",
                "weight_version": str(e.weight_version),
                "model_path": self.model_path,
                "internal_states": [dataclasses.asdict(e.health())],
            }
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": self.model_path or "kiln", "object": "model"}]}
        if path == "/get_weight_version":
            return 200, {"weight_version": str(e.weight_version)}
        return None

    def _post(self, path: str, body: dict) -> tuple[int, object] | None:
        e = self.engine
        if path in ("/update_weights_from_disk", "/init_weights_update_group", "/update_weights_from_distributed"):
            return self._post_weights(path, body)
        if path == "/generate":
            reqs, batched = parse_generate(body)
            gens = e.generate(reqs)
            out = [generation_json(g, self.decode, e.weight_version) for g in gens]
            return 200, out if batched else out[0]
        if path == "/abort_request":
            e.abort(None if body.get("abort_all") else [str(body.get("rid", ""))])
            return 200, None
        if path == "/pause_generation":
            mode = body.get("mode", "abort")  # SGLang's default mode
            if mode not in ("abort", "in_place"):
                raise BadRequest(f"pause mode {mode!r}: the torch engine supports 'abort' and 'in_place'")
            if mode == "abort":
                e.abort(None)
            e.pause()
            return 200, {"message": "Generation paused successfully.", "status": "ok"}
        simple = {
            "/continue_generation": e.resume,
            "/release_memory_occupation": e.release_memory,
            "/resume_memory_occupation": e.resume_memory,
        }
        if path in simple:
            simple[path]()
            return 200, None
        return None

    def _post_weights(self, path: str, body: dict) -> tuple[int, object] | None:
        """The weight endpoints: load from disk, join the learner's broadcast group, receive a bucket."""
        e = self.engine
        if path == "/update_weights_from_disk":
            if not isinstance(body.get("model_path"), str):
                raise BadRequest("model_path (a directory) is required")
            try:
                version = int(body.get("weight_version", e.weight_version + 1))
            except (TypeError, ValueError):
                raise BadRequest("weight_version must be an integer") from None
            try:
                e.update_weights_from_disk(body["model_path"], version)
            except (EngineError, OSError) as err:
                return 400, {"success": False, "message": str(err), "num_paused_requests": 0}
            return 200, {"success": True, "message": f"loaded version {version}", "num_paused_requests": 0}
        if path == "/init_weights_update_group":
            return _weights_result(
                lambda: e.init_weights_update_group(
                    str(body["master_address"]),
                    int(body["master_port"]),
                    int(body["rank_offset"]),
                    int(body["world_size"]),
                    str(body.get("group_name", "weight_update_group")),
                    str(body.get("backend", "nccl")),
                ),
                "joined the weight group",
            )
        if path == "/update_weights_from_distributed":
            version = int(body.get("weight_version", e.weight_version + 1))
            # SGLang's flush_cache=false says more buckets of this version follow: the torch engine
            # stages them and applies the version whole with the bucket that flushes.
            last = body.get("flush_cache", True)
            if not isinstance(last, bool):
                raise BadRequest("flush_cache must be a boolean")
            load_format = body.get("load_format")
            if load_format not in (None, "flattened_bucket"):
                raise BadRequest(f"load_format {load_format!r}: the torch engine takes null or 'flattened_bucket'")
            return _weights_result(
                lambda: e.update_weights_from_distributed(
                    list(body["names"]),
                    list(body["dtypes"]),
                    [list(x) for x in body["shapes"]],
                    version,
                    str(body.get("group_name", "weight_update_group")),
                    last=last,
                    flat=load_format == "flattened_bucket",
                ),
                f"loaded version {version}" if last else f"staged a bucket of version {version}",
            )
        return None


def _weights_result(fn: Callable[[], None], message: str) -> tuple[int, dict]:
    """SGLang's answer shape for weight endpoints: {"success", "message"}, HTTP 400 on failure."""
    try:
        fn()
    except KeyError as err:
        return 400, {"success": False, "message": f"missing field {err}"}
    except (EngineError, ValueError, TypeError) as err:
        return 400, {"success": False, "message": str(err)}
    return 200, {"success": True, "message": message}


def _handler(server: EngineServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def _serve(self, method: str) -> None:
            server.stats["requests"] += 1
            try:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw.strip() else {}
                if not isinstance(body, dict):
                    raise BadRequest("the request body must be a JSON object")
                status, out = server.route(method, self.path.split("?")[0], body)
            except (BadRequest, RequestError, json.JSONDecodeError, UnicodeDecodeError, ValueError) as err:
                server.stats["bad_requests"] += 1
                status, out = 400, {"error": {"message": str(err)}}
            except EngineError as err:
                status, out = 503, {"error": {"message": str(err)}}
            except Exception as err:  # never let one request take the server down
                log.exception("engine server: %s %s failed", method, self.path)
                status, out = 500, {"error": {"message": repr(err)}}
            data = b"" if out is None else json.dumps(out).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt: str, *args) -> None:
            log.debug("engine server: " + fmt, *args)

    return Handler
