"""The seam between the verifier's reference logic and the reference's own code.

`reference.Reference` decides everything about a task's reference (shape configs, trials, input
families, degeneracy, the float64 allowance, sensitivity mixing, the canary, NaN checks, parking) in
the verifier's process. Whatever runs the reference's *own* code goes through a `ReferenceProgram`:

    declared                  the module's constants and KILN_* settings, as data (`Declared`)
    footprint(overrides)      bytes of one trial's inputs and outputs, from meta tensors (or None)
    build(overrides, seed)    Model(*get_init_inputs()) under a seed -> init args, state dict, a handle
    draw(overrides, seed)     get_inputs() under a seed, on the reference's device
    forward(handle, inputs)   the model (or its float64 copy, `wide`) on inputs, as a list of tensors

Two programs: `InProcessProgram` (here) runs the module in the calling process, as the verifier always
has for the operator's own task set; `jailed_reference.JailedProgram` runs it in a jailed process of
its own, for a reference a client sent (or every reference, with `verifier.sandbox_references`). A
handle is whatever the program needs to find the model again: the module itself here, an id there.
"""

from __future__ import annotations

import copy
import hashlib
import linecache
import threading
import types
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from actors.verifier.compare import declared_tolerance

# Global RNG state is process-wide: seeding and drawing happen under this lock.
RNG_LOCK = threading.RLock()


class ReferenceError(RuntimeError):
    """The reference itself failed (a broken task): the system's fault, reported as infra."""


class ReferenceDied(ReferenceError):
    """The process that ran a jailed reference crashed, hung, ran out of memory or replied garbage:
    the reference's failure (infra for its request), never the candidate's."""


class DeviceFull(ReferenceError):
    """The verifier's own work on the device (a reference draw or run, the baselines) ran out of
    device memory. Whose fault that is, is decided by evidence (gpumem.py, runner.py): a run whose
    sandbox held more than its share is the candidate's; otherwise the machine's (infra)."""


@dataclass(frozen=True)
class Declared:
    """What a reference module declares, as data (tasks/README.md): the defaults of its shape
    constants (those KILN_CPU_SHAPES and KILN_ALT_SHAPES name, and `batch_size`), the two shape
    settings (None where the module does not declare them) and KILN_TOLERANCE (atol, rtol)."""

    defaults: dict
    cpu_shapes: dict | None
    alt_shapes: list[dict] | None
    tolerance: tuple[float, float] | None

    @staticmethod
    def of(module: types.ModuleType) -> Declared:
        cpu = getattr(module, "KILN_CPU_SHAPES", None)
        alts = getattr(module, "KILN_ALT_SHAPES", None)
        names = set(cpu or {})
        for alt in alts or []:
            names |= set(alt)
        names.add("batch_size")
        defaults = {n: getattr(module, n) for n in sorted(names, key=str) if hasattr(module, n)}
        return Declared(
            defaults,
            dict(cpu) if cpu else None,
            [dict(a) for a in alts] if alts is not None else None,
            declared_tolerance(module),
        )


@dataclass
class Built:
    """A reference model built for one shape config: what ModelNew is built from, and its handle."""

    init_args: list
    state_dict: dict[str, torch.Tensor]  # parameters and buffers, on the host
    model: object  # the program's handle (an nn.Module in process)


class ReferenceProgram:
    """Where a reference's own code runs (the module docstring lists the operations)."""

    jailed = False  # whether its code runs confined, apart from the verifier's process
    declared: Declared

    @property
    def alive(self) -> bool:
        """False once its process is gone: the cache replaces it (jailed programs only)."""
        return True

    def footprint(self, overrides: dict) -> int | None:
        raise NotImplementedError

    def build(self, overrides: dict, seed: int) -> Built:
        raise NotImplementedError

    def draw(self, overrides: dict, seed: int) -> list:
        raise NotImplementedError

    def forward(
        self, model, inputs: list, *, overrides: dict | None = None, wide: bool = False, wait: bool = True
    ) -> list[torch.Tensor]:
        raise NotImplementedError

    def elements(self, model) -> int:
        """Elements of the model's parameters and buffers (what its float64 copy would hold)."""
        raise NotImplementedError

    def close(self) -> None:
        return None


