"""The baseline process: `python -m actors.verifier.baseline_worker NATIVE_LIBRARY DEVICE`.

Times references (eager and torch.compile) for one lane of a kernel verifier (baselines.py), in a
process that never loads candidate code and runs nothing else: one request at a time, a JSON line on
stdin, a JSON line on stdout. Requests carry the task's reference source and the shape overrides;
this process builds the reference itself (a fresh seed, its own inputs), measures it with
`baselines.measure_reference` under the same device lease as the verifier (a lock file per GPU,
shared by every process on the host), and answers with the TripTimes fields. It exits when stdin
closes.
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m actors.verifier.baseline_worker NATIVE_LIBRARY DEVICE", file=sys.stderr)
        return 2
    native_library, device = argv
    # Replies go to the real stdout; anything a reference prints goes to stderr.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    import torch

    from actors.verifier import native
    from actors.verifier.baselines import measure_reference, times_record
    from actors.verifier.reference import Reference, ReferenceError, ShapeConfig
    from protocols import KernelSpec, Task
    from protocols.lease import DeviceLease

    native.ensure_loaded(native_library)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        torch.backends.cuda.matmul.allow_tf32 = False  # as the verifier's references run: full fp32
        torch.backends.cudnn.allow_tf32 = False
    lease = DeviceLease(device)
    refs: dict[str, Reference] = {}
    for line in sys.stdin:
        try:
            req = json.loads(line)
            ref = refs.get(req["source"])
            if ref is None:
                spec = KernelSpec(
                    name=req["task_id"].split("/")[-1],
                    reference=req["source"],
                    backend="cuda" if device.startswith("cuda") else "cpu",
                    level=0,
                    source_path=req.get("source_path") or "",
                )
                ref = refs[req["source"]] = Reference(Task(task_id=req["task_id"], kind="kernel", kernel=spec), device)
            instance = ref.instance(ShapeConfig("primary", dict(req["overrides"]), 1))
            eager, compiled, note = measure_reference(
                ref, instance, int(req["pairs"]), int(req["warmup"]), bool(req["compile"]), device, lease
            )
            reply = {"eager": times_record(eager), "compile": times_record(compiled), "note": note}
        except (ReferenceError, RuntimeError, ValueError, KeyError, TypeError) as err:
            reply = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        instance = None
        if device.startswith("cuda"):
            # The inputs and outputs it timed go back to the device, not to this process's caching
            # allocator: the lane's memory count (devmem.py) does not see this process between runs.
            torch.cuda.empty_cache()
        out.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
