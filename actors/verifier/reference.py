"""The trusted side of a kernel task: its reference module, shapes, inputs and expected outputs.

References run only in the verifier's own (trusted) process, never in the process that imports a
candidate. Inputs come from the reference's `get_inputs()` under a fresh seed from `secrets`, so a
candidate can neither predict nor replay them.

Shapes follow KernelBench plus two module-level extensions (tasks/README.md):
* `KILN_CPU_SHAPES = {"batch_size": 16, ...}` replaces module constants on the cpu backend;
* `KILN_ALT_SHAPES = [{...}, ...]` lists other valid shapes, layered on top of the primary shape.
A plain KernelBench file has neither; it gets one derived alternative (a different `batch_size`)
when it has an integer `batch_size`, and keeps it only if the reference runs at that shape.
An optional `KILN_TOLERANCE` (a number, or {"atol": ..., "rtol": ...}) overrides the dtype defaults.
"""

from __future__ import annotations

import hashlib
import linecache
import secrets
import threading
import types
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from actors.verifier.compare import declared_tolerance
from protocols import Task

# Global RNG state is process-wide: seeding and drawing happen under this lock.
_RNG_LOCK = threading.RLock()
# A trial that waits (it is drawn while planning, before the sandbox is ready) and is larger than this
# waits on the host once its expected outputs exist. A trial drawn just before it is used never waits.
KEEP_ON_DEVICE_BYTES = 256 << 20


class ReferenceError(RuntimeError):
    """The reference itself failed (a broken task): the system's fault, reported as infra."""


class DeviceFull(ReferenceError):
    """The verifier's own work on the device (a reference draw or run, the baselines) ran out of
    device memory. Whose fault that is, is decided by evidence (gpumem.py, runner.py): a run whose
    sandbox held more than its share is the candidate's; otherwise the machine's (infra)."""


class BrokenTask(ReferenceError):
    """The reference produced NaN from finite inputs: the task cannot say what a kernel should output,
    so no kernel is judged on it (infra for the task, counted by the verifier)."""


@dataclass(frozen=True)
class ShapeConfig:
    label: str  # "primary", "alt0", ... as shown in feedback
    overrides: dict  # module constants set before get_inputs()/get_init_inputs()
    trials: int

    def describe(self) -> str:
        if not self.overrides:
            return "the task's default shapes"
        return ", ".join(f"{k}={v}" for k, v in self.overrides.items())


@dataclass
class Trial:
    """One correctness trial prepared by the trusted side."""

    config: ShapeConfig
    index: int  # across all trials of the job
    inputs: list  # tensors (on the reference's device, or the host when large and waiting) / scalars, as sent
    expected: list[torch.Tensor]  # reference outputs (on the reference device, or the host when large and waiting)

    def shapes_only(self) -> Trial:
        """The same trial with its tensors' data dropped (meta tensors: shapes and dtypes only), for
        whoever needs its sizes after its data is no longer needed."""

        def meta(x):
            return torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x

        return Trial(self.config, self.index, [meta(x) for x in self.inputs], [meta(e) for e in self.expected])


@dataclass
class Instance:
    """What the candidate's ModelNew is built from for one shape config."""

    config: ShapeConfig
    init_args: list
    init_seed: int
    state_dict: dict[str, torch.Tensor]  # the reference Model's parameters and buffers (CPU)
    model: torch.nn.Module = field(repr=False)


