"""Weight sync learner -> engines on CPU (docs/training.md): a learner-side HF model pushed over gloo
to RolloutActor engines in separate processes (Ray actors) whose logprobs then equal the learner's
own forward; a killed engine does not block the next push; a late engine is brought to the current
version before it serves; a multi-bucket version applies atomically under a running generation; the
disk transport; garbage to the weights endpoint; multi-bucket versions over HTTP; colocated engines
giving their memory back for a step. How engines join and rejoin: tests/weights/test_joins.py."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.base import as_ray_actor
from actors.learner.weight_sync import WeightServer
from actors.policy.model import build_model
from actors.policy.weights.base import specs, unique_tensors
from actors.rollout.actor import RolloutActor
from actors.rollout.engine import EngineError, GenerateRequest, SamplingParams
from configs import EvalConfig
from protocols import ErrorReply, TaskRequest, TensorSpec, WeightRequest, WeightsLoaded, decode_parts, encode_parts
from protocols.channels import RequestClient
from protocols.weights import ITEMSIZE, bucket_layout, flat_offsets, nbytes, plan_buckets
from tests.helpers.common import wait_for
from tests.helpers.weights import (
    PROMPT,
    RESPONSE,
    TINY,
    T,
    assert_serves,
    forced,
    learner_logprobs,
    register_learner,
    rollout_actor,
    rollout_cfg,
    train_a_little,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------------------------ the plan


specs_strategy = st.lists(
    st.builds(
        lambda i, d, s: TensorSpec(name=f"w{i}", dtype=d, shape=s),
        st.integers(0, 999),
        st.sampled_from(sorted(ITEMSIZE)),
        st.lists(st.integers(0, 40), max_size=3),
    ),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(specs_strategy, st.integers(-1, 5000))
def test_bucket_plan_keeps_order_and_size_and_is_deterministic(manifest, bucket_bytes):
    buckets = plan_buckets(manifest, bucket_bytes)
    assert [s for b in buckets for s in b] == manifest  # every tensor once, in order
    assert buckets == plan_buckets(list(manifest), bucket_bytes)
    for b in buckets:
        assert b and (len(b) == 1 or bucket_bytes <= 0 or sum(nbytes(s) for s in b) <= bucket_bytes)
        offsets, total = bucket_layout(b)
        assert all(o % 256 == 0 for o in offsets)
        ends = [o + nbytes(s) for o, s in zip(offsets, b, strict=True)]
        assert all(e <= o for e, o in zip(ends, offsets[1:], strict=False)) and total == (ends[-1] if ends else 0)


@settings(max_examples=200, deadline=None)
@given(specs_strategy, st.integers(-1, 5000))
def test_flat_bucket_plan_gives_each_bucket_one_dtype_in_manifest_order(manifest, bucket_bytes):
    buckets = plan_buckets(manifest, bucket_bytes, by_dtype=True)
    assert sorted((s.name, s.dtype) for b in buckets for s in b) == sorted((s.name, s.dtype) for s in manifest)
    for b in buckets:
        assert b and len({s.dtype for s in b}) == 1
        assert len(b) == 1 or bucket_bytes <= 0 or sum(nbytes(s) for s in b) <= bucket_bytes
        offsets, total = flat_offsets(b)  # SGLang's flattened_bucket: concatenated, no padding
        assert offsets == [sum(np.prod(s.shape, dtype=int) for s in b[:i]) for i in range(len(b))]
        assert total == sum(np.prod(s.shape, dtype=int) for s in b)
    for dtype in {s.dtype for s in manifest}:  # within a dtype the manifest's order
        assert [s for b in buckets for s in b if s.dtype == dtype] == [s for s in manifest if s.dtype == dtype]


def test_a_dtype_no_engine_loads_is_refused():
    with pytest.raises(ValueError, match="complex64"):
        plan_buckets([TensorSpec(name="x", dtype="complex64", shape=[2])], 100)


def test_the_weight_group_store_binds_its_own_port_so_no_other_process_can_take_it_first():
    """A port picked, released and bound later could be taken in between: a restarted `kiln train`
    died of EADDRINUSE so. Mutation: picking the port in the constructor (a bound-and-released
    socket) makes `.port` non-zero before `listen()`."""
    import socket

    from actors.policy.weights.group import WeightBroadcaster

    sender = WeightBroadcaster("127.0.0.1", 0, 2, timeout_s=5, form=False)
    assert sender.port == 0  # nothing picked yet, so nothing to lose
    sender.listen()
    assert sender.port > 0
    with socket.socket() as s, pytest.raises(OSError):  # the store holds it
        s.bind(("127.0.0.1", sender.port))
    sender.close()


# ------------------------------------------------------------------------------ gloo, end to end


def test_gloo_push_to_engines_in_other_processes_matches_the_learner(tmp_path, ray_session):
    ray = ray_session
    learner = build_model(TINY)  # the engines start from the same seed-0 weights
    server = WeightServer(tmp_path, transport="gloo", bucket_mb=0.05, timeout_s=30, join_timeout_s=20)
    endpoints = server.start()
    remote = as_ray_actor(RolloutActor, num_cpus=0)
    ctx = register_learner(tmp_path, endpoints)
    actors = {
        name: remote.remote(rollout_cfg(), TINY, EvalConfig(), dataclasses.replace(ctx, name=name))
        for name in ("ray-a", "ray-b")
    }
    late = None
    try:
        ray.get([a.start.remote() for a in actors.values()], timeout=120)
        a, b = actors["ray-a"], actors["ray-b"]
        (before,) = ray.get(a.generate.remote(forced()))
        assert np.abs(before.logprobs - learner_logprobs(learner)).max() <= 1e-5  # same initial weights
        # Version 0 (the initial weights, which the engines already serve as 0) is still pushed into
        # every group: the engines must receive it, or the push would hang on them.
        assert server.publish(0, learner.named_parameters).engines == 2
        assert server.wait_confirmed(0, ["ray-a", "ray-b"], timeout_s=30)

        train_a_little(learner)
        report = server.publish(1, learner.named_parameters)
        assert report.engines == 2 and not report.dropped and report.bytes > 0
        assert len(plan_buckets(server._manifest, server.bucket_bytes)) > 1
        assert server.wait_confirmed(1, ["ray-a", "ray-b"], timeout_s=30), server.health()
        expected = learner_logprobs(learner)
        for actor in (a, b):
            (after,) = ray.get(actor.generate.remote(forced()))
            assert after.versions.tolist() == [1] * len(RESPONSE)
            assert np.abs(after.logprobs - expected).max() <= 1e-5
            assert np.abs(after.logprobs - before.logprobs).max() > 1e-3  # the push changed something
            assert ray.get(actor.weight_version.remote()) == 1
        assert all(e["confirmed"] == 1 for e in server.health()["engines"].values())

        ray.kill(b)  # a dead engine must not block the push to the others
        train_a_little(learner, seed=1)
        start = time.monotonic()
        report = server.publish(2, learner.named_parameters)
        assert time.monotonic() - start < 20 and report.dropped == ["ray-b"] and report.engines == 1
        assert server.wait_confirmed(2, timeout_s=30)  # every live engine: ray-b no longer counts
        (after,) = ray.get(a.generate.remote(forced()))
        assert after.versions.tolist() == [2] * len(RESPONSE)
        assert np.abs(after.logprobs - learner_logprobs(learner)).max() <= 1e-5

        late = rollout_actor(tmp_path, endpoints, "late")  # joins after version 2: gets it before serving
        late.start()
        assert late.engine.weight_version == 2
        assert_serves(late, learner)
        assert server.wait_confirmed(2, ["late"], timeout_s=10)
        train_a_little(learner, seed=2)
        assert server.publish(3, learner.named_parameters).engines == 2
        assert server.wait_confirmed(3, ["ray-a", "late"], timeout_s=30)
        assert late.engine.weight_version == 3
    finally:
        if late is not None:
            late.stop()
        for actor in actors.values():
            ray.kill(actor)
        server.stop()


def test_flat_buckets_land_bit_identical_to_the_per_tensor_push(tmp_path):
    """The same version, two dtypes interleaved (matrices bf16, vectors fp32), pushed over gloo in flat
    single-dtype buckets and one tensor at a time: the engines end up with identical weights, the
    learner's, and the flat push sent one broadcast per bucket."""
    learner = build_model(dataclasses.replace(TINY, seed=8))
    train_a_little(learner)

    def named():
        return [
            (n, p.detach().to(torch.bfloat16) if p.dim() > 1 else p.detach()) for n, p in learner.named_parameters()
        ]

    states, calls = {}, {}
    for flat in (True, False):
        run_dir = tmp_path / ("flat" if flat else "per-tensor")
        server = WeightServer(run_dir, transport="gloo", bucket_mb=0.02, timeout_s=30, flat_buckets=flat)
        actor = rollout_actor(run_dir, server.start(), f"engine-{flat}")
        try:
            actor.start()
            receive, seen = actor.engine.update_weights_from_distributed, []

            def spy(names, *args, flat=False, _seen=seen, _receive=receive, **kw):
                _seen.append((len(names), flat))
                _receive(names, *args, flat=flat, **kw)

            actor.engine.update_weights_from_distributed = spy
            assert server.publish(1, named).engines == 1
            assert server.wait_confirmed(1, [f"engine-{flat}"], timeout_s=30)
            states[flat] = {n: t.clone() for n, t in actor.engine.model.state_dict().items()}
            calls[flat] = seen
        finally:
            actor.stop()
            server.stop()
    buckets = plan_buckets(specs(unique_tensors(named())), int(0.02 * 2**20), by_dtype=True)
    assert len(buckets) >= 3 and {b[0].dtype for b in buckets} == {"bfloat16", "float32"}
    assert calls[True] == [(len(b), True) for b in buckets]
    assert all(not flat for _, flat in calls[False])
    assert states[True].keys() == states[False].keys()
    for name, tensor in named():
        assert torch.equal(states[True][name], states[False][name]), name
        assert torch.equal(states[True][name], tensor.float()), name


