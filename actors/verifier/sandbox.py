"""The execution sandbox: a jailed process that imports one candidate and runs it on request.

Forked from the zygote for each candidate and jailed (jail.py). Its life has two halves.

Before the candidate exists (ordinary Python, the only code in the process):
    hello    {}     the jail's report (the one the verdict trusts: no candidate code exists yet)
    prepare  {candidate, source, artifacts, toolchain, key, threads, arena}
             install the candidate's prebuilt extensions, make the CUDA context, map the I/O arena
             (page-locked on cuda),
             capture every callable the second half uses, and seal the process (fence.py); the
             reply says it is sealed (the last reply without a MAC: no candidate code ran yet).
After (sealed.py: the closures of `sealed.server`, which look up nothing at run time):
    load     {}                               import the candidate: from here on, everything in this
                                              process is the candidate's
    build    {instances: [{init, seed, params}]}  every ModelNew the run needs (one per shape config),
                                              then arm the compute fence: no input exists yet, and
                                              from here on ATen computes nothing until exit
    call     {instance, inputs, out, after, kept}  one correctness trial
    stage    {instance, calls}                K timed calls' inputs, from the arena onto the device
    trip     {null, expect, flush, preroll, head_start}  the preroll, then the K staged calls
                                              timed, each output snapshotted at its return
    fetch    {call, out}                      one snapshot of the last trip, into the arena
    profile  {calls, events}                  the last trip's calls again under torch's profiler: the
                                              kernels' names and times, for feedback only (profile.py)
    close

Tensors never cross the socket. The verifier created the I/O arena (a memory file mapped here before
sealing); requests name regions of it, and this process moves bytes between it and its tensors with
plumbing copies no Python code can intercept (kiln_fence). Outputs are read as data: `forward`'s
result must be exactly a tensor, or exactly a tuple or list of exactly tensors, read with C accessors
and no method of the candidate's, and the bytes that count are those copied at the moment `forward`
returned (on cuda: once the caller's stream is synchronised), before anything else runs here.
Every reply carries a MAC under a key that only this process's own code holds: the candidate can
read and write the socket, but cannot forge a reply.

What the second half uses is captured before sealing (`_capture`, a `sealed.Captured` record) and
bound into its closures: they look up no global, builtin or attribute, so nothing the candidate
patches changes what they do (tests/verifier checks their bytecode). What this process reports can only count against the
candidate: the verdict, the comparison with the reference and the clock that counts are the
verifier's.
"""

from __future__ import annotations

import _hashlib
import _socket
import os
import socket
import struct
import sys
import time
import traceback
import types

import msgpack
import torch

from actors.verifier import device_trace, fence, isolation, native, sealed, seccomp, timing
from actors.verifier.build.prebuilt import install_prebuilt
from actors.verifier.sealed_profile import profiler_parts
from actors.verifier.tensors import page_lock

_HEADER = struct.Struct("<I")
CANDIDATE_MODULE = "kiln_candidate"
MAX_REQUEST = 16 << 20  # a request is metadata and init arguments; tensors live in the arena
MAC_BYTES = 32
ALIGN = 64  # every tensor region in the arena starts at a multiple of this
CUDA_FATAL = (
    "CUDA error",
    "cudaError",
    "CUBLAS_STATUS",
    "CUDNN_STATUS",
    "device-side assert",
    "illegal memory access",
    "an illegal instruction",
    "misaligned address",
)
SETTLE_S = 0.002  # cpu: the pause before the second look at a trial's outputs (work still running?)
# cuda: a correctness trial's inputs land about a millisecond after forward is called, in the caller's
# stream order (until then they hold NaN): work not ordered after that stream reads no input.
INPUT_DELAY_CYCLES = 2_000_000
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


# ------------------------------------------------------------------ before the candidate exists


def child_main(fds: list[int], spec, report, args: dict) -> int:
    """Entry point in the jailed process (called by the zygote): fds = [socket, evidence pipe, arena]."""
    isolation.hide_kiln_modules()
    if fence.active():
        report.ok("fence")
    else:
        report.fail("fence", "the compute fence's native library was not loaded: ATen kernels are not fenced")
    sock = socket.socket(fileno=fds[0])
    device = "cuda" if args.get("device") == "cuda" else "cpu"
    try:
        while True:
            req = _receive(sock)
            if req is None or req.get("op") == "close":
                return 0
            if req.get("op") == "hello":
                _send(sock, dict(_hello(report, device, bool(req.get("check_cuda"))), nonce=req.get("nonce")))
            elif req.get("op") == "prepare":
                return _prepare(sock, fds[1], fds[2], device, req, report)
            else:
                _send(
                    sock,
                    {
                        "ok": False,
                        "internal": True,
                        "nonce": req.get("nonce"),
                        "error": f"unexpected request {req.get('op')!r}",
                    },
                )
    except BaseException:  # noqa: BLE001 - a bug here, before any candidate code: the verifier reports infra
        traceback.print_exc()
        return 5


