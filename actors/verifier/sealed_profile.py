"""The sandbox's `profile` request: a slow pass's calls once more under a profiler, for the feedback
of a performance turn only (profile.py, on the verifier's side, turns the events into the costliest
kernels and says why none of it reaches the verdict). On cuda the profiler is the device trace
(device_trace.py), on cpu torch's profiler of host operators.

Two halves, like the rest of the sandbox: `profiler_parts` binds torch's kineto profiler as C
functions and methods of C types before the seal (sandbox._capture stores them in
`sealed.Captured.profiler`, beside the device trace), and `make_op_profile` builds the closure the sealed request loop
(sealed.server) dispatches to. That closure looks up no global, builtin or attribute, as every
closure of the loop (tests/verifier/test_boundary.py reads its bytecode too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from actors.verifier.sealed import Captured


@dataclass(frozen=True)
class ProfilerParts:
    """torch's kineto profiler as C functions and methods of C types, bound before sealing: what the
    sealed loop's `profile` request calls (`make_op_profile` below)."""

    prepare: Any
    enable: Any
    disable: Any
    events: Any  # _ProfilerResult.events
    name: Any  # _KinetoEvent.name
    device_type: Any  # _KinetoEvent.device_type
    start_ns: Any
    end_ns: Any
    thread: Any  # _KinetoEvent.start_thread_id
    host: Any  # DeviceType.CPU
    config: Any  # a ProfilerConfig made now, by torch's own profiler class (its arguments vary by release)
    activities: set


def profiler_parts() -> ProfilerParts:
    """The host's operators (the cpu profile; cuda's is the device trace, device_trace.py)."""
    from torch._C import _autograd as autograd
    from torch.autograd import profiler

    activity = profiler.ProfilerActivity.CPU
    config = profiler.profile().config()
    return ProfilerParts(
        prepare=autograd._prepare_profiler,
        enable=autograd._enable_profiler,
        disable=autograd._disable_profiler,
        events=autograd._ProfilerResult.events,
        name=autograd._KinetoEvent.name,
        device_type=autograd._KinetoEvent.device_type,
        start_ns=autograd._KinetoEvent.start_ns,
        end_ns=autograd._KinetoEvent.end_ns,
        thread=autograd._KinetoEvent.start_thread_id,
        host=autograd.DeviceType.CPU,
        config=config,
        activities={activity},
    )


def make_op_profile(c: Captured, state: dict):
    """op_profile: the last trip's staged calls once more under a profiler, for the feedback of a
    performance turn only: on cuda the device trace (device_trace.py: kernels, copies, memsets, with
    their device times and streams), on cpu torch's profiler (the host's operators). The verifier asks
    for it after every figure and check of the run, and nothing in the reply reaches the verdict
    (profile.py); the events are read as data there."""
    p, trace = c.profiler, c.trace
    prepare, enable, disable, events, config, activities = (
        p.prepare,
        p.enable,
        p.disable,
        p.events,
        p.config,
        p.activities,
    )
    name, device_type, start_ns, end_ns, thread, host = p.name, p.device_type, p.start_ns, p.end_ns, p.thread, p.host
    on_device = trace is not None
    trace_start, trace_stop = (trace.start, trace.stop) if on_device else (None, None)
    demangle, dict_get = c.demangle, c.dict_get
    no_grad, set_stream, sync, perf, len_, range_, append = (
        c.no_grad,
        c.set_stream,
        c.sync,
        c.perf,
        c.len_,
        c.range_,
        c.append,
    )

    def op_profile(req):
        no_grad(False)
        sets, model = state["sets"], state["model"]
        wanted, limit = req["calls"], req["events"]
        calls = 0
        kept = []  # each call's outputs, alive until the device is idle
        if on_device:
            trace_start()
        else:
            prepare(config, activities)
            enable(config, activities)
        try:
            started = perf()
            for k in range_(len_(sets)):
                if k >= wanted:
                    break
                calls = k + 1
                set_stream()
                append(kept, model(*sets[k]))
                set_stream()
            sync()
            wall = perf() - started
        finally:
            result = trace_stop() if on_device else disable()
        found = []
        if on_device:
            spelt = {}
            for r in result[0]:
                if len_(found) >= limit:
                    break
                key = dict_get(spelt, r[1])
                if key is None:
                    key = demangle(r[1])[:160]
                    spelt[r[1]] = key
                append(found, [key, r[2], r[3], r[4]])
        else:
            for e in events(result):
                if len_(found) >= limit:
                    break
                if device_type(e) == host:
                    append(found, [name(e)[:160], start_ns(e), end_ns(e), thread(e)])
        return {"ok": True, "events": found, "calls": calls, "wall_s": wall}

    return op_profile
