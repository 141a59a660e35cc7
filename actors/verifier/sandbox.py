"""The execution sandbox: imports one candidate and runs it on the verifier's request.

A sandbox is forked from the zygote (zygote.py) for each candidate and jailed (jail.py: its own PID,
mount and network namespaces, an unprivileged uid, a read-only filesystem with one scratch
directory, seccomp), so nothing a candidate does reaches the verifier or the next candidate. Before
any candidate code exists it hides Kiln's own modules (isolation.hide_kiln_modules), arms the audit
hook and points the compute fence (fence.py) at the candidate. Then it answers requests:

    hello    {}                                             the jail's report (before any candidate code)
    prepare  {source, artifacts, toolchain, reference_paths} install prebuilt .so files, import
    instance {init_args, seed, state_dict}                  build ModelNew for one shape config
    call     {inputs}                                       one gated forward -> outputs (a correctness trial)
    stage    {inputs}                                       copy a timed run's inputs into the fixed buffers
    run      {null}                                         one timed forward (null: the same path without it)
    settle   {}                                             the timed run's shared-mapping check (untimed)
    outputs  {}                                             the last timed run's outputs
    close

This process is untrusted from the moment the candidate is imported: what it reports can only count
against the candidate. It never sees an expected output, never compares anything with the reference,
and its clock is cross-checked by the verifier's own (runner.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import socket
import sys
import time
import traceback
from pathlib import Path

import torch

from actors.verifier import fence, gate, isolation, timing, wire
from actors.verifier.build.prebuilt import install_prebuilt
from actors.verifier.gate import AuditMonitor, Findings, GateSession, Integrity
from actors.verifier.legality import Violation

_TB = torch._C.TensorBase
_clone = _TB.clone
_numpy = _TB.numpy  # captured before the fence wraps it (preload)
_contiguous, _reshape, _view, _to = _TB.contiguous, _TB.reshape, _TB.view, _TB.to
_sleep = time.sleep
_perf = time.perf_counter
SETTLE_S = 0.002  # cpu: pause before re-reading the outputs, to see whether a thread still writes them
_CUDA_MARKERS = ("CUDA error", "cudaError", "CUBLAS_STATUS", "CUDNN_STATUS", "device-side assert",
                 "illegal memory access", "an illegal instruction", "misaligned address")


def preload(fence_library: str | None) -> None:
    """In the zygote, before any fork: register the compute fence (inherited by every child)."""
    fence.install(fence_library)


class ChildState:
    """Everything one sandbox knows about its candidate."""

    def __init__(self, sock: socket.socket, scratch: Path, device_type: str, jail_report, evidence_fd: int) -> None:
        self.sock = sock
        self.scratch = scratch
        self.device_type = device_type
        self.device = "cuda" if device_type == "cuda" else "cpu"
        self.jail = jail_report
        self.evidence_fd = evidence_fd
        self.findings = Findings()
        self.candidate_file = ""
        self.audit: AuditMonitor | None = None
        self.integrity: Integrity | None = None
        self.model_cls = None
        self.model: torch.nn.Module | None = None
        self.owned: list[tuple[int, int]] = []  # storage ranges of the model's parameters and buffers
        self.previous: list[torch.Tensor] = []  # outputs of the last call, held to catch storage reuse
        self.retired: list[torch.Tensor] = []  # the outputs before those, freed by the untimed `settle`
        self.calls = 0
        self.shared_maps: set[str] = set()  # shared mappings present before any candidate code ran
        self.clock: timing.Clock | None = None
        self.feed: list = []  # the fixed input buffers of timed runs
        self.last: list[torch.Tensor] = []  # the last timed run's outputs

    def armed(self):
        return _Armed(self)

    def collect(self) -> list[dict]:
        if self.integrity is not None:
            for v in self.integrity.check():
                self.findings.add(v)
        for op in fence.take_refused():
            self.findings.add(Violation("forbidden_op", op, "", "ATen compute inside forward (the kernel refused to run)"))
        return self.findings.drain()

    def to_device(self, items: list) -> list:
        """Received tensors on the execution device, in memory torch allocated (received buffers are
        not: the foreign-memory check would mistake them for numpy data)."""
        return [(_clone(x) if self.device == "cpu" else _to(x, self.device)) if isinstance(x, torch.Tensor) else x
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


def handle_hello(st: ChildState, req: dict) -> dict:
    """The jail's report, before any candidate code exists. With `check_cuda` (the verifier's start-up
    probe on cuda), also whether a CUDA context can be created inside the jail."""
    reply = {"ok": True, "jail": st.jail.to_json(), "pid": os.getpid()}
    if req.get("check_cuda"):
        try:
            torch.cuda.set_device(0)
            torch.empty(1, device="cuda")
            timing.device_sync()
            reply["cuda"] = ""
        except Exception as err:  # noqa: BLE001 - reported to the verifier, which refuses to start
            reply["cuda"] = f"{type(err).__name__}: {err}"[:600]
    return reply


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
    _TB.fill_(torch.empty(1 << 20), 1)  # start the intra-op pool now, not inside the first forward
    st.clock = timing.Clock(st.device_type)
    st.audit = AuditMonitor(st.findings, st.candidate_file, req.get("reference_paths", []))
    st.audit.install()
    fence.arm(st.candidate_file, st.findings, st.evidence_fd, gate.candidate_site)
    st.shared_maps = shared_mappings(st.device_type)
    st.integrity = Integrity()
    if req.get("artifacts") is not None:
        install_prebuilt(req["artifacts"], req["toolchain"])
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
    check_shared_mappings(st)
    return {"ok": True}


def handle_instance(st: ChildState, req: dict) -> dict:
    st.model, st.previous, st.feed, st.last = None, [], [], []
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
    check_shared_mappings(st)
    return {"ok": True, "params": params}


def handle_call(st: ChildState, req: dict) -> dict:
    """A correctness trial: the detailed gate, the settle check, and the input-mutation check."""
    inputs = st.to_device(req["inputs"])
    before = [tensor_digest(x) if isinstance(x, torch.Tensor) else None for x in inputs]
    st.sync()
    session = GateSession(st.findings, st.candidate_file, st.device_type, detailed=True).watch_threads()
    with torch.no_grad(), st.armed(), session:
        raw = st.model(*inputs)
    outs, failure = check_outputs(st, raw, inputs)
    if failure is None:
        settle(st, session, outs)
        for i, (x, digest) in enumerate(zip(inputs, before)):
            if digest is not None and tensor_digest(x) != digest:
                st.findings.add(Violation("input_mutated", f"input {i} was modified in place", "",
                                          "forward must not write to its inputs"))
    st.calls += 1
    st.previous = outs
    check_shared_mappings(st)
    return {"ok": True, "outputs": outs if failure is None else [], "failure": failure}


def handle_stage(st: ChildState, req: dict) -> dict:
    """Before a timed run (not timed): its fresh inputs go into the fixed buffers (the same addresses
    every run, as the baseline is fed), and on cuda the L2 cache is flushed."""
    inputs = req["inputs"]
    if len(st.feed) != len(inputs) or any(
            isinstance(b, torch.Tensor) != isinstance(x, torch.Tensor)
            or (isinstance(x, torch.Tensor) and (b.shape != x.shape or b.dtype != x.dtype))
            for b, x in zip(st.feed, inputs)):
        st.feed = st.to_device(inputs)
    else:
        st.feed = [_TB.copy_(b, x) if isinstance(x, torch.Tensor) else x for b, x in zip(st.feed, inputs)]
    # Free the received buffers here, untimed: dropped at the next request instead, a large input
    # (128 MB for a level-1 task on cuda) would be unmapped inside the timed run's round trip.
    del inputs
    req.pop("inputs", None)
    st.last = []
    st.clock.prepare()
    return {"ok": True}


def handle_run(st: ChildState, req: dict) -> dict:
    """One timed forward, measured by this process's clock (the verifier measures the round trip with
    its own). `null` runs the same path with a call that returns the last outputs instead of forward:
    the verifier's measure of the overhead around a call."""
    null = bool(req.get("null"))
    call = (lambda: st.last) if null else (lambda: st.model(*st.feed))
    session = GateSession(st.findings, st.candidate_file, st.device_type, detailed=False).watch_threads()
    with torch.no_grad(), st.armed(), session:
        opened = _perf()
        raw, seconds = st.clock.measure(call)
        window = _perf() - opened  # this process's wall clock around the same window (diagnostics)
    outs, failure = check_outputs(st, raw, st.feed, record=not null)
    if null:
        session.new_threads(native_too=st.calls > 0)
        return {"ok": True, "seconds": seconds, "window_s": window}
    if failure is None:
        _thread_check(st, session)
    st.calls += 1
    st.retired = st.previous  # freed by `settle`, outside the round trip the verifier times
    st.previous = outs
    st.last = outs if failure is None else []
    return {"ok": True, "seconds": seconds, "window_s": window, "failure": failure}