class InProcessProgram(ReferenceProgram):
    """The reference module executed in this process, once."""

    def __init__(self, source: str, filename: str, task_id: str, device: str) -> None:
        self.task_id, self.device = task_id, device
        self.lock = threading.RLock()  # module constants are this module's state: one config at a time
        self.module = self._load(source, filename)
        for name in ("Model", "get_inputs", "get_init_inputs"):
            if not hasattr(self.module, name):
                raise ReferenceError(f"reference of {task_id} defines no {name}")
        try:
            self.declared = Declared.of(self.module)
        except (TypeError, ValueError) as err:
            raise ReferenceError(
                f"reference of {task_id} declares KILN_CPU_SHAPES, KILN_ALT_SHAPES or KILN_TOLERANCE in a form "
                f"Kiln cannot read ({type(err).__name__}: {err})"
            ) from None

    def _load(self, source: str, filename: str) -> types.ModuleType:
        module = types.ModuleType(f"kiln_reference_{hashlib.sha256(source.encode()).hexdigest()[:16]}")
        module.__file__ = filename
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        try:
            # by design: the task's reference module is run to produce expected outputs
            exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102
        except Exception as err:
            raise ReferenceError(f"reference of {self.task_id} failed to load: {type(err).__name__}: {err}") from err
        return module

    @contextmanager
    def shapes(self, overrides: dict | None):
        """Module-constant overrides for the duration of the block (under the module's lock); None
        leaves the constants at their defaults."""
        with self.lock:
            defaults = self.declared.defaults
            for k, v in defaults.items():
                setattr(self.module, k, v)
            for k, v in (overrides or {}).items():
                setattr(self.module, k, v)
            try:
                yield
            finally:
                for k, v in defaults.items():
                    setattr(self.module, k, v)

    def footprint(self, overrides: dict) -> int | None:
        try:
            with self.shapes(overrides), RNG_LOCK, torch.device("meta"), torch.no_grad():
                model = self.module.Model(*self.module.get_init_inputs())
                inputs = list(self.module.get_inputs())
                outputs = as_output_list(model(*inputs), "the reference")
        except Exception:  # noqa: BLE001 - a reference meta tensors cannot run: size unknown until drawn
            return None
        return held_bytes(inputs, outputs)

    def build(self, overrides: dict, seed: int) -> Built:
        with self.shapes(overrides):
            init_args = list(self.module.get_init_inputs())
            with RNG_LOCK, torch.random.fork_rng(devices=self._rng_devices()):
                torch.manual_seed(seed)
                model = self.module.Model(*init_args)
        model = model.to(self.device)
        state = {k: v.detach().to("cpu").clone() for k, v in model.state_dict().items()}
        return Built(init_args, state, model)

    def draw(self, overrides: dict, seed: int) -> list:
        """`get_inputs()` under `seed`, drawn where the reference runs: on cuda the task's factory
        calls (torch.randn and the like) make their tensors on the device, so inputs of gigabytes cost
        milliseconds rather than the host's seconds. A task whose get_inputs cannot run there (it
        mixes devices) is drawn on the host and moved."""
        with self.shapes(overrides), RNG_LOCK, torch.random.fork_rng(devices=self._rng_devices()):
            torch.manual_seed(seed)
            if self.device.startswith("cuda"):
                try:
                    with torch.device(self.device):
                        inputs = list(self.module.get_inputs())
                    return [x.detach().to(self.device) if isinstance(x, torch.Tensor) else x for x in inputs]
                except torch.OutOfMemoryError as err:  # not a task that mixes devices: no host detour
                    raise DeviceFull(
                        f"the inputs of {self.task_id} do not fit in device memory "
                        f"({str(err).splitlines()[0][:160]}): the verifier's device is too small or too busy"
                    ) from None
                except (RuntimeError, TypeError, ValueError):
                    torch.manual_seed(seed)
            inputs = list(self.module.get_inputs())
        return [x.detach().to(self.device) if isinstance(x, torch.Tensor) else x for x in inputs]

    def forward(
        self, model, inputs: list, *, overrides: dict | None = None, wide: bool = False, wait: bool = True
    ) -> list[torch.Tensor]:
        on_device = [x.to(self.device) if isinstance(x, torch.Tensor) else x for x in inputs]
        try:
            with self.shapes(overrides) if overrides is not None else nullcontext(), torch.no_grad():
                out = (copy.deepcopy(model).double() if wide else model)(*on_device)
        except torch.OutOfMemoryError as err:
            raise DeviceFull(
                f"the reference of {self.task_id} ran out of device memory at these sizes "
                f"({str(err).splitlines()[0][:160]}): the verifier's device is too small or too busy for this task"
            ) from None
        if wait and self.device.startswith("cuda"):
            torch.cuda.synchronize()
        return as_output_list(out, "the reference")

    def elements(self, model) -> int:
        return sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())

    def _rng_devices(self) -> list[int]:
        return [torch.cuda.current_device()] if self.device.startswith("cuda") else []


def held_bytes(inputs: list, outputs: list[torch.Tensor]) -> int:
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)] + list(outputs)
    return sum(x.numel() * x.element_size() for x in tensors)


def as_output_list(out, who: str) -> list[torch.Tensor]:
    """Normalise a forward() result to a list of tensors; anything else is an error naming `who`."""
    items = list(out) if isinstance(out, (tuple, list)) else [out]
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{who} returned {type(t).__name__} as output {i}, not a tensor")
    return items