def test_a_multi_bucket_version_lands_whole_under_a_running_generation(tmp_path):
    server = WeightServer(tmp_path, transport="gloo", bucket_mb=0.02, timeout_s=30)
    endpoints = server.start()
    actor = rollout_actor(tmp_path, endpoints, "atomic", on_weight_update="abort", max_batch=2)
    old, new = build_model(TINY), build_model(dataclasses.replace(TINY, seed=5))
    try:
        actor.start()
        engine = actor.engine
        receive = engine.update_weights_from_distributed

        def slow_buckets(*args, last=True, **kw):  # decode steps run between the buckets of a version
            receive(*args, last=last, **kw)
            if not last:
                time.sleep(0.03)

        engine.update_weights_from_distributed = slow_buckets
        engine.step_hook = lambda step: time.sleep(0.01)
        result = {}
        params = SamplingParams(temperature=T, max_new_tokens=60, ignore_eos=True)
        gen_thread = threading.Thread(
            target=lambda: result.update(gen=actor.generate([GenerateRequest("long", PROMPT, params)])[0])
        )
        gen_thread.start()
        wait_for(lambda: engine.stats["steps"] >= 5, what="decoding under way")
        report = server.publish(1, new.named_parameters)
        assert report.engines == 1
        buckets = len(plan_buckets(server._manifest, server.bucket_bytes))
        assert buckets >= 4
        gen_thread.join(60)
        gen = result["gen"]
        v = gen.versions
        assert 0 in v and 1 in v and (np.diff(v) >= 0).all()  # the update landed mid-generation
        ids = gen.output_ids.tolist()
        ref = np.where(v == 0, learner_logprobs(old, PROMPT, ids), learner_logprobs(new, PROMPT, ids))
        assert np.abs(ref - gen.logprobs).max() <= 1e-4  # every token from the whole version it names
        assert engine.stats["steps"] > buckets  # steps did run while buckets were arriving
        assert server.wait_confirmed(1, ["atomic"], timeout_s=10)
    finally:
        actor.stop()
        server.stop()