class Reference:
    """A task's reference module, loaded from its source once per verifier process."""

    def __init__(self, task: Task, device: str):
        spec = task.kernel
        self.task_id = task.task_id
        self.device = device
        self.source = spec.reference
        self.hash = hashlib.sha256(spec.reference.encode()).hexdigest()
        self.source_path = spec.source_path
        self.lock = threading.RLock()
        self.module = self._load(spec.reference, spec.source_path or f"<reference {task.task_id}>")
        for name in ("Model", "get_inputs", "get_init_inputs"):
            if not hasattr(self.module, name):
                raise ReferenceError(f"reference of {task.task_id} defines no {name}")
        self.defaults = {k: getattr(self.module, k) for k in self._constant_names()}
        self._footprints: dict[tuple, int | None] = {}  # by shape overrides: see footprint()

    def _load(self, source: str, filename: str) -> types.ModuleType:
        module = types.ModuleType(f"kiln_reference_{self.hash[:16]}")
        module.__file__ = filename
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        try:
            # by design: the task's reference module is run to produce expected outputs
            exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102
        except Exception as err:
            raise ReferenceError(f"reference of {self.task_id} failed to load: {type(err).__name__}: {err}") from err
        return module

    def _constant_names(self) -> set[str]:
        names = set(getattr(self.module, "KILN_CPU_SHAPES", {}) or {})
        for alt in getattr(self.module, "KILN_ALT_SHAPES", []) or []:
            names |= set(alt)
        names.add("batch_size")
        return {n for n in names if hasattr(self.module, n)}

    # ---------------------------------------------------------------------------------- shapes

    def primary_overrides(self, backend: str) -> dict:
        return dict(getattr(self.module, "KILN_CPU_SHAPES", {}) or {}) if backend == "cpu" else {}

    def alt_overrides(self, backend: str) -> list[dict]:
        primary = self.primary_overrides(backend)
        alts = getattr(self.module, "KILN_ALT_SHAPES", None)
        if alts is not None:  # declared, possibly empty ("no other shape is valid")
            return [{**primary, **alt} for alt in alts]
        batch = primary.get("batch_size", self.defaults.get("batch_size"))
        if isinstance(batch, int) and not isinstance(batch, bool) and batch >= 2:
            return [{**primary, "batch_size": batch // 2 + 1 if batch // 2 + 1 != batch else batch + 1}]
        return []

    def shape_configs(self, backend: str, trials: int) -> list[ShapeConfig]:
        """Primary shape first (at least two trials when trials >= 3, so one ModelNew instance sees
        several fresh inputs), then one trial per alternative shape while trials last."""
        alts = self.alt_overrides(backend)
        n_alts = min(len(alts), trials // 2)
        configs = [ShapeConfig("primary", self.primary_overrides(backend), trials - n_alts)]
        configs += [ShapeConfig(f"alt{i}", alts[i], 1) for i in range(n_alts)]
        return configs

    @contextmanager
    def shapes(self, overrides: dict):
        """Apply module-constant overrides for the duration of the block (under the task lock)."""
        with self.lock:
            for k, v in self.defaults.items():
                setattr(self.module, k, v)
            for k, v in overrides.items():
                setattr(self.module, k, v)
            try:
                yield
            finally:
                for k, v in self.defaults.items():
                    setattr(self.module, k, v)

    # -------------------------------------------------------------------------------- tolerance

    def tolerance(self) -> tuple[float, float] | None:
        """(atol, rtol) declared by the task with KILN_TOLERANCE, or None."""
        return declared_tolerance(self.module)

    # ---------------------------------------------------------------------------- trusted runs

    def footprint(self, config: ShapeConfig) -> int | None:
        """Bytes of one trial's inputs and reference outputs at `config`'s shapes, known before any
        is drawn: the first real draw's, or else `get_inputs()` and forward run on meta tensors
        (shapes and dtypes only, nothing allocated). None when neither can say (a forward that meta
        tensors cannot run); the caller then assumes the worst."""
        key = tuple(sorted(config.overrides.items()))
        if key not in self._footprints:
            self._footprints[key] = self._meta_footprint(config)
        return self._footprints[key]

    def _meta_footprint(self, config: ShapeConfig) -> int | None:
        try:
            with self.shapes(config.overrides), _RNG_LOCK, torch.device("meta"), torch.no_grad():
                model = self.module.Model(*self.module.get_init_inputs())
                inputs = list(self.module.get_inputs())
                outputs = as_output_list(model(*inputs), "the reference")
        except Exception:  # noqa: BLE001 - a reference meta tensors cannot run: size unknown until drawn
            return None
        return _held_bytes(inputs, outputs)

    def instance(self, config: ShapeConfig) -> Instance:
        """Build the reference Model for a shape config under a fresh seed."""
        seed = secrets.randbits(62)
        with self.shapes(config.overrides):
            init_args = list(self.module.get_init_inputs())
            with _RNG_LOCK, torch.random.fork_rng(devices=self._rng_devices()):
                torch.manual_seed(seed)
                model = self.module.Model(*init_args)
        model = model.to(self.device)
        state = {k: v.detach().to("cpu").clone() for k, v in model.state_dict().items()}
        return Instance(config, init_args, seed, state, model)

    def trial(self, instance: Instance, index: int, scale: float = 1.0, *, waits: bool = True) -> Trial | None:
        """Fresh inputs for one trial and the reference's outputs on them. `scale` multiplies the
        floating-point inputs (a power of two keeps them exact); a scaled trial the reference cannot
        take (its outputs stop being finite) is None. `waits`: the trial is held while others are
        drawn (a large one is parked on the host); one drawn just before it is used stays where it
        was made (no copy to the host and back: at KernelBench's sizes that is gigabytes a trial)."""
        with self.shapes(instance.config.overrides):
            inputs = self._draw()
            if scale != 1.0:
                inputs = [x * scale if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs]
            expected = self.run(instance.model, inputs)
        if scale != 1.0 and not all(_all(torch.isfinite, e) for e in expected if e.is_floating_point()):
            return None
        self.check_outputs(inputs, expected)
        self._footprints[tuple(sorted(instance.config.overrides.items()))] = _held_bytes(inputs, expected)
        return Trial(instance.config, index, *(self._parked(inputs, expected) if waits else (inputs, expected)))

    def _parked(self, inputs: list, expected: list[torch.Tensor]) -> tuple[list, list[torch.Tensor]]:
        """A trial's tensors where it waits: a run holds several trials at once, so gigabyte inputs
        and outputs wait on the host, not in device memory that the sandbox, the baseline process and
        other runs need; and the blocks they leave go back to the device, not to this process's
        caching allocator, where the sandbox (another process) could not have them."""
        if _held_bytes(inputs, expected) <= KEEP_ON_DEVICE_BYTES:
            return inputs, expected
        inputs = [x.to("cpu") if isinstance(x, torch.Tensor) else x for x in inputs]
        expected = [e.to("cpu") for e in expected]
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
        return inputs, expected

    def check_outputs(self, inputs: list, expected: list[torch.Tensor]) -> None:
        """NaN from finite inputs: the task is broken (BrokenTask), not any kernel judged on it."""
        finite_inputs = all(
            _all(torch.isfinite, x) for x in inputs if isinstance(x, torch.Tensor) and x.is_floating_point()
        )
        if finite_inputs and any(not _all(lambda t: ~torch.isnan(t), e) for e in expected if e.is_floating_point()):
            raise BrokenTask(
                f"the reference of {self.task_id} produces NaN from finite inputs: the task is broken "
                "(no kernel is judged on it)"
            )

    def fresh_inputs(self, instance: Instance) -> list:
        """A fresh draw of `get_inputs()` at the instance's shapes, never used before."""
        with self.shapes(instance.config.overrides):
            return self._draw()

    def _draw(self) -> list:
        """`get_inputs()` under a fresh seed, drawn where the reference runs: on cuda the task's
        factory calls (torch.randn and the like) make their tensors on the device, so inputs of
        gigabytes cost milliseconds rather than the host's seconds. A task whose get_inputs cannot
        run there (it mixes devices) is drawn on the host and moved."""
        seed = secrets.randbits(62)
        with _RNG_LOCK, torch.random.fork_rng(devices=self._rng_devices()):
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

    def mosaic(self, trial: Trial, instance: Instance, changed: int = 3) -> Trial:
        """A canary: `trial`'s inputs with `changed` random elements of each tensor taken from a fresh
        draw. A candidate that recognises inputs by a few elements (a fingerprint) and replays the
        output it computed for `trial` returns exactly that output, which is now wrong."""
        fresh = self.fresh_inputs(instance)
        inputs = []
        for a, b in zip(trial.inputs, fresh, strict=True):
            if (
                isinstance(a, torch.Tensor)
                and isinstance(b, torch.Tensor)
                and a.shape == b.shape
                and a.dtype == b.dtype
                and a.numel()
            ):
                c = a.clone()
                flat, src = c.view(-1), b.reshape(-1)
                for _ in range(changed):
                    k = secrets.randbelow(flat.numel())
                    flat[k] = src[k]
                inputs.append(c)
            else:
                inputs.append(a)
        fresh = b = None  # only a few of its elements were needed: not held while the reference runs
        with self.shapes(instance.config.overrides):
            expected = self.run(instance.model, inputs)
        self.check_outputs(inputs, expected)
        return Trial(instance.config, -1, inputs, expected)  # used at once: it never waits

    def run(self, model: torch.nn.Module, inputs: list) -> list[torch.Tensor]:
        """The reference's outputs as a list of tensors on the reference device."""
        on_device = self.to_device(inputs)
        try:
            with torch.no_grad():
                out = model(*on_device)
        except torch.OutOfMemoryError as err:
            raise DeviceFull(
                f"the reference of {self.task_id} ran out of device memory at these sizes "
                f"({str(err).splitlines()[0][:160]}): the verifier's device is too small or too busy for this task"
            ) from None
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        return as_output_list(out, "the reference")

    def to_device(self, inputs: list) -> list:
        return [x.to(self.device) if isinstance(x, torch.Tensor) else x for x in inputs]

    def _rng_devices(self) -> list[int]:
        return [torch.cuda.current_device()] if self.device.startswith("cuda") else []


def _all(test, x: torch.Tensor, chunk: int = 1 << 28) -> bool:
    """`test(x).all()`, slice by slice: a mask of a 4 GiB tensor is itself a GiB of device memory."""
    flat = x.detach().reshape(-1)
    return all(bool(test(flat[a : a + chunk]).all()) for a in range(0, flat.numel(), chunk))


def _held_bytes(inputs: list, outputs: list[torch.Tensor]) -> int:
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)] + list(outputs)
    return sum(x.numel() * x.element_size() for x in tensors)


def as_output_list(out, who: str) -> list[torch.Tensor]:
    """Normalise a forward() result to a list of tensors; anything else is an error naming `who`."""
    items = list(out) if isinstance(out, (tuple, list)) else [out]
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{who} returned {type(t).__name__} as output {i}, not a tensor")
    return items


class ReferenceCache:
    """Loaded references by (task id, reference hash); a task's module is executed once."""

    def __init__(self, device: str):
        self.device = device
        self._refs: dict[tuple[str, str], Reference] = {}
        self._lock = threading.Lock()

    def get(self, task: Task) -> Reference:
        key = (task.task_id, hashlib.sha256(task.kernel.reference.encode()).hexdigest())
        with self._lock:
            ref = self._refs.get(key)
            if ref is None:
                ref = self._refs[key] = Reference(task, self.device)
            return ref
