"""The sandbox child: imports one candidate and runs it on the trusted side's request.

A child is forked from the zygote (zygote.py) for each candidate, so nothing a candidate leaves behind
(patches, threads, loaded extensions, a broken CUDA context) reaches the next one. It confines
itself (isolation.confine: scratch dir, no network), then answers requests on its socket:

    prepare  {source, artifacts, toolchain, reference_paths}   install prebuilt .so files, import
    instance {init_args, seed, state_dict}                      build ModelNew for one shape config
    call     {inputs}                                           one gated forward -> outputs
    time     {sets, order, warmup, repeats, budget_s, tol}      timed forwards, outputs re-checked
    close

Every reply carries the request's nonce, the findings of the legality gate (gate.py) and, for
errors, the exception with the candidate line it came from. This process never compares outputs
with the reference (it never sees one): it sends outputs back and the verifier compares them.
"""

from __future__ import annotations

import importlib.util
import socket
import sys
import time
import traceback
from contextlib import ExitStack
from pathlib import Path

import torch

from actors.verifier import gate, timing, wire
from actors.verifier.gate import AuditMonitor, Findings, GateSession, Integrity
from actors.verifier.isolation import confine
from actors.verifier.legality import Violation

_TB = torch._C.TensorBase
_clone = _TB.clone
_equal = torch.equal
_allclose = torch.allclose
_sleep = time.sleep
SETTLE_S = 0.002  # cpu: pause before re-reading the outputs, to see whether a thread still writes them
_CUDA_MARKERS = ("CUDA error", "cudaError", "CUBLAS_STATUS", "CUDNN_STATUS", "device-side assert",
                 "illegal memory access", "an illegal instruction", "misaligned address")


class ChildState:
    """Everything one child knows about its candidate."""

    def __init__(self, sock: socket.socket, scratch: Path, device_type: str, notes: list[str]) -> None:
        self.sock = sock
        self.scratch = scratch
        self.device_type = device_type
        self.device = "cuda" if device_type == "cuda" else "cpu"
        self.notes = notes
        self.findings = Findings()
        self.candidate_file = ""
        self.audit: AuditMonitor | None = None
        self.integrity: Integrity | None = None
        self.model_cls = None
        self.model: torch.nn.Module | None = None
        self.owned: list[tuple[int, int]] = []  # storage ranges of the model's parameters and buffers
        self.previous: list[torch.Tensor] = []  # outputs of the last call, held to catch storage reuse
        self.calls = 0
        self.clock: timing.Clock | None = None

    # ------------------------------------------------------------------------------ helpers

    def armed(self):
        return _Armed(self)

    def collect(self) -> list[dict]:
        if self.integrity is not None:
            for v in self.integrity.check():
                self.findings.add(v)
        return self.findings.drain()

    def to_device(self, items: list) -> list:
        """Received tensors on the execution device, in memory torch allocated (received buffers are
        not: the foreign-memory check would mistake them for numpy data)."""
        return [(_clone(x) if self.device == "cpu" else _TB.to(x, self.device)) if isinstance(x, torch.Tensor) else x
                for x in items]

    def sync(self) -> None:
        if self.device_type == "cuda":
            timing.device_sync()


class _Armed:
    """Audit hook armed while candidate code runs."""

    def __init__(self, state: ChildState) -> None:
        self.state = state

    def __enter__(self):
        if self.state.audit:
            self.state.audit.armed = True

    def __exit__(self, *exc):
        if self.state.audit:
            self.state.audit.armed = False
        return False


# ------------------------------------------------------------------------------------ handlers


def handle_prepare(st: ChildState, req: dict) -> dict:
    source, digest = req["source"], req["source_hash"][:16]
    path = st.scratch / f"kiln_candidate_{digest}.py"
    path.write_text(source, encoding="utf-8")
    st.candidate_file = str(path)
    if st.device_type == "cuda":
        torch.cuda.set_device(0)
        torch.empty(1, device="cuda")  # create the context before any candidate code runs
    if st.device_type == "cpu":
        torch.set_num_threads(timing.CPU_TIMING_THREADS)  # as the baseline is timed (timing.py)
    torch.ones(1 << 20).add_(1)  # start the intra-op pool now, not inside the first forward
    st.clock = timing.Clock(st.device_type)
    install = None
    if req.get("artifacts") is not None:
        from actors.verifier.build import install_prebuilt as install  # noqa: PLC0415
    st.audit = AuditMonitor(st.findings, st.candidate_file, req.get("reference_paths", []))
    st.audit.install()
    st.integrity = Integrity()
    if install is not None:
        install(req["artifacts"], req["toolchain"])
    name = f"kiln_candidate_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    with st.armed():
        spec.loader.exec_module(module)
    cls = getattr(module, "ModelNew", None)
    if not isinstance(cls, type) or not issubclass(cls, torch.nn.Module):
        return {"ok": False, "error": {"type": "TypeError", "where": "",
                                       "message": "ModelNew must be a torch.nn.Module subclass"}}
    st.model_cls = cls
    return {"ok": True, "notes": st.notes}


