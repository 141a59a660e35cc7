"""The execution sandbox: a jailed process that imports one candidate and runs it on request.

Forked from the zygote for each candidate and jailed (jail.py). Its life has two halves.

Before the candidate exists (ordinary Python, the only code in the process):
    hello    {}     the jail's report (the one the verdict trusts: no candidate code exists yet)
    prepare  {candidate, source, artifacts, toolchain, key, threads, arena}
             install the candidate's prebuilt extensions, make the CUDA context, map the I/O arena,
             capture every callable the second half uses, and seal the process (fence.py); the
             reply says it is sealed (the last reply without a MAC: no candidate code ran yet).
After (`server`'s nested functions, which look up nothing at run time):
    load     {}                               import the candidate: from here on, everything in this
                                              process is the candidate's
    build    {instances: [{init, seed, params}]}  every ModelNew the run needs (one per shape config),
                                              then arm the compute fence: no input exists yet, and
                                              from here on ATen computes nothing until exit
    call     {instance, inputs, out, after, kept}  one correctness trial
    stage    {instance, calls}                K timed calls' inputs, from the arena onto the device
    trip     {null, expect, flush}            the K staged calls timed, each output snapshotted at its
                                              return
    fetch    {call, out}                      one snapshot of the last trip, into the arena
    close

Tensors never cross the socket. The verifier created the I/O arena (a memory file mapped here before
sealing); requests name regions of it, and this process moves bytes between it and its tensors with
plumbing copies no Python code can intercept (kiln_fence). Outputs are read as data: `forward`'s
result must be exactly a tensor, or exactly a tuple or list of exactly tensors, read with C accessors
and no method of the candidate's, and the bytes that count are those copied at the moment `forward`
returned (on cuda: once the caller's stream is synchronised), before anything else runs here.
Every reply carries a MAC under a key that only this process's own code holds: the candidate can
read and write the socket, but cannot forge a reply.

What the second half uses was captured before sealing into its closure: it looks up no global,
builtin or attribute, so nothing the candidate patches changes what it does
(tests/verifier checks its bytecode). What this process reports can only count against the
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

from actors.verifier import fence, isolation, jail, native, timing
from actors.verifier.build.prebuilt import install_prebuilt

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
    except BaseException:  # a bug here, before any candidate code: the verifier reports infra
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
    """The jail's report, before any candidate code exists. With `check_cuda` (the verifier's start-up
    probe on cuda), also whether a CUDA context can be created inside the jail."""
    reply = {"ok": True, "jail": report.to_json(), "pid": os.getpid()}
    if check_cuda:
        try:
            torch.cuda.set_device(0)
            torch.empty(1, device="cuda")
            torch.cuda.synchronize()
            reply["cuda"] = ""
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
    native.arm(kn, evidence_fd, path, source, jail.armed_seccomp_program())
    serve = server(**caps)
    _send(sock, {"ok": True, "nonce": req["nonce"]})  # sealed; the last unsigned reply: no candidate code ran yet
    return serve(code, module)


def _capture(sock: socket.socket, key: bytes, arena: torch.Tensor, device: str) -> dict:
    """Every callable and object `server` uses, bound now: C functions and methods of C types (which
    no Python code can replace), a msgpack packer, the sandbox's own tensors."""
    data = fence.data_movement()
    if data is None:
        raise RuntimeError("the sandbox's data movement needs the fence library (kiln_fence)")
    import torch.nn as nn

    caps = dict(
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
        int_=int,
        len_=len,
        range_=range,
        type_=type,
        tuple_=tuple,
        list_=list,
        dict_=dict,
        min_=min,
        tensor_type=torch.Tensor,
        base_exception=BaseException,
        exception=Exception,
        value_error=ValueError,
        append=list.append,
        dict_get=dict.get,
        str_join=str.join,
        str_contains=str.__contains__,
        plain=data.plain,
        meta=data.meta,
        empty=data.empty,
        bytes_view=data.bytes_view,
        copy=data.copy,
        poison=data.poison,
        arm_compute=native.loaded().arm_compute,
        evidence_since=native.loaded().evidence_since,
        perf=time.perf_counter,
        sleep=time.sleep,
        site_of=native.loaded().traceback_site,
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
        sync=_noop,
        stream_sync=_noop,
        set_stream=_noop,
        delay=_noop,
        flush=None,
        flush_zero=None,
        comparison=_comparison(device),
    )
    if device == "cuda":
        stream = torch.cuda.current_stream()
        ident = (stream.stream_id, stream.device_index, stream.device_type)
        props = torch.cuda.get_device_properties(0)
        l2 = max(2 * int(getattr(props, "L2_cache_size", 0) or (50 << 20)), 64 << 20)
        caps.update(
            sync=torch._C._cuda_synchronize,
            stream_sync=lambda _s=stream, _f=torch._C._CudaStreamBase.synchronize: _f(_s),
            set_stream=lambda _i=ident, _f=torch._C._cuda_setStream: _f(*_i),
            delay=lambda _f=torch._C._cuda_sleep: _f(INPUT_DELAY_CYCLES),
            flush=torch.empty(l2, dtype=torch.uint8, device="cuda"),
            flush_zero=torch.zeros(l2, dtype=torch.uint8, device="cuda"),
        )
    return caps


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


