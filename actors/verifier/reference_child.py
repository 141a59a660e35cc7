"""Inside a jailed reference's process: the reference module, run on the verifier's requests.

Forked from the zygote (kind "reference") and jailed as isolation.reference_jail says; its Kiln
modules are imported before the jail hides Kiln's tree (zygote.py). Before the reference's code
exists it maps the arena and closes the arena's descriptor (so no reference code can resize the file
under the verifier's mapping), makes its CUDA context on cuda, and stacks the filter a sealed sandbox
stacks (seccomp.armed_seccomp_program: no new processes, signals, timers or memory files). Then it
serves one request at a time, running the module through `InProcessProgram` exactly as the verifier's
own process runs the operator's references, and its baselines through `baselines.measure_reference`
with the verifier's lease (`RemoteLease`). Nothing here is trusted by the verifier
(jailed_reference.py checks every reply); this side trusts the verifier.

    hello      {}                                   -> {jail}
    load       {source, filename, task_id}          -> {declared}
    footprint  {overrides}                          -> {bytes}
    build      {overrides, seed}                    -> {handle, init, elements, state: [[name, tensor]]}
    draw       {overrides, seed}                    -> {inputs: [tensor | {"v": value}]}
    forward    {handle, inputs, overrides, wide}    -> {outputs: [tensor]}
    baselines  {overrides, pairs, warmup}           -> {eager, note}, the lease asked for in between:
               {"lease": "shared" | "exclusive"} -> {"granted": true} ... {"lease": "release"}
    close
A reply is {"ok": true, ...} or {"ok": false, "kind": raised | oom | reference, "error": one line}. Any
request may carry `drop`: handles of models the verifier no longer holds. A tensor is [offset, nbytes,
dtype, shape] in the arena: the verifier's inputs where it put them, this process's results from
offset 0 (the inputs are read first).
"""

from __future__ import annotations

import mmap
import os
import socket
from contextlib import contextmanager

import torch

from actors.verifier import native, seccomp, timing, wire
from actors.verifier.baselines import measure_reference, times_record
from actors.verifier.reference import Reference, ShapeConfig
from actors.verifier.reference_program import DeviceFull, InProcessProgram, ReferenceError
from actors.verifier.sandbox import DTYPE_NAMES, DTYPES
from protocols import KernelSpec, Task

MAX_REQUEST = 16 << 20  # the verifier's requests: descriptors, overrides, a reference's source
ALIGN = 64  # every tensor region starts at a multiple of this (a view of any dtype stays aligned)
# cuda: a request that moved more than this many bytes gives its freed device memory back once
# answered (not to this process's caching allocator, where the candidate's sandbox could not have
# it), as the verifier's own process does for the trials it parks (reference.KEEP_ON_DEVICE_BYTES).
GIVE_BACK_BYTES = 256 << 20
MAX_DEPTH = 32  # nesting of a plain value (init arguments, inputs that are not tensors)


class Uncarried(ReferenceError):
    """A value the verifier cannot carry (a dtype the arena has no name for, an object that is not a
    plain value): the task is unsupported, as in process (plan.carried)."""


def child_main(fds: list[int], spec, report, args: dict) -> int:
    """Entry point in the jailed process (called by the zygote): fds = [socket, arena]."""
    sock = socket.socket(fileno=fds[0])
    device = "cuda" if args.get("device") == "cuda" else "cpu"
    arena = torch.frombuffer(mmap.mmap(fds[1], int(args["arena"])), dtype=torch.uint8)
    os.close(fds[1])  # mapped: no reference code will hold the file itself
    # One intra-op thread, as a cpu sandbox has: this process and the verifier hand every request to each
    # other, and two OpenMP teams spinning on the same cores made each hand-over wait for a scheduler
    # tick (forwards of 20 ms instead of 0.4 ms on a 2-core host). On cuda its threads only launch.
    torch.set_num_threads(timing.CPU_TIMING_THREADS)
    if device == "cuda":
        torch.cuda.set_device(0)
        torch.empty(1, device="cuda")  # the context, before the filter below and before any reference code
        torch.backends.cuda.matmul.allow_tf32 = False  # as the verifier's references run: full fp32
        torch.backends.cudnn.allow_tf32 = False
    try:
        native.loaded().seccomp(seccomp.armed_seccomp_program())
    except OSError as err:
        report.fail("seccomp", f"the process filter (no new processes, signals or memory files): {err}")
    try:
        return _Server(sock, arena, device).serve(report)
    except wire.WireError:  # the verifier is gone, or sent what it never sends
        return 3