def _receive(sock: socket.socket) -> dict | None:
    head = _read(sock, _HEADER.size)
    if head is None:
        return None
    (n,) = _HEADER.unpack(head)
    body = _read(sock, n) if n <= MAX_REQUEST else None
    return msgpack.unpackb(body, raw=False) if body is not None else None


def _read(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            return None
        got += k
    return bytes(buf)


def _send(sock: socket.socket, body: dict) -> None:
    payload = msgpack.packb(body, use_bin_type=True)
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def _hello(report, device: str, check_cuda: bool) -> dict:
    """The jail's report, before any candidate code exists. On cuda the sandbox's CUDA context is
    created here, as the sandbox starts: that is driver work, no kernel runs, so it need not wait for
    the device's shared lease, under which the verifier sends `prepare` (and a timed window queued
    behind a long shared hold holds up every other run's device work with it). With `check_cuda` (the
    verifier's start-up probe), also whether that worked, and which GPUs it sees."""
    reply = {"ok": True, "jail": report.to_json(), "pid": os.getpid()}
    if check_cuda or device == "cuda":
        try:
            torch.cuda.set_device(0)
            torch.empty(1, device="cuda")
            reply["cuda"] = ""
            if check_cuda:  # the GPUs this process sees (by UUID): the verifier checks the one it was pinned to
                reply["gpus"] = [
                    str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())
                ]
        except Exception as err:  # noqa: BLE001 - reported to the verifier, which refuses to start
            reply["cuda"] = f"{type(err).__name__}: {err}"[:600]
    return reply


def _prepare(sock: socket.socket, evidence_fd: int, arena_fd: int, device: str, req: dict, report) -> int:
    """Everything that must exist before the candidate does, the seal, the import, then `serve`."""
    key = bytes(req["key"])
    try:
        if device == "cuda":
            torch.cuda.set_device(0)
            torch.empty(1, device="cuda")  # the context, before any candidate code
        torch.set_num_threads(int(req.get("threads") or timing.CPU_TIMING_THREADS))
        torch.empty(1 << 20).fill_(1)  # start the intra-op pool now, not inside the first forward
        arena = torch.from_file(f"/proc/self/fd/{arena_fd}", shared=True, size=int(req["arena"]), dtype=torch.uint8)
        os.close(arena_fd)
        pin_s = time.perf_counter()
        if device == "cuda":  # staged inputs and fetched outputs then cross the bus by DMA
            page_lock(arena)
        pin_s = time.perf_counter() - pin_s
        if req.get("artifacts") is not None:
            install_prebuilt(req["artifacts"], req["toolchain"])
        caps = _capture(sock, key, arena, device)
    except Exception as err:  # noqa: BLE001 - still no candidate code: the system's fault
        _send(sock, {"ok": False, "internal": True, "error": f"{type(err).__name__}: {err}"[:2000]})
        return 5
    path, source = str(req["candidate"]), str(req.get("source") or "")
    module = types.ModuleType(CANDIDATE_MODULE)
    module.__file__ = path
    sys.modules[CANDIDATE_MODULE] = module
    try:
        code = compile(source, path, "exec")
    except SyntaxError as err:  # the static stage parsed it, so this is the system's fault
        _send(sock, {"ok": False, "internal": True, "error": f"SyntaxError: {err}"})
        return 5
    kn = native.loaded()
    fence.install_refusers(kn)
    sys.modules.pop(native.NATIVE, None)
    sys.modules.pop(native.FENCE, None)
    own = tuple(str(p) for p in (req.get("artifacts") or {}).values())  # its artifact table: all it may load
    native.arm(kn, evidence_fd, path, source, seccomp.armed_seccomp_program(), own_libraries=own)
    serve = sealed.server(caps)
    _send(
        sock, {"ok": True, "nonce": req["nonce"], "pin_s": pin_s}
    )  # sealed; the last unsigned reply: no candidate code ran yet
    return serve(code, module)