def handle_settle(st: ChildState, req: dict) -> dict:
    """After a timed run and its null run, outside both round trips: what would otherwise sit in the
    run's round trip but not in the null's, and so skew the verifier's floor: the shared-mapping
    check (reading /proc/self/maps takes milliseconds in a CUDA process) and freeing the previous
    run's outputs (unmapping a large CPU tensor takes milliseconds too)."""
    check_shared_mappings(st)
    st.retired = []
    return {"ok": True}


def handle_outputs(st: ChildState, req: dict) -> dict:
    return {"ok": True, "outputs": st.last}


def check_outputs(st: ChildState, out, inputs: list, *, record: bool = True):
    """Outputs must be plain, dense tensors on the device in memory of their own. `record=False`
    (the null run) goes through the same checks without adding findings."""
    findings = st.findings if record else Findings()
    items = list(out) if isinstance(out, (tuple, list)) else [out]
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            return [], f"forward returned {type(t).__name__} as output {i}, not a tensor"
        if type(t) is not torch.Tensor:
            findings.add(Violation("output_type", f"output {i} is a {type(t).__qualname__}", "",
                                      "outputs must be plain torch.Tensor objects, not subclasses"))
            return [], f"output {i} is a tensor subclass"
        if t.layout != torch.strided or t.device.type != st.device_type:
            return [], f"output {i} is a {t.layout} tensor on {t.device}, expected a dense tensor on {st.device_type}"
        if gate.foreign_memory(t):
            findings.add(Violation("host_roundtrip", f"output {i} lives in memory torch did not allocate", "",
                                      "torch.from_numpy / frombuffer: computed outside torch"))
    taken = [_storage_range(x) for x in inputs if isinstance(x, torch.Tensor)]
    earlier = [_storage_range(p) for p in st.previous]
    for i, t in enumerate(items):
        r = _storage_range(t)
        if any(_overlaps(r, o) for o in taken) or any(_overlaps(r, o) for o in st.owned):
            findings.add(Violation("output_alias", f"output {i} shares memory with an input or parameter", "",
                                      "outputs must be fresh tensors"))
        elif any(_overlaps(r, o) for o in earlier):
            findings.add(Violation("output_reuse", f"output {i} reuses the memory of an earlier call's output",
                                      "", "outputs must be fresh tensors, not a cached result"))
    return items, None