class _Server:
    def __init__(self, sock: socket.socket, arena: torch.Tensor, device: str) -> None:
        self.sock, self.arena, self.device = sock, arena, device
        self.program: InProcessProgram | None = None
        self.task: Task | None = None
        self.models: dict[int, object] = {}
        self.next_handle = 1
        self.moved = 0  # bytes the current request moved through the arena

    def serve(self, report) -> int:
        while True:
            req = wire.recv(self.sock, None, MAX_REQUEST)
            if not isinstance(req, dict) or req.get("op") == "close":
                return 0
            for handle in req.get("drop") or []:
                self.models.pop(handle, None)
            self.moved = 0
            try:
                reply = {"ok": True, **self._handle(req, report)}
            except DeviceFull as err:
                reply = {"ok": False, "kind": "oom", "error": _line(str(err))}
            except ReferenceError as err:
                reply = {"ok": False, "kind": "reference", "error": _line(str(err))}
            except BaseException as err:  # noqa: BLE001 - the reference's own exception, SystemExit included
                reply = {"ok": False, "kind": "raised", "error": _line(f"{type(err).__name__}: {err}")}
            wire.send(self.sock, reply)
            if self.device == "cuda" and self.moved > GIVE_BACK_BYTES:
                torch.cuda.empty_cache()

    def _handle(self, req: dict, report) -> dict:
        op = req.get("op")
        if op == "hello":
            return {"jail": report.to_json()}
        if op == "load":
            task_id = str(req["task_id"])
            self.program = InProcessProgram(str(req["source"]), str(req["filename"]), task_id, self.device)
            backend = "cuda" if self.device == "cuda" else "cpu"
            spec = KernelSpec(name=task_id.split("/")[-1], reference=str(req["source"]), backend=backend, level=0)
            self.task = Task(task_id=task_id, kind="kernel", kernel=spec)
            return {"declared": _declared(self.program)}
        program = self.program
        if program is None:
            raise ReferenceError("no reference is loaded")
        overrides = dict(req.get("overrides") or {})
        if op == "footprint":
            return {"bytes": program.footprint(overrides)}
        if op == "build":
            built = program.build(overrides, int(req["seed"]))
            handle, self.next_handle = self.next_handle, self.next_handle + 1
            self.models[handle] = built.model
            names, tensors = list(built.state_dict), list(built.state_dict.values())
            init = _plain(built.init_args, "get_init_inputs()")
            state = [[n, e] for n, e in zip(names, self._put(tensors), strict=True)]
            return {"handle": handle, "init": init, "elements": program.elements(built.model), "state": state}
        if op == "draw":
            return {"inputs": self._put(program.draw(overrides, int(req["seed"])))}
        if op == "forward":
            model = self.models.get(req.get("handle"))
            if model is None:
                raise ReferenceError("no such model")
            inputs = self._take(req["inputs"])
            wanted = req.get("overrides")
            outputs = program.forward(
                model, inputs, overrides=None if wanted is None else overrides, wide=bool(req.get("wide"))
            )
            return {"outputs": self._put(outputs)}
        if op == "baselines":
            return self._baselines(program, overrides, int(req["pairs"]), int(req["warmup"]))
        raise ReferenceError(f"unknown request {str(op)[:40]!r}")

    def _baselines(self, program: InProcessProgram, overrides: dict, pairs: int, warmup: int) -> dict:
        """The eager baseline, by the verifier's timing protocol, on a fresh instance and fresh draws
        (as baseline_worker.py times one); torch.compile is not timed here (its compilers run
        programs, which this process may not)."""
        ref = Reference(self.task, self.device, program)
        instance = ref.instance(ShapeConfig("primary", overrides, 1))
        eager, _, note = measure_reference(ref, instance, pairs, warmup, False, self.device, RemoteLease(self.sock))
        instance = None
        if self.device == "cuda":
            torch.cuda.empty_cache()  # what it timed goes back to the device, as the baseline process's does
        return {"eager": times_record(eager), "note": note}

    # --------------------------------------------------------------------------- the arena

    def _put(self, values: list) -> list:
        """Tensors into the arena from offset 0 (descriptors), plain values as {"v": value}."""
        out, offset = [], 0
        for x in values:
            if not isinstance(x, torch.Tensor):
                out.append({"v": _plain(x, "the reference")})
                continue
            t = x.detach().contiguous()
            name = DTYPE_NAMES.get(t.dtype)
            if name is None:
                raise Uncarried(f"the verifier cannot carry tensors of dtype {t.dtype}: this task is unsupported")
            nbytes = t.numel() * t.element_size()
            if offset + nbytes > self.arena.numel():
                raise Uncarried(f"the reference's tensors ({offset + nbytes} bytes) do not fit in its arena")
            if nbytes:
                self.arena[offset : offset + nbytes].copy_(t.reshape(-1).view(torch.uint8))
            out.append([offset, nbytes, name, list(t.shape)])
            offset = (offset + nbytes + ALIGN - 1) // ALIGN * ALIGN
        self.moved += offset
        return out

    def _take(self, entries: list) -> list:
        """The verifier's inputs, copied out of the arena onto this process's device."""
        out = []
        for entry in entries:
            if isinstance(entry, dict):
                out.append(entry.get("v"))
                continue
            offset, nbytes, name, shape = entry[:4]
            region = self.arena[offset : offset + nbytes].view(DTYPES[name]).reshape(shape)
            out.append(region.to(self.device) if self.device == "cuda" else region.clone())
            self.moved += nbytes
        return out