def _capture(sock: socket.socket, key: bytes, arena: torch.Tensor, device: str) -> sealed.Captured:
    """Every callable and object the sealed loop uses, bound now: C functions and methods of C types
    (which no Python code can replace), a msgpack packer, the sandbox's own tensors."""
    data = fence.data_movement()
    if data is None:
        raise RuntimeError("the sandbox's data movement needs the fence library (kiln_fence)")
    from torch import nn

    kn = native.loaded()
    parts = _device_parts(device)
    return sealed.Captured(
        sock=sock,
        key=key,
        arena=arena,
        device=device,
        dtypes=dict(DTYPES),
        dtype_names=dict(DTYPE_NAMES),
        recv_into=_socket.socket.recv_into,
        sendall=_socket.socket.sendall,
        unpack_header=_HEADER.unpack,
        pack_header=_HEADER.pack,
        unpackb=msgpack.unpackb,
        pack=msgpack.Packer(use_bin_type=True).pack,
        hmac=_hashlib.hmac_digest,
        bytearray_=bytearray,
        memoryview_=memoryview,
        bytes_=bytes,
        str_=str,
        exec_=exec,
        type_name=type.__dict__["__name__"].__get__,
        len_=len,
        range_=range,
        type_=type,
        tuple_=tuple,
        list_=list,
        dict_=dict,
        tensor_type=torch.Tensor,
        base_exception=BaseException,
        exception=Exception,
        append=list.append,
        dict_get=dict.get,
        str_contains=str.__contains__,
        plain=data.plain,
        meta=data.meta,
        span=data.span,
        dense=data.dense,
        precomputed=data.precomputed,
        empty=data.empty,
        bytes_view=data.bytes_view,
        copy=data.copy,
        poison=data.poison,
        arm_compute=kn.arm_compute,
        evidence_since=kn.evidence_since,
        perf=time.perf_counter,
        sleep=time.sleep,
        site_of=kn.traceback_site,
        exc_traceback=BaseException.__traceback__.__get__,
        cuda_fatal=CUDA_FATAL,
        module_dict=type(sys).__dict__["__dict__"].__get__,
        issubclass_=issubclass,
        module_class=nn.Module,
        state_dict=nn.Module.state_dict,
        load_state_dict=nn.Module.load_state_dict,
        to_device=nn.Module.to,
        manual_seed=torch.default_generator.manual_seed,
        no_grad=torch._C._set_grad_enabled,
        align=ALIGN,
        settle_s=SETTLE_S,
        comparison=_comparison(device),
        **parts,
        clock=timing.call_clock(device, parts["flush"]),
        profiler=profiler_parts(),
        # cuda: CUPTI loaded and its first trace run here, before any candidate code (device_trace.py)
        trace=device_trace.attach(kn, torch.version.cuda) if device == "cuda" else None,
        demangle=torch._C._demangle,
    )


def _device_parts(device: str) -> dict:
    """The synchronisation, stream and L2-flush parts: no-ops and no buffers on cpu."""
    if device != "cuda":
        return {
            "sync": _noop,
            "stream_sync": _noop,
            "set_stream": _noop,
            "delay": _noop,
            "flush": None,
        }
    stream = torch.cuda.current_stream()
    ident = (stream.stream_id, stream.device_index, stream.device_type)
    props = torch.cuda.get_device_properties(0)
    l2 = timing.flush_bytes(getattr(props, "L2_cache_size", 0))
    return {
        "sync": torch._C._cuda_synchronize,
        "stream_sync": lambda _s=stream, _f=torch._C._CudaStreamBase.synchronize: _f(_s),
        "set_stream": lambda _i=ident, _f=torch._C._cuda_setStream: _f(*_i),
        "delay": lambda _f=torch._C._cuda_sleep: _f(INPUT_DELAY_CYCLES),
        "flush": torch.empty(l2, dtype=torch.uint8, device="cuda"),
    }


def _noop() -> None:
    return None


def _comparison(device: str) -> list:
    """(namespace, name, getter) of the functions a comparison or a measurement would use: patching
    them is an attempt on the verdict, recorded though it cannot succeed (outputs are compared and
    calls timed in the verifier's own process)."""
    import time as time_module

    import torch.testing

    proxy = type(type.__dict__).get
    found = (
        [(vars(torch), n, dict.get) for n in ("allclose", "isclose", "equal", "testing")]
        + [(vars(torch.testing), "assert_close", dict.get)]
        + [(torch.Tensor.__dict__, n, proxy) for n in ("__eq__", "__ne__")]
        + [(torch._C.TensorBase.__dict__, n, proxy) for n in ("allclose", "equal", "isclose")]
        + [(vars(time_module), n, dict.get) for n in ("perf_counter", "perf_counter_ns", "monotonic", "time")]
    )
    if device == "cuda":
        found += [(vars(torch.cuda), n, dict.get) for n in ("synchronize", "Event", "current_stream", "Stream")]
        found += [(torch.cuda.Event.__dict__, n, proxy) for n in ("elapsed_time", "record", "synchronize", "query")]
    return found