def handle_instance(st: ChildState, req: dict) -> dict:
    st.model, st.previous = None, []
    torch.manual_seed(req["seed"])
    with st.armed():
        model = st.model_cls(*req["init_args"])
    params = "seeded"
    ref_state = req["state_dict"]
    own_state = model.state_dict()
    if ref_state and set(own_state) == set(ref_state) and all(
            tuple(own_state[k].shape) == tuple(v.shape) for k, v in ref_state.items()):
        with st.armed():
            model.load_state_dict(ref_state, strict=True)
        params = "loaded"
    st.model = model.to(st.device)
    st.owned = [_storage_range(t) for t in list(st.model.parameters()) + list(st.model.buffers())]
    st.sync()
    return {"ok": True, "params": params}


def handle_call(st: ChildState, req: dict) -> dict:
    inputs = st.to_device(req["inputs"])
    pristine = [_clone(x) if isinstance(x, torch.Tensor) else x for x in inputs]
    st.sync()
    outs, failure = gated_forward(st, inputs, detailed=True)
    if failure is None:
        for i, (x, p) in enumerate(zip(inputs, pristine)):
            if isinstance(x, torch.Tensor) and not _same_bits(x, p):
                st.findings.add(Violation("input_mutated", f"input {i} was modified in place", "",
                                          "forward must not write to its inputs"))
    return {"ok": True, "outputs": outs if failure is None else [], "failure": failure}


def gated_forward(st: ChildState, inputs: list, *, detailed: bool):
    """One forward under the gate, then the output checks. Returns (outputs, failure text or None)."""
    session = new_session(st, detailed=detailed)
    raw = forward_only(st, session, inputs)
    return after_forward(st, session, raw, inputs, settle_check=True)


def new_session(st: ChildState, *, detailed: bool) -> GateSession:
    return GateSession(st.findings, st.candidate_file, st.device_type, detailed=detailed).watch_threads()


def forward_only(st: ChildState, session: GateSession, inputs: list):
    """The part of a call that is timed: the candidate's forward, gated."""
    with torch.no_grad(), st.armed(), session:
        return st.model(*inputs)


def after_forward(st: ChildState, session: GateSession, raw, inputs: list, *, settle_check: bool):
    outs, failure = check_outputs(st, raw, inputs)
    if failure is None:
        if settle_check:
            settle(st, session, outs)
        else:
            _thread_check(st, session)
    st.calls += 1
    st.previous = outs
    return outs, failure


def check_outputs(st: ChildState, out, inputs: list):
    items = list(out) if isinstance(out, (tuple, list)) else [out]
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            return [], f"forward returned {type(t).__name__} as output {i}, not a tensor"
        if type(t) is not torch.Tensor:
            st.findings.add(Violation("output_type", f"output {i} is a {type(t).__qualname__}", "",
                                      "outputs must be plain torch.Tensor objects, not subclasses"))
            return [], f"output {i} is a tensor subclass"
        if t.layout != torch.strided or t.device.type != st.device_type:
            return [], f"output {i} is a {t.layout} tensor on {t.device}, expected a dense tensor on {st.device_type}"
        if gate.foreign_memory(t):
            st.findings.add(Violation("host_roundtrip", f"output {i} lives in memory torch did not allocate", "",
                                      "torch.from_numpy / frombuffer: computed outside torch"))
    taken = [_storage_range(x) for x in inputs if isinstance(x, torch.Tensor)]
    earlier = [_storage_range(p) for p in st.previous]
    for i, t in enumerate(items):
        r = _storage_range(t)
        if any(_overlaps(r, o) for o in taken) or any(_overlaps(r, o) for o in st.owned):
            st.findings.add(Violation("output_alias", f"output {i} shares memory with an input or parameter", "",
                                      "outputs must be fresh tensors"))
        elif any(_overlaps(r, o) for o in earlier):
            st.findings.add(Violation("output_reuse", f"output {i} reuses the memory of an earlier call's output",
                                      "", "outputs must be fresh tensors, not a cached result"))
    return items, None


def settle(st: ChildState, session: GateSession, outs: list) -> None:
    """Work still running after forward returned: on cuda, the current stream's view of the outputs
    must equal the device-wide one; on cpu, no thread may keep writing them."""
    snapshot = [_clone(t) for t in outs]
    _thread_check(st, session)
    if st.device_type == "cuda":
        timing.device_sync()
    else:
        _sleep(SETTLE_S)
    if any(not _same_bits(a, b) for a, b in zip(snapshot, outs)):
        kind = "stream_escape" if st.device_type == "cuda" else "thread_escape"
        st.findings.add(Violation(kind, "the outputs were still being written after forward returned", "",
                                  "work on another stream/thread escapes the timer"))


def _thread_check(st: ChildState, session: GateSession) -> None:
    late = session.new_threads(native_too=st.calls > 0)
    if late:
        st.findings.add(Violation("thread_escape", f"threads still running after forward returned: {late[:3]}",
                                  "", "work on a thread escapes the timer"))