def settle(st: ChildState, session: GateSession, outs: list) -> None:
    """Work still running after forward returned: on cuda, the current stream's view of the outputs
    must equal the device-wide one; on cpu, no thread may keep writing them."""
    snapshot = [tensor_digest(t) for t in outs]
    _thread_check(st, session)
    if st.device_type == "cuda":
        timing.device_sync()
    else:
        _sleep(SETTLE_S)
    if any(a != tensor_digest(b) for a, b in zip(snapshot, outs)):
        kind = "stream_escape" if st.device_type == "cuda" else "thread_escape"
        st.findings.add(Violation(kind, "the outputs were still being written after forward returned", "",
                                  "work on another stream/thread escapes the timer"))


def shared_mappings(device_type: str) -> set[str]:
    """This process's shared memory mappings (a file, shared memory or memfd mapped MAP_SHARED), as
    "range name" lines of /proc/self/maps. On cuda the driver maps devices, anonymous and memfd
    memory shared as the context grows, so only mappings of files count there (anything under
    /dev but /dev/shm is left out)."""
    found = set()
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                parts = line.split(None, 5)
                if len(parts) < 2 or parts[1][3:4] != "s":
                    continue
                name = parts[5].strip() if len(parts) > 5 else ""
                if device_type != "cpu" and not (name.startswith("/") and (not name.startswith("/dev/")
                                                                            or name.startswith("/dev/shm/"))):
                    continue
                found.add(f"{parts[0]} {name}")
    except OSError:
        pass
    return found