class RemoteLease:
    """The verifier's device lease, held by the verifier for this process: each hold is asked for on
    the channel and granted once the verifier has it, so the timing windows here are exclusive of
    every other on the device (the same lease, protocols/lease.py) without this process holding a lock
    file of the host's, and no hold outlasts the verifier's bound on it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    @contextmanager
    def shared(self):
        with self._held("shared"):
            yield

    @contextmanager
    def exclusive(self):
        with self._held("exclusive"):
            yield

    @contextmanager
    def _held(self, mode: str):
        wire.send(self.sock, {"lease": mode})
        reply = wire.recv(self.sock, None, MAX_REQUEST)
        if not (isinstance(reply, dict) and reply.get("granted") is True):
            raise RuntimeError("the verifier did not grant the device lease")
        try:
            yield
        finally:
            wire.send(self.sock, {"lease": "release"})


def _declared(program: InProcessProgram) -> dict:
    d = program.declared
    return {
        "defaults": _plain(d.defaults, "the module's shape constants"),
        "cpu_shapes": _plain(d.cpu_shapes, "KILN_CPU_SHAPES"),
        "alt_shapes": _plain(d.alt_shapes, "KILN_ALT_SHAPES"),
        "tolerance": list(d.tolerance) if d.tolerance is not None else None,
    }


def _plain(value, what: str, depth: int = 0):
    """`value` as msgpack's plain values (tuples become lists), or Uncarried naming `what`."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if depth < MAX_DEPTH and isinstance(value, (list, tuple)):
        return [_plain(v, what, depth + 1) for v in value]
    if depth < MAX_DEPTH and isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain(v, what, depth + 1) for k, v in value.items()}
    raise Uncarried(f"{what} gave a {type(value).__name__}, which the verifier cannot carry: this task is unsupported")


def _line(text: str) -> str:
    first = text.strip().splitlines()
    return first[0][:300] if first else ""