# ---------------------------------------------------------- after: the candidate's process


def server(
    *,
    sock,
    key,
    arena,
    device,
    dtypes,
    dtype_names,
    recv_into,
    sendall,
    unpack_header,
    pack_header,
    unpackb,
    pack,
    hmac,
    bytearray_,
    memoryview_,
    bytes_,
    str_,
    exec_,
    type_name,
    int_,
    len_,
    range_,
    type_,
    tuple_,
    list_,
    dict_,
    min_,
    tensor_type,
    base_exception,
    exception,
    value_error,
    append,
    dict_get,
    str_join,
    str_contains,
    plain,
    meta,
    empty,
    bytes_view,
    copy,
    poison,
    arm_compute,
    evidence_since,
    perf,
    sleep,
    site_of,
    exc_traceback,
    cuda_fatal,
    module_dict,
    issubclass_,
    module_class,
    state_dict,
    load_state_dict,
    to_device,
    manual_seed,
    no_grad,
    align,
    settle_s,
    sync,
    stream_sync,
    set_stream,
    delay,
    flush,
    flush_zero,
    comparison,
):
    """The sandbox's half that runs once candidate code exists. Every name below is a parameter or a
    local: the nested functions load no global, builtin or attribute (tests/verifier checks the
    bytecode), so the candidate cannot change what they call."""
    state = {
        "models": [],
        "model": None,
        "cls": None,
        "snaps": [],
        "null_snaps": [],
        "sets": [],
        "last": None,
        "logged": 0,
    }

    def receive():
        head = read(4)
        if head is None:
            return None
        (n,) = unpack_header(head)
        if n > 16 << 20:
            return None
        body = read(n)
        return None if body is None else unpackb(body, raw=False)

    def read(n):
        buf = bytearray_(n)
        view = memoryview_(buf)
        got = 0
        while got < n:
            k = recv_into(sock, view[got:], n - got)
            if not k:
                return None
            got = got + k
        return bytes_(buf)

    def reply(nonce, body):
        body["nonce"] = nonce
        body["evidence"], state["logged"], _ = evidence_since(state["logged"])  # kiln_native log, since the last reply
        payload = pack(body)
        sendall(sock, pack_header(len_(payload)) + payload + hmac(key, payload, "sha256"))

    def tensor_at(desc):
        """A view of the arena: [offset, nbytes, dtype name, shape]."""
        return bytes_view(arena, desc[0], desc[1], dtypes[desc[2]], desc[3])

    def staged(items):
        """Inputs from the arena into fresh tensors of this device; non-tensor inputs as sent."""
        out = []
        for item in items:
            if type_(item) is dict_:
                append(out, item["v"])
                continue
            dst = empty(item[3], dtypes[item[2]], device)
            copy(dst, tensor_at(item))
            append(out, dst)
        return out

    def delayed(items):
        """A correctness trial's inputs: on cuda first onto the device, then, after a delay on the
        caller's stream, into tensors that hold NaN until then (the copy is in that stream's order,
        so only work ordered after it sees the inputs); on cpu as `staged`."""
        ready = staged(items)
        if flush is None:
            return ready
        out = []
        for x in ready:
            if type_(x) is tensor_type:
                dst = empty(meta(x)[1], meta(x)[0], device)
                poison(dst)
                append(out, dst)
            else:
                append(out, x)
        delay()
        for i in range_(len_(out)):
            if type_(out[i]) is tensor_type:
                copy(out[i], ready[i], True)
        return out

    def lookalike(kind):
        """A subclass of a tensor, tuple or list: something that poses as an output and runs code of
        its own when read."""
        return issubclass_(kind, tensor_type) or issubclass_(kind, tuple_) or issubclass_(kind, list_)

    def outputs_of(result):
        """forward's result as a tuple of plain tensors, or (None, why, whether it poses as one)."""
        kind = type_(result)
        if kind is tensor_type:
            return (result,), "", False
        if kind is not tuple_ and kind is not list_:
            return (
                None,
                f"forward returned a {type_name(kind)}, not a tensor or a tuple/list of tensors",
                lookalike(kind),
            )
        items = tuple_(result)
        for i in range_(len_(items)):
            if not plain(items[i]):
                return (
                    None,
                    f"output {i} is a {type_name(type_(items[i]))}, not a plain torch.Tensor",
                    lookalike(type_(items[i])),
                )
        return items, "", False

    def lay_out(items, region):
        """Copy tensors into the arena region [offset, limit]; their metadata, placed or not."""
        offset, limit = region[0], region[0] + region[1]
        placed = []
        for t in items:
            dtype, shape, strides, where, nbytes = meta(t)
            name = dict_get(dtype_names, dtype)
            entry = [-1, nbytes, name, list_(shape), list_(strides), where]
            if name is not None and where == device and offset + nbytes <= limit:
                copy(bytes_view(arena, offset, nbytes, dtype, shape), t)
                entry[0] = offset
                offset = offset + (nbytes + align - 1) // align * align
            append(placed, entry)
        return placed

    def failure(exc):
        text = str_(exc)[:2000]
        return {
            "ok": True,
            "failure": f"{type_name(type_(exc))}: {text}",
            "where": site_of(exc_traceback(exc)),
            "raised": True,
            "fatal": any_fatal(text),
        }

    watched = [(space, name, get, get(space, name)) for space, name, get in comparison]

    def patched():
        """The comparison functions of torch the candidate replaced (the verifier compares in its own
        process, so this only records the attempt)."""
        found = []
        for space, name, get, original in watched:
            if get(space, name) is not original:
                append(found, name)
        return found

    def any_fatal(text):
        for marker in cuda_fatal:
            if str_contains(text, marker):
                return True
        return False

    def op_load(code, module):
        exec_(code, module_dict(module))
        cls = dict_get(module_dict(module), "ModelNew")
        if type_(cls) is not type_ or not issubclass_(cls, module_class):
            return {"ok": True, "failure": "ModelNew must be a torch.nn.Module subclass defined by the candidate"}
        state["cls"] = cls
        return {"ok": True}

    def op_build(req):
        """Every ModelNew of the run, each seeded as the reference was and given the reference's
        parameters and buffers where their names and shapes match; then the compute fence is armed,
        before the first input exists here."""
        built, how = [], []
        for spec in req["instances"]:
            manual_seed(spec["seed"])
            model = state["cls"](*spec["init"])
            params = "seeded"
            wanted = spec["params"]
            if len_(state_dict(model)) == len_(wanted):
                loaded = {}
                for name, desc in wanted:
                    dst = empty(desc[3], dtypes[desc[2]], "cpu")
                    copy(dst, tensor_at(desc))
                    loaded[name] = dst
                try:
                    load_state_dict(model, loaded, True)
                    params = "loaded"
                except exception:
                    params = "seeded"
            append(built, to_device(model, device))
            append(how, params)
        sync()
        state["models"] = built
        arm_compute()
        return {"ok": True, "params": how}

    def op_call(req):
        """A correctness trial: the outputs as they are when forward returns (and the caller's
        stream is synchronised), again after the device (or, on cpu, a pause) settled, and the
        inputs as forward left them."""
        no_grad(False)
        set_stream()
        inputs = delayed(req["inputs"])
        result = state["models"][req["instance"]](*inputs)
        set_stream()
        stream_sync()
        items, why, subclass = outputs_of(result)
        if items is None:
            return {"ok": True, "failure": why, "subclass": subclass}
        first = lay_out(items, req["out"])
        started = perf()
        sync()  # cuda: the whole device; how long it took says whether work was still running
        pending = perf() - started
        sleep(settle_s) if device == "cpu" else None
        second = lay_out(items, req["after"])
        stream_sync()
        kept = lay_out([x for x in inputs if type_(x) is tensor_type], req["kept"])
        return {"ok": True, "outputs": first, "after": second, "inputs_after": kept, "pending_s": pending}

    def op_stage(req):
        """The next trip's inputs onto the device, one set per call (outside any timed request)."""
        if state["model"] is not state["models"][req["instance"]]:
            state["model"], state["snaps"], state["null_snaps"], state["last"] = (
                state["models"][req["instance"]],
                [],
                [],
                None,
            )
        state["sets"] = [staged(items) for items in req["calls"]]
        sync()
        return {"ok": True}

    def op_trip(req):
        """The staged calls, each preceded (on cuda) by an L2 flush and followed by a copy of its
        outputs to a snapshot the moment it returned; `null` does the same work without forward, on
        the last outputs. Ends when the device is idle."""
        no_grad(False)
        null, expect, sets = req["null"], req["expect"], state["sets"]
        # The null trip's snapshots have buffers of their own: the run trip's are what `fetch` reads.
        snaps = state["null_snaps"] if null else state["snaps"]
        while len_(snaps) < len_(sets):
            append(snaps, [empty(e[1], dtypes[e[0]], device) for e in expect])
        model = state["model"]
        for k in range_(len_(sets)):
            if flush is not None:
                copy(flush, flush_zero)
            set_stream()
            result = state["last"] if null else model(*sets[k])
            set_stream()
            items, why, subclass = outputs_of(result)
            if items is None:
                sync()
                return {"ok": True, "failure": why, "subclass": subclass}
            if len_(items) != len_(expect):
                sync()
                return {"ok": True, "failure": f"forward returned {len_(items)} outputs, expected {len_(expect)}"}
            for i in range_(len_(items)):
                dtype, shape, strides, where, nbytes = meta(items[i])
                if dict_get(dtype_names, dtype) != expect[i][0] or list_(shape) != expect[i][1] or where != device:
                    sync()
                    return {"ok": True, "failure": f"output {i} changed its dtype, shape or device in a timed call"}
                copy(snaps[k][i], items[i])
            state["last"] = result
        sync()
        return {"ok": True}

    def op_fetch(req):
        return {"ok": True, "outputs": lay_out(state["snaps"][req["call"]], req["out"])}

    handlers = {"build": op_build, "call": op_call, "stage": op_stage, "trip": op_trip, "fetch": op_fetch}

    def serve(code, module):
        while True:
            req = receive()
            if req is None or req["op"] == "close":
                return 0
            op = req["op"]
            started = perf()
            try:
                body = op_load(code, module) if op == "load" else handlers[op](req)
            except base_exception as exc:  # candidate code raised (SystemExit too), or a CUDA error surfaced
                body = failure(exc)
            body["handled_s"] = perf() - started
            body["patched"] = patched()
            reply(req["nonce"], body)
            if dict_get(body, "fatal"):
                return 4  # a CUDA error poisons this process: leave, the verifier starts a fresh one

    return serve