def check_shared_mappings(st: ChildState) -> None:
    """A shared mapping that candidate code made (torch.from_file(shared=True), a storage moved to
    shared memory, an mmap) is memory that a tensor and a file descriptor both see: Python can read
    the inputs' bytes and write results back through the descriptor while forward dispatches only
    plumbing copies. Tensors over memory torch did not allocate are the candidate's own kernels'
    business, never Python's, so any new shared mapping is a finding."""
    new = shared_mappings(st.device_type) - st.shared_maps
    if new:
        scratch = str(st.scratch)
        names = sorted({"a file in your scratch directory" if n.split(" ", 1)[-1].startswith(scratch) else
                        "shared memory" for n in new})
        st.findings.add(Violation("shared_memory", f"a shared memory mapping ({', '.join(names)})", "",
                                  "tensor memory that Python reads and writes outside PyTorch "
                                  "(torch.from_file / share_memory_ / mmap): compute in your own kernel"))
        st.shared_maps |= new  # said once


def _thread_check(st: ChildState, session: GateSession | None) -> None:
    if session is None:
        return
    late = session.new_threads(native_too=st.calls > 0)
    if late:
        st.findings.add(Violation("thread_escape", f"threads still running after forward returned: {late[:3]}",
                                  "", "work on a thread escapes the timer"))


def tensor_digest(t: torch.Tensor) -> bytes:
    """blake2b of a tensor's bytes, taken without any ATen compute op (only views and copies): the
    digest does not depend on kernels a candidate could have re-registered."""
    if _TB.numel(t) == 0:
        return hashlib.blake2b(str((tuple(t.shape), t.dtype)).encode()).digest()
    flat = _view(_reshape(_contiguous(t), (-1,)), torch.uint8)
    # A copy: Tensor.numpy() marks the storage it shares as not resizable, which the foreign-memory
    # check would later read as "memory torch did not allocate".
    flat = _to(flat, "cpu") if flat.device.type != "cpu" else _clone(flat)
    h = hashlib.blake2b(str((tuple(t.shape), t.dtype)).encode())
    h.update(memoryview(_numpy(flat)))
    return h.digest()


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


HANDLERS = {"hello": handle_hello, "prepare": handle_prepare, "instance": handle_instance, "call": handle_call,
            "stage": handle_stage, "run": handle_run, "settle": handle_settle, "outputs": handle_outputs}


def serve(st: ChildState) -> int:
    """Answer requests until `close` or the verifier hangs up. Returns the exit status."""
    while True:
        try:
            req = wire.recv(st.sock)
        except wire.WireError:
            return 0
        _reap_orphans()
        op, nonce = req.get("op"), req.get("nonce")
        if op == "close":
            return 0
        handler = HANDLERS.get(op)
        started = _perf()
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
        reply["handled_s"] = _perf() - started
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


def _reap_orphans() -> None:
    """As PID 1 of its namespace the sandbox inherits every orphan the candidate leaves: reap them."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return


def child_main(fds: list[int], spec, report, args: dict) -> int:
    """Entry point in the jailed process (called by the zygote)."""
    isolation.hide_kiln_modules()
    if fence.active():
        report.ok("fence")
    else:
        report.fail("fence", "the compute fence's native library was not loaded: ATen kernels are not fenced")
    sock = socket.socket(fileno=fds[0])
    evidence = fds[1] if len(fds) > 1 else -1
    st = ChildState(sock, Path(spec.scratch), str(args.get("device", "cpu")), report, evidence)
    try:
        return serve(st)
    except BaseException:
        traceback.print_exc()
        return 5
