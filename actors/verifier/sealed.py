"""The sandbox's request loop once the process is sealed: everything it runs after candidate code exists.

sandbox.py captures, before sealing, every callable and object this loop uses into a `Captured`
record: C functions and methods of C types (which no Python code can replace), a msgpack packer,
the sandbox's own tensors. `server` then builds the loop out of closures, each made by a small
factory below that binds what its closures need into local variables first. The closures look up
no global, builtin or attribute when they run: every name in them is a parameter, a local or a
variable of the enclosing factory, so nothing the candidate patches (a module global, a builtin, a
method on a type it reaches) changes what they call. tests/verifier reads the bytecode of every
closure of `server` and of each factory it calls.

The requests it serves (load, build, call, stage, trip, fetch, profile: its closure is in
sealed_profile.py; close) are listed with the whole
conversation in sandbox.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from actors.verifier.sealed_profile import make_op_profile

Fn = Callable[..., Any]


@dataclass(frozen=True)
class Captured:
    """What the loop uses, bound before sealing (sandbox._capture)."""

    sock: Any
    key: bytes
    arena: Any  # the I/O arena, a uint8 tensor over the memory file the verifier mapped
    device: str
    dtypes: dict
    dtype_names: dict
    recv_into: Fn
    sendall: Fn
    unpack_header: Fn
    pack_header: Fn
    unpackb: Fn
    pack: Fn
    hmac: Fn
    bytearray_: type
    memoryview_: type
    bytes_: type
    str_: type
    exec_: Fn
    type_name: Fn
    len_: Fn
    range_: type
    type_: type
    tuple_: type
    list_: type
    dict_: type
    tensor_type: type
    base_exception: type
    exception: type
    append: Fn
    dict_get: Fn
    str_contains: Fn
    plain: Fn
    meta: Fn
    span: Fn  # kiln_fence.span: the memory a tensor's elements occupy, and whether densely
    dense: Fn  # kiln_fence.dense: a tuple of outputs with the strided ones materialised
    precomputed: Fn  # kiln_fence.precomputed: elements ATen computed before arming
    empty: Fn
    bytes_view: Fn
    copy: Fn
    poison: Fn
    arm_compute: Fn
    evidence_since: Fn
    perf: Fn
    sleep: Fn
    site_of: Fn
    exc_traceback: Fn
    cuda_fatal: tuple
    module_dict: Fn
    issubclass_: Fn
    module_class: type
    state_dict: Fn
    load_state_dict: Fn
    to_device: Fn
    manual_seed: Fn
    no_grad: Fn
    align: int
    settle_s: float
    sync: Fn
    stream_sync: Fn
    set_stream: Fn
    delay: Fn
    flush: Any  # cuda: the L2 flush buffer (None on cpu)
    comparison: list
    clock: Any  # kiln_native.CallClock: the flush, the per-call marks and the wait for an idle device
    profiler: Any  # sealed_profile.ProfilerParts: torch's kineto profiler as C functions (cpu feedback only)
    trace: Any  # device_trace.DeviceTrace on cuda (provenance and the cuda profile); None on cpu
    demangle: Fn  # torch._C._demangle: kernel names as torch's profiler spells them


def server(c: Captured):
    """The sandbox's half that runs once candidate code exists: `serve(code, module)`, the request
    loop. Called after sealing and before the candidate's first byte; only the closures it returns
    run later, and they call nothing but what was bound here."""
    state = {
        "models": [],
        "model": None,
        "cls": None,
        "snaps": [],
        "null_snaps": [],
        "sets": [],
        "previous_sets": None,
        "last": None,
        "held": [],
    }
    receive, reply = _channel(c)
    tensor_at, staged, delayed, lay_out = _arena_io(c)
    outputs_of = _outputs(c)
    shared_with = _aliasing(c)
    failure, patched = _failures(c)
    op_load = _op_load(c, state)
    handlers = {
        "build": _op_build(c, state, tensor_at),
        "call": _op_call(c, state, delayed, outputs_of, lay_out, shared_with),
        "stage": _op_stage(c, state, staged),
        "trip": _op_trip(c, state, outputs_of, shared_with),
        "fetch": _op_fetch(c, state, lay_out),
        "profile": make_op_profile(c, state),
    }
    perf, dict_get, base_exception = c.perf, c.dict_get, c.base_exception
    traced = _tracing(c)

    def serve(code, module):
        while True:
            req = receive()
            if req is None or req["op"] == "close":
                return 0
            op = req["op"]
            started = perf()
            try:
                body = op_load(code, module) if op == "load" else traced(handlers[op], req)
            except base_exception as exc:  # candidate code raised (SystemExit too), or a CUDA error surfaced
                body = failure(exc)
            body["handled_s"] = perf() - started
            body["patched"] = patched()
            reply(req["nonce"], body)
            if dict_get(body, "fatal"):
                return 4  # a CUDA error poisons this process: leave, the verifier starts a fresh one

    return serve


# ------------------------------------------------------------------------------ the trace


def _tracing(c: Captured):
    """traced(handler, req): the handler's reply, with the device's kernels, copies and memsets that
    ran while it did (names and counts: `kernels`; records the trace lost: `trace_lost`) when the
    verifier asked for a trace (`trace`, on cuda: provenance.py judges whose kernels they were). The
    trace is kiln_native's CUPTI activity trace (device_trace.py), bound before the seal like
    everything else here and switched on only for this request; what it records is the device's own
    account of what ran, each kernel's name demangled as torch's profiler spells it."""
    trace = c.trace
    dict_get, len_, append, sync, demangle = c.dict_get, c.len_, c.append, c.sync, c.demangle
    on_device = trace is not None
    start, stop = (trace.start, trace.stop) if on_device else (None, None)
    most, longest = 64, 1000  # distinct names a reply carries, and characters a name

    def traced(handler, req):
        if not on_device or not dict_get(req, "trace"):
            return handler(req)
        start()
        try:
            body = handler(req)
            sync()  # every kernel the request started has run (and is in the record)
        finally:
            records, lost = stop()
        found, index, spelt, more = [], {}, {}, 0
        for record in records:
            key = dict_get(spelt, record[1])
            if key is None:
                key = demangle(record[1])[:longest]
                spelt[record[1]] = key
            at = dict_get(index, key)
            if at is not None:
                found[at][1] = found[at][1] + 1
            elif len_(found) < most:
                index[key] = len_(found)
                append(found, [key, 1])
            else:
                more = more + 1
        if more:
            append(found, ["(more kernels)", more])
        body["kernels"] = found
        body["trace_lost"] = lost
        return body

    return traced


# ------------------------------------------------------------------------------ the channel


def _channel(c: Captured):
    """(receive, reply): requests read in bounded steps; replies signed, each carrying kiln_native's
    evidence log since the previous reply."""
    sock, key, recv_into, sendall = c.sock, c.key, c.recv_into, c.sendall
    unpack_header, pack_header, unpackb, pack, hmac = c.unpack_header, c.pack_header, c.unpackb, c.pack, c.hmac
    bytearray_, memoryview_, bytes_, len_, evidence_since = (
        c.bytearray_,
        c.memoryview_,
        c.bytes_,
        c.len_,
        c.evidence_since,
    )
    log = {"logged": 0}

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
        body["evidence"], log["logged"], _ = evidence_since(log["logged"])  # kiln_native log, since the last reply
        payload = pack(body)
        sendall(sock, pack_header(len_(payload)) + payload + hmac(key, payload, "sha256"))

    return receive, reply


# ------------------------------------------------------------------------- the I/O arena


def _arena_io(c: Captured):
    """(tensor_at, staged, delayed, lay_out): bytes between the arena and this process's tensors,
    moved by plumbing copies no Python code can intercept (kiln_fence)."""
    arena, device, dtypes, dtype_names, align = c.arena, c.device, c.dtypes, c.dtype_names, c.align
    bytes_view, empty, copy, meta, poison, delay, flush = (
        c.bytes_view,
        c.empty,
        c.copy,
        c.meta,
        c.poison,
        c.delay,
        c.flush,
    )
    type_, dict_, list_, tensor_type, append = c.type_, c.dict_, c.list_, c.tensor_type, c.append
    range_, len_, dict_get = c.range_, c.len_, c.dict_get

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

    return tensor_at, staged, delayed, lay_out


def _outputs(c: Captured):
    """outputs_of: forward's result read as data, with C accessors and no method of the candidate's."""
    type_, tensor_type, tuple_, list_, type_name = c.type_, c.tensor_type, c.tuple_, c.list_, c.type_name
    range_, len_, plain, issubclass_ = c.range_, c.len_, c.plain, c.issubclass_

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

    return outputs_of


def _aliasing(c: Captured):
    """shared_with(items, inputs): the index of the first output whose memory overlaps an input's,
    or -1. Such an output is no output of the candidate's own (a view of the input, or the input
    written in place): the verifier judges it."""
    span, type_, tensor_type, len_, range_ = c.span, c.type_, c.tensor_type, c.len_, c.range_

    def shared_with(items, inputs):
        for i in range_(len_(items)):
            lo, hi, _dense = span(items[i])
            if lo == hi:
                continue
            for x in inputs:
                if type_(x) is not tensor_type:
                    continue
                xlo, xhi, _ = span(x)
                if lo < xhi and xlo < hi:
                    return i
        return -1

    return shared_with


def _failures(c: Captured):
    """(failure, patched): what a raised exception becomes in a reply, and which of torch's comparison
    functions the candidate replaced (the verifier compares in its own process, so this only records
    the attempt)."""
    str_, type_name, type_, site_of, exc_traceback = c.str_, c.type_name, c.type_, c.site_of, c.exc_traceback
    cuda_fatal, str_contains, append = c.cuda_fatal, c.str_contains, c.append
    watched = [(space, name, get, get(space, name)) for space, name, get in c.comparison]

    def failure(exc):
        text = str_(exc)[:2000]
        return {
            "ok": True,
            "failure": f"{type_name(type_(exc))}: {text}",
            "where": site_of(exc_traceback(exc)),
            "raised": True,
            "fatal": any_fatal(text),
        }

    def patched():
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

    return failure, patched


# ------------------------------------------------------------------------------ the requests


def _op_load(c: Captured, state: dict):
    exec_, module_dict, dict_get, type_ = c.exec_, c.module_dict, c.dict_get, c.type_
    issubclass_, module_class = c.issubclass_, c.module_class

    def op_load(code, module):
        exec_(code, module_dict(module))
        cls = dict_get(module_dict(module), "ModelNew")
        if type_(cls) is not type_ or not issubclass_(cls, module_class):
            return {"ok": True, "failure": "ModelNew must be a torch.nn.Module subclass defined by the candidate"}
        state["cls"] = cls
        return {"ok": True}

    return op_load


def _op_build(c: Captured, state: dict, tensor_at):
    manual_seed, state_dict, load_state_dict, to_device = c.manual_seed, c.state_dict, c.load_state_dict, c.to_device
    len_, empty, dtypes, copy, exception, append = c.len_, c.empty, c.dtypes, c.copy, c.exception, c.append
    device, sync, arm_compute, precomputed = c.device, c.sync, c.arm_compute, c.precomputed

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
        return {"ok": True, "params": how, "precomputed": precomputed()}

    return op_build


def _op_call(c: Captured, state: dict, delayed, outputs_of, lay_out, shared_with):
    no_grad, set_stream, stream_sync, sync, perf, sleep = (
        c.no_grad,
        c.set_stream,
        c.stream_sync,
        c.sync,
        c.perf,
        c.sleep,
    )
    settle_s, device, type_, tensor_type = c.settle_s, c.device, c.type_, c.tensor_type

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
        return {
            "ok": True,
            "outputs": first,
            "after": second,
            "inputs_after": kept,
            "pending_s": pending,
            "aliased": shared_with(items, inputs),
        }

    return op_call


def _op_stage(c: Captured, state: dict, staged):
    sync, len_, append, empty, poison, dtypes, device = c.sync, c.len_, c.append, c.empty, c.poison, c.dtypes, c.device
    hold = c.device == "cpu"  # op_trip's docstring says why only there

    def op_stage(req):
        """The next trips' inputs onto the device, one set per call (outside any timed request), and a
        snapshot for each call's outputs (`expect`), the trip's and the null trip's, written once here:
        a trip that met fresh buffers would page them in (cpu) inside its own wall time. On cpu the
        last stage's inputs stay allocated until the stage after this one, as the outputs do until the
        next trip (op_trip): late work that reads them reads memory this process still owns."""
        if state["model"] is not state["models"][req["instance"]]:
            state["model"], state["snaps"], state["null_snaps"], state["last"], state["held"] = (
                state["models"][req["instance"]],
                [],
                [],
                None,
                [],
            )
        state["previous_sets"] = None  # freed first: no more than two stages' inputs at once
        fresh = [staged(items) for items in req["calls"]]
        state["previous_sets"], state["sets"] = state["sets"] if hold else None, fresh
        for snaps in (state["snaps"], state["null_snaps"]):
            while len_(snaps) < len_(fresh):
                buffers = [empty(e[1], dtypes[e[0]], device) for e in req["expect"]]
                for b in buffers:
                    poison(b)
                append(snaps, buffers)
        sync()
        return {"ok": True}

    return op_stage


def _op_trip(c: Captured, state: dict, outputs_of, shared_with):
    no_grad, len_, append, empty, dtypes, device = c.no_grad, c.len_, c.append, c.empty, c.dtypes, c.device
    range_, copy, set_stream, sync = c.range_, c.copy, c.set_stream, c.sync
    meta, dict_get, dtype_names, list_, dense = c.meta, c.dict_get, c.dtype_names, c.list_, c.dense
    clock = c.clock
    flush, mark, idle, spans, preroll = clock.flush, clock.mark, clock.idle, clock.spans, clock.preroll
    warm = _warmer(c, state)
    hold = c.device == "cpu"

    def op_trip(req):
        """The `count` staged calls from `first` on, each as KernelBench times one (timing.py): the
        flush, a mark, forward, a mark, wait until the device is idle; then its outputs copied to a
        snapshot. `null` does the same work without forward, on the last outputs. The reply carries
        the per-call figures. One stage holds the calls of several trips (timed back to back in one
        exclusive hold of the device: performance.py): every staged call has a snapshot of its own,
        kept until the next stage, for `fetch` to read.

        On cpu, each staged call's outputs stay allocated until the same call of the next stage
        replaces them (the trips of a stage run back to back, so a trip's are still held while the
        later trips run and until every call is checked): work the candidate left running (a worker
        thread, a timer) that finishes them late writes memory this process still owns, so the
        snapshot taken at return shows them unfinished (a finding, not a heap corrupted into a crash;
        a worker thread left behind by more than a trip corrupted it in CI when the next trip of a
        hold freed them). One output is freed per call, as in KernelBench's loop, so the allocator
        hands the next call a block it already touched (holding the whole trip and freeing it at once
        let malloc trim the heap: page faults in every call of the next trip).

        On cuda outputs are device memory, and a freed block stays in this process's caching allocator
        (nothing here empties it): late work writes memory the process owns without holding, not a heap
        in use. So nothing is held there, as
        in KernelBench's loop: holding made every trip's first call read 13-25 us slow on an H200
        (docs/BENCHMARKS.md, issue 34 session 21).

        An output that shares memory with its call's inputs ends the trip (the verifier judges it);
        one that is not dense (a strided view) is materialised before the call's closing mark, so its
        materialisation is the call's, and the null trip copies the dense result (its snapshot must
        not cancel work the output still needed)."""
        no_grad(False)
        null, expect, sets, held = req["null"], req["expect"], state["sets"], state["held"]
        first, count = req["first"], req["count"]
        # The null trip's snapshots have buffers of their own (one trip's): the run trips' are what
        # `fetch` reads, one per staged call.
        snaps = state["null_snaps"] if null else state["snaps"]
        while len_(snaps) < (count if null else first + count):
            append(snaps, [empty(e[1], dtypes[e[0]], device) for e in expect])
        model = state["model"]
        # The device and host as a call in KernelBench's loop finds them (timing.py).
        preroll(req["preroll"], req["head_start"])
        for k in range_(count):
            at = first + k
            flush()
            warm(sets[at])
            set_stream()
            mark(2 * k)
            result = state["last"] if null else model(*sets[at])
            set_stream()
            items, why, subclass = outputs_of(result)
            raw = items
            if items is not None:  # both trips: the null trip's outputs are dense, so it only looks
                items = dense(items)
            mark(2 * k + 1)
            idle()
            if items is None:
                sync()
                return {"ok": True, "failure": why, "subclass": subclass}
            aliased = -1 if null else shared_with(raw, sets[at])
            if aliased >= 0:
                sync()
                return {"ok": True, "failure": f"output {aliased} shares memory with an input", "aliased": aliased}
            if len_(items) != len_(expect):
                sync()
                return {"ok": True, "failure": f"forward returned {len_(items)} outputs, expected {len_(expect)}"}
            for i in range_(len_(items)):
                dtype, shape, _strides, where, _nbytes = meta(items[i])
                if dict_get(dtype_names, dtype) != expect[i][0] or list_(shape) != expect[i][1] or where != device:
                    sync()
                    return {"ok": True, "failure": f"output {i} changed its dtype, shape or device in a timed call"}
                copy(snaps[k if null else at][i], items[i])
            state["last"] = items
            if hold and not null:  # kept until this call of the next stage (the docstring says why on cpu only)
                while len_(held) <= at:
                    append(held, None)
                held[at] = raw
        sync()
        return {"ok": True, "calls_s": [] if null else spans(count)}

    return op_trip


def _warmer(c: Captured, state: dict):
    """warm(inputs): on cpu, read the call's inputs once (a copy into scratch buffers) right before it
    starts, so it finds them in cache as a call in KernelBench's loop does (its inputs were read by
    the call before). On cuda nothing: the flush makes every call start cold, on both sides."""
    device, type_, tensor_type, meta, empty, copy = c.device, c.type_, c.tensor_type, c.meta, c.empty, c.copy
    len_, range_, append = c.len_, c.range_, c.append
    scratch = {"bufs": []}

    def warm(inputs):
        if device != "cpu":
            return
        bufs = scratch["bufs"]
        for i in range_(len_(inputs)):
            x = inputs[i]
            if type_(x) is not tensor_type:
                continue
            while len_(bufs) <= i:
                append(bufs, None)
            dtype, shape, _strides, _where, _nbytes = meta(x)
            if bufs[i] is None or meta(bufs[i])[1] != shape or meta(bufs[i])[0] != dtype:
                bufs[i] = empty(shape, dtype, device)
            copy(bufs[i], x)
        return

    return warm


def _op_fetch(c: Captured, state: dict, lay_out):
    type_, tensor_type, append = c.type_, c.tensor_type, c.append

    def op_fetch(req):
        """The snapshots of the last trip's calls `calls`, each with its inputs as they are now (the
        verifier compares them with the inputs it staged: a write to an input shows)."""
        found = []
        for k, out, kept in req["calls"]:
            inputs = []
            for x in state["sets"][k]:
                if type_(x) is tensor_type:
                    append(inputs, x)
            append(found, [lay_out(state["snaps"][k], out), lay_out(inputs, kept)])
        return {"ok": True, "calls": found}

    return op_fetch