# ------------------------------------------------------------------------------- disk, fallbacks


def test_disk_transport_writes_atomic_versions_and_engines_load_them(tmp_path):
    model = build_model(dataclasses.replace(TINY, seed=3))
    server = WeightServer(tmp_path, transport="disk", hf_config=model.config)
    endpoints = server.start()
    actor = rollout_actor(tmp_path, endpoints, "disk-engine")
    try:
        actor.start()
        assert actor.engine.weight_version == 0  # nothing published yet: the initial weights serve
        for version in (3, 4, 5):
            with torch.no_grad():
                model.model.norm.weight.add_(0.1)
            server.publish(version, model.named_parameters)
            assert server.wait_confirmed(version, ["disk-engine"], timeout_s=30)
        assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v4", "v5"]  # the last 2 kept
        assert {p.name for p in (tmp_path / "weights" / "v5").iterdir()} == {"config.json", "model.safetensors"}
        assert actor.engine.weight_version == 5
        assert_serves(actor, model)
        with pytest.raises(ValueError, match="versions only grow"):
            server.publish(5, model.named_parameters)
    finally:
        actor.stop()
        server.stop()


def test_garbage_to_the_weights_endpoint_gets_an_error_and_the_server_keeps_serving(tmp_path):
    server = WeightServer(tmp_path, transport="disk")
    endpoints = server.start()
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(endpoints["weights"])
    client = RequestClient(endpoints["weights"], timeout_s=5, retries=0)
    try:
        raw.send_multipart([b"corr-1", b"\x00not a kiln frame"])
        assert raw.poll(5000)
        corr, *parts = raw.recv_multipart()
        reply = decode_parts(parts)
        assert corr == b"corr-1" and isinstance(reply, ErrorReply) and "undecodable" in reply.message
        raw.send_multipart([b"corr-2", *encode_parts(TaskRequest(actor_id="lost"))])
        assert raw.poll(5000)
        reply = decode_parts(raw.recv_multipart()[1:])
        assert isinstance(reply, ErrorReply) and "TaskRequest" in reply.message
        assert server.stats["bad_requests"] == 1
        # still serving: a real request and a confirmation are answered
        ann = client.request(WeightRequest(engine_id="probe"))
        assert ann.version == -1 and ann.transport == "disk"
        ack = client.request(WeightsLoaded(engine_id="probe", version=0, ok=True))
        assert ack == WeightsLoaded(engine_id="probe", version=0, ok=True)
    finally:
        raw.close()
        client.close()
        server.stop()