def handle_time(st: ChildState, req: dict) -> dict:
    order: list[int] = req["order"]
    feeder = timing.InputFeeder([st.to_device(s) for s in req["sets"]], order)
    feed = feeder.feed
    first: dict[int, list[torch.Tensor]] = {}
    bad: list[str] = []
    tol = req["tol"]
    sessions: dict[int, tuple[GateSession, ExitStack]] = {}

    def before(i: int) -> None:
        feeder.before(i)
        st.sync()
        # The gate is entered here and left in `after`, so its fixed cost stays outside the window;
        # only its per-op cost (ATen ops the candidate issues) is timed.
        session, stack = new_session(st, detailed=False), ExitStack()
        stack.enter_context(torch.no_grad())
        stack.enter_context(st.armed())
        stack.enter_context(session)
        sessions[i] = (session, stack)

    def call(i: int):
        return st.model(*feed)

    def after(i: int, raw) -> None:
        session, stack = sessions.pop(i)
        stack.close()
        # No settle pause here (it would cool the caches before the next timed run and bias the time):
        # timed runs get the thread check; the settle check ran on every correctness trial.
        outs, failure = after_forward(st, session, raw, feed, settle_check=False)
        if failure is not None:
            raise RuntimeError(failure)
        if i < 0:
            return
        k = feeder.set_of(i)
        if k not in first:
            first[k] = [_clone(t) for t in outs]
            return
        for j, (a, b) in enumerate(zip(outs, first[k])):
            if a.shape != b.shape or a.dtype != b.dtype or not _close(a, b, tol):
                bad.append(f"run {i}: output {j} differs from the first timed run on the same inputs")

    try:
        times = timing.run_series(st.clock, call, warmup=req["warmup"], repeats=req["repeats"],
                                  budget_s=req["budget_s"], before=before, after=after)
    finally:
        for _, stack in sessions.values():  # a forward that raised leaves its gate entered
            stack.close()
    return {"ok": True, "times": times, "first": [first.get(k, []) for k in range(len(req["sets"]))],
            "bad_runs": bad[:5]}


def _close(a: torch.Tensor, b: torch.Tensor, tol: list[float]) -> bool:
    if a.is_floating_point():
        return _allclose(a, b, atol=tol[0], rtol=tol[1])
    return _equal(a, b)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (torch.equal calls NaN unequal to itself; uninitialised memory has NaNs)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    raw = [_TB.view(_TB.reshape(_TB.contiguous(t), (-1,)), torch.uint8) if _TB.numel(t) else t for t in (a, b)]
    return _equal(raw[0], raw[1])


def _storage_range(t: torch.Tensor) -> tuple[int, int]:
    s = _TB.untyped_storage(t)
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[0] != a[1] and b[0] != b[1]


# -------------------------------------------------------------------------------- error reports


def describe_error(st: ChildState, err: BaseException) -> dict:
    where = ""
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == st.candidate_file:
            where = gate.format_site(st.candidate_file, tb.tb_lineno)
        tb = tb.tb_next
    message = str(err)
    fatal = any(m in message for m in _CUDA_MARKERS)
    if len(message) > 2000:
        message = message[:1000] + "\n...\n" + message[-800:]
    return {"type": type(err).__name__, "message": message, "where": where, "fatal": fatal}


HANDLERS = {"prepare": handle_prepare, "instance": handle_instance, "call": handle_call, "time": handle_time}


def serve(st: ChildState) -> int:
    """Answer requests until `close` or the verifier hangs up. Returns the exit status."""
    while True:
        try:
            req = wire.recv(st.sock)
        except wire.WireError:
            return 0
        op, nonce = req.get("op"), req.get("nonce")
        if op == "close":
            return 0
        handler = HANDLERS.get(op)
        started = time.perf_counter()
        try:
            reply = handler(st, req) if handler else {"ok": False, "internal": True,
                                                      "error": {"type": "ValueError", "message": f"unknown op {op!r}"}}
        except Exception as err:  # candidate code raised (or a CUDA error surfaced)
            reply = {"ok": False, "error": describe_error(st, err)}
        except BaseException as err:  # SystemExit, KeyboardInterrupt raised by the candidate
            st.findings.add(Violation("exit", f"{type(err).__name__} raised", "", "ending the process"))
            reply = {"ok": False, "error": describe_error(st, err)}
        reply["findings"] = st.collect()
        reply["nonce"] = nonce
        reply["seconds"] = time.perf_counter() - started
        try:
            wire.send(st.sock, reply)
        except (OSError, wire.WireError) as err:
            try:
                wire.send(st.sock, {"ok": False, "nonce": nonce, "findings": reply["findings"],
                                    "error": {"type": type(err).__name__, "where": "",
                                              "message": f"the result could not be sent back: {err}"}})
            except OSError:
                return 3
        if not reply.get("ok") and reply.get("error", {}).get("fatal"):
            return 4  # a CUDA error poisons this process: leave, the verifier starts a fresh child


def child_main(fd: int, scratch: str, device_type: str) -> int:
    """Entry point in the forked child (called by the zygote)."""
    scratch_dir = Path(scratch)
    notes = confine(scratch_dir)
    sock = socket.socket(fileno=fd)
    st = ChildState(sock, scratch_dir, device_type, notes)
    try:
        return serve(st)
    except BaseException:
        traceback.print_exc()
        return 5