# ------------------------------------------------------------------ multi-bucket versions over HTTP


class SGLangRecorder:
    """Answers like an SGLang server (any version string but Kiln's) and records each call in order."""

    def __init__(self) -> None:
        import json
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.calls: list[tuple[str, dict]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, out: dict) -> None:
                data = json.dumps(out).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                recorder.calls.append((self.path, {}))
                self._answer({"version": "0.5.5", "weight_version": "0"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                recorder.calls.append((self.path, body))
                self._answer({"success": True, "message": "ok"})

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_the_sglang_client_pauses_sglang_around_a_multi_bucket_version_and_labels_only_the_last():
    from actors.rollout.http_client import SGLangClient

    server = SGLangRecorder()
    client = SGLangClient(server.url)
    try:
        for i, last in enumerate((False, False, True)):
            client.update_weights_from_distributed([f"w{i}"], ["bfloat16"], [[4]], version=3, group_name="g", last=last)
        posts = [(path, body) for path, body in server.calls if path != "/server_info"]
        assert [p for p, _ in posts] == ["/pause_generation"] + ["/update_weights_from_distributed"] * 3 + [
            "/continue_generation"
        ]
        assert posts[0][1] == {"mode": "in_place"}
        updates = [body for p, body in posts if p == "/update_weights_from_distributed"]
        assert [u["flush_cache"] for u in updates] == [False, False, True]
        assert ["weight_version" in u for u in updates] == [False, False, True] and updates[2]["weight_version"] == "3"
        client.update_weights_from_distributed(["w"], ["bfloat16"], [[4]], version=4, group_name="g")  # one bucket
        assert [p for p, _ in server.calls[-1:]] == ["/update_weights_from_distributed"]  # no pause needed
        assert "load_format" not in server.calls[-1][1]
        client.update_weights_from_distributed(
            ["w", "v"], ["bfloat16"] * 2, [[4], [2, 2]], version=5, group_name="g", flat=True
        )  # SGLang's bucketed receive
        assert server.calls[-1][1]["load_format"] == "flattened_bucket"
    finally:
        client.close()
        server.close()


def test_kiln_server_stages_buckets_sent_over_http_without_pausing(tmp_path):
    from actors.policy.weights.group import WeightBroadcaster
    from actors.rollout.http_client import SGLangClient
    from actors.rollout.http_server import EngineServer
    from actors.rollout.torch_engine import TorchEngine

    engine = TorchEngine(TINY, max_batch=2)
    http = EngineServer(engine)
    client = SGLangClient(http.start())
    new = build_model(dataclasses.replace(TINY, seed=9))
    named = [(n, p.detach()) for n, p in new.named_parameters()]
    halves = [named[: len(named) // 2], named[len(named) // 2 :]]
    sender = WeightBroadcaster("127.0.0.1", 0, 2, timeout_s=30, form=False)
    sender.listen()  # binds a port the kernel picks: `sender.port` names it from here
    # the first half one tensor at a time, the second as one flat bucket (load_format flattened_bucket)
    thread = threading.Thread(
        target=lambda: (sender.form("http-group"), sender.broadcast(halves[0]), sender.broadcast_flat([halves[1]]))
    )
    try:
        thread.start()
        client.init_weights_update_group("127.0.0.1", sender.port, 1, 2, group_name="http-group", backend="gloo")
        for half, last in zip(halves, (False, True), strict=True):
            client.update_weights_from_distributed(
                [n for n, _ in half],
                ["float32"] * len(half),
                [list(t.shape) for _, t in half],
                2,
                "http-group",
                last=last,
                flat=last,
            )
            assert engine.weight_version == (2 if last else 0)  # the first half is only staged
            assert not engine.health().paused
        thread.join(30)
        assert_serves(engine, new)
        with pytest.raises(EngineError, match="load_format 'bogus'"):
            client.call(
                "POST",
                "/update_weights_from_distributed",
                {"names": [], "dtypes": [], "shapes": [], "group_name": "http-group", "load_format": "bogus"},
            )
    finally:
        client.close()
        http.stop()
        engine.close()
        sender.close()


def test_colocated_engines_release_memory_for_the_step_and_take_it_back(tmp_path):
    model = build_model(TINY)
    server = WeightServer(tmp_path, transport="gloo", bucket_mb=1, timeout_s=30, join_timeout_s=20)
    endpoints = server.start()
    actor = rollout_actor(tmp_path, endpoints, "colocated")
    actor.start()
    try:
        server.release_engines()  # what the learner does before each step in colocated mode
        wait_for(lambda: actor.engine.health().released, 30, "the engine to release its memory")
        train_a_little(model)
        server.publish(1, model.named_parameters)
        wait_for(
            lambda: actor.engine.weight_version == 1 and not actor.engine.health().released,
            30,
            "the engine to take its memory back and load version 1",
        )
        (gen,) = actor.generate(forced())
        assert gen.versions.tolist() == [1] * len(RESPONSE)
        assert np.abs(gen.logprobs - learner_logprobs(model)).max() <= 1e-5
    finally:
        actor.stop()
        server.stop()


# ------------------------------------------------------------------ the GPU bench's smoke run on CPU


def test_the_weight_sync_bench_runs_both_forms_on_cpu(tmp_path):
    """launch/bench/weight_sync.py's two forms on the CPU over gloo with a toy model: torchrun with two
    ranks (raw broadcast, the transport flat and per tensor, the whole WeightServer path) and the
    one-process form (packing and applying against a raw copy), each row timed over 10 pushes; the
    GPU runs use the same code with NCCL."""
    import json
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(root)}
    bench = ["-m", "launch.bench.weight_sync", "--cpu", "--bucket-mb", "0.25", "--pushes", "10"]
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port), *bench],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    rows = {r["path"]: r for r in json.loads((tmp_path / "weight_sync.json").read_text())}
    flat = rows["transport, flat single-dtype buckets, packed ahead, 0.25 MiB buckets (12)"]
    assert (
        flat["pushes"] == 10
        and flat["of_raw"] > 0
        and flat["GB"] == rows["raw gloo broadcast, one flat buffer of the version's bytes"]["GB"]
    )
    assert {
        "WeightServer.publish, gloo, flat, 0.25 MiB (received)",
        "publish -> WeightsLoaded, gloo, per tensor",
        "transport, one broadcast per tensor, 0.25 MiB buckets (12)",
    } <= set(rows)
    one = subprocess.run(
        [sys.executable, *bench], cwd=root, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert one.returncode == 0, one.stderr[-3000:]
    rows = [r["path"] for r in json.loads((tmp_path / "weight_sync.json").read_text())]
    assert rows == [
        "raw device-to-device copy of the version's bytes",
        "learner: pack into flat buckets, 0.25 MiB (12)",
        "engine: apply a version (copy every tensor into the model)",
    ]
