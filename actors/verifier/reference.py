"""The trusted side of a kernel task: its reference module, shapes, inputs and expected outputs.

References run only in the verifier's own (trusted) process, never in the process that imports a
candidate. Inputs come from the reference's `get_inputs()` under a fresh seed from `secrets`, so a
candidate can neither predict nor replay them; a trial of an input family (families.py) transforms
such a draw under parameters drawn from `secrets` too, and the sensitivity trial mixes one into an
earlier trial's inputs until the reference's output moves.

Shapes follow KernelBench plus two module-level extensions (tasks/README.md):
* `KILN_CPU_SHAPES = {"batch_size": 16, ...}` replaces module constants on the cpu backend;
* `KILN_ALT_SHAPES = [{...}, ...]` lists other valid shapes, layered on top of the primary shape.
A plain KernelBench file has neither; it gets one derived alternative (a different `batch_size`)
when it has an integer `batch_size`, and keeps it only if the reference runs at that shape.
An optional `KILN_TOLERANCE` (a number, or {"atol": ..., "rtol": ...}) overrides the dtype defaults.
"""

from __future__ import annotations

import copy
import hashlib
import linecache
import secrets
import threading
import types
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from actors.verifier import families
from actors.verifier.compare import (
    ALLOWANCE_FACTOR,
    ALLOWANCE_LIMIT,
    allowances,
    declared_tolerance,
    degeneracy,
    move_ratio,
    scale_of,
)
from actors.verifier.families import NORMAL, SENSITIVITY, Drawn
from protocols import Task

# Global RNG state is process-wide: seeding and drawing happen under this lock.
_RNG_LOCK = threading.RLock()
# A trial that waits (it is drawn while planning, before the sandbox is ready) and is larger than this
# waits on the host once its expected outputs exist. A trial drawn just before it is used never waits.
KEEP_ON_DEVICE_BYTES = 256 << 20
# The float64 run that measures the reference's own float32 error (an offset trial's tolerance
# allowance) is taken up to this many bytes of float64 inputs, outputs and parameters: above it, on
# the device beside the run's other trials, it could take memory the run did not reserve (devmem.py).
FLOAT64_MAX_BYTES = 2 << 30
# Family parameters are drawn from the operating system's randomness, fresh for every trial.
_FAMILY_RNG = secrets.SystemRandom()


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
    drawn: Drawn = field(default_factory=lambda: Drawn(NORMAL))  # its input family and parameters
    allowance: list[float] | None = None  # per output, added to the tolerance bound (compare.allowances)
    base: int | None = None  # a sensitivity trial: the index of the trial whose inputs it perturbs
    notes: list[str] = field(default_factory=list)  # what drawing it took (parameters retried)
    degenerate: str = ""  # why its reference output tests little (compare.degeneracy), "" when it does not

    def shapes_only(self) -> Trial:
        """The same trial with its tensors' data dropped (meta tensors: shapes and dtypes only), for
        whoever needs its sizes after its data is no longer needed."""

        def meta(x):
            return torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x

        return Trial(
            self.config, self.index, [meta(x) for x in self.inputs], [meta(e) for e in self.expected], self.drawn
        )


@dataclass(frozen=True)
class Skipped:
    """A family trial the reference cannot pose (its outputs are not finite there, or it does not
    move): reported, never scored."""

    drawn: Drawn
    why: str
    notes: tuple[str, ...] = ()


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

    def trial(
        self,
        instance: Instance,
        index: int,
        family: str = NORMAL,
        *,
        waits: bool = True,
        infinite_ok: bool = False,
        tolerance: tuple[float, float] | None = None,
    ) -> Trial | Skipped:
        """Fresh inputs for one trial, of `family` (families.py), and the reference's outputs on them.
        A family trial the reference cannot take (its outputs stop being finite from finite inputs;
        infinities are fine where `infinite_ok`: the task's own draws give them) is retried as the
        family says (the other sign of an offset, a smaller scale) and else Skipped; one whose output
        is degenerate under `tolerance` (the task's override) is retried once. `waits`: the trial is
        held while others are drawn (a large one is parked on the host); one drawn just before it is
        used stays where it was made (no copy to the host and back: at KernelBench's sizes that is
        gigabytes a trial)."""
        with self.shapes(instance.config.overrides):
            base = self._draw()
            if family == NORMAL:
                made = Trial(instance.config, index, base, self.run(instance.model, base))
                made.degenerate = degeneracy(made.expected, tolerance, self.device)
            else:
                made = self._family_trial(instance, index, family, base, infinite_ok, tolerance)
                if isinstance(made, Skipped):
                    return made
        self.check_outputs(made.inputs, made.expected)
        if family == NORMAL:
            self._footprints[tuple(sorted(instance.config.overrides.items()))] = _held_bytes(made.inputs, made.expected)
        if waits:
            made.inputs, made.expected = self._parked(made.inputs, made.expected)
        return made

    def _family_trial(
        self, instance: Instance, index: int, family: str, base: list, infinite_ok: bool, tolerance
    ) -> Trial | Skipped:
        """`base` (a fresh draw) under `family`'s parameters (`_posed`), with the tolerance allowance
        where the family asks for one (`_allowed`)."""
        drawn = families.draw(family, base, _FAMILY_RNG)
        if not families.floating(base):
            return Skipped(drawn, "the task has no floating-point inputs")
        posed = self._posed(instance, drawn, base, infinite_ok, tolerance)
        if isinstance(posed, Skipped):
            return posed
        drawn, inputs, expected, weak, notes = posed
        trial = Trial(instance.config, index, inputs, expected, drawn, notes=notes, degenerate=weak)
        return self._allowed(instance, trial) if families.FAMILIES[family].float64 else trial

    def _posed(self, instance: Instance, drawn: Drawn, base: list, infinite_ok: bool, tolerance):
        """The reference on `base` under `drawn`, retried with the family's next parameters while its
        outputs are not finite, and once where they are degenerate (a ReLU of inputs offset below
        zero: the other sign tests something; a retry that does no better keeps the first).
        (drawn, inputs, expected, degenerate, notes), or Skipped when the retries run out."""
        notes: list[str] = []
        kept, last, why = None, drawn, ""
        while drawn is not None:
            last, inputs, expected = drawn, families.apply(drawn, base), None
            why = "" if all_finite(inputs) else "its inputs are not finite"
            if not why:
                expected = self.run(instance.model, inputs)
                why = _not_finite(expected, infinite_ok)
            weak = "" if why else degeneracy(expected, tolerance, self.device)
            if not why and not weak:
                return drawn, inputs, expected, "", notes
            notes.append(f"{drawn.describe()}: {why or 'degenerate: ' + weak}")
            if kept is not None:
                break
            if weak:
                kept = (drawn, inputs, expected, weak)
            drawn = families.retry(drawn)
        if kept is None:
            return Skipped(last, f"the reference's outputs are not finite there ({why})", tuple(notes))
        return (*kept, notes)

    def _allowed(self, instance: Instance, trial: Trial) -> Trial | Skipped:
        """`trial` with its tolerance allowance (`float64_allowance`); Skipped where the reference's
        own float32 error is more than ALLOWANCE_LIMIT of its output's scale (it computes nothing
        reliable there, and a bound that wide would test nothing)."""
        measured = self.float64_allowance(instance, trial.inputs, trial.expected)
        if isinstance(measured, str):
            trial.notes.append(measured)
            return trial
        for e, allow in zip(trial.expected, measured, strict=True):
            share = allow / ALLOWANCE_FACTOR / max(scale_of(e), 1e-300) if e.is_floating_point() else 0.0
            if share > ALLOWANCE_LIMIT:
                return Skipped(
                    trial.drawn,
                    f"the reference's own float32 error there is {share:.0%} of its output's scale "
                    "(against a float64 run of it): it computes nothing reliable there",
                    tuple(trial.notes),
                )
        trial.allowance = measured
        return trial

    def float64_allowance(self, instance: Instance, inputs: list, expected: list[torch.Tensor]) -> list[float] | str:
        """The tolerance allowance at these inputs (compare.allowances: twice the reference's distance
        from a float64 run of itself), or why it was not measured (then none is given)."""
        params = sum(p.numel() for p in instance.model.parameters()) + sum(b.numel() for b in instance.model.buffers())
        elements = params + sum(x.numel() for x in inputs if isinstance(x, torch.Tensor))
        elements += sum(e.numel() for e in expected)
        if 8 * elements > FLOAT64_MAX_BYTES:
            return f"no float64 check of the reference (it would take {8 * elements >> 20} MB): plain tolerance"
        try:
            model = copy.deepcopy(instance.model).double()
            wide = [x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs]
            exact = self.run(model, wide)
        except Exception as err:  # noqa: BLE001 - a reference that mixes dtypes inside: no allowance
            return f"the reference does not run in float64 ({type(err).__name__}): plain tolerance"
        if len(exact) != len(expected) or any(x.shape != e.shape for x, e in zip(exact, expected, strict=False)):
            return "the reference's float64 run gives other outputs: plain tolerance"
        return allowances(expected, exact, self.device)

    def sensitivity_trial(
        self,
        instance: Instance,
        base: Trial,
        index: int,
        tolerance: tuple[float, float] | None,
        *,
        infinite_ok: bool = False,
    ) -> Trial | Skipped:
        """`base`'s inputs with a share t of a fresh draw mixed in (families.mix), t grown from
        FIRST_MIX until the reference's output moves at least MOVE tolerance bounds from base's; a
        reference that no mix (a whole fresh draw included) moves that far is insensitive there."""
        with self.shapes(instance.config.overrides):
            fresh = self._draw()
            if [_size(x) for x in fresh] != [_size(x) for x in base.inputs]:
                raise ReferenceError(
                    f"the reference's get_inputs() drew inputs of other sizes at {instance.config.describe()} "
                    "than its first draw: a task's sizes must not change between draws"
                )
            before = [e.to(self.device) for e in base.expected]
            start = self.to_device(base.inputs)
            t, attempts, moved = families.FIRST_MIX, 0, 0.0
            while True:
                attempts += 1
                inputs = families.mix(start, fresh, t)
                expected = self.run(instance.model, inputs)
                if _not_finite(expected, infinite_ok):
                    return Skipped(Drawn(SENSITIVITY, {"mix": t}), "the reference's outputs are not finite there")
                moved = move_ratio(before, expected, tolerance, self.device)
                following = families.next_mix(t, moved)
                if following is None:
                    break
                t = following if attempts < families.MIX_ATTEMPTS - 1 else 1.0
        drawn = Drawn(SENSITIVITY, {"mix": t, "moved": round(moved, 1) if moved != float("inf") else "exact"})
        if moved < families.MOVE:
            return Skipped(
                drawn,
                f"insensitive: no perturbation of its inputs moved the reference's output {families.MOVE:g} "
                f"tolerance bounds (at most {moved:.2g})",
            )
        weak = degeneracy(expected, tolerance, self.device)
        return Trial(instance.config, index, inputs, expected, drawn, base=base.index, degenerate=weak)

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

    def run(self, model: torch.nn.Module, inputs: list, *, wait: bool = True) -> list[torch.Tensor]:
        """The reference's outputs as a list of tensors on the reference device; `wait=False` leaves
        them queued on the device's stream (the caller reads them in stream order, or waits itself)."""
        on_device = self.to_device(inputs)
        try:
            with torch.no_grad():
                out = model(*on_device)
        except torch.OutOfMemoryError as err:
            raise DeviceFull(
                f"the reference of {self.task_id} ran out of device memory at these sizes "
                f"({str(err).splitlines()[0][:160]}): the verifier's device is too small or too busy for this task"
            ) from None
        if wait and self.device.startswith("cuda"):
            torch.cuda.synchronize()
        return as_output_list(out, "the reference")

    def to_device(self, inputs: list) -> list:
        return [x.to(self.device) if isinstance(x, torch.Tensor) else x for x in inputs]

    def _rng_devices(self) -> list[int]:
        return [torch.cuda.current_device()] if self.device.startswith("cuda") else []


def _size(x) -> tuple | None:
    return (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else None


def all_finite(tensors: list) -> bool:
    """Whether every floating-point tensor among `tensors` holds only finite values (slice by slice)."""
    return all(_all(torch.isfinite, x) for x in tensors if isinstance(x, torch.Tensor) and x.is_floating_point())


def _not_finite(expected: list[torch.Tensor], infinite_ok: bool) -> str:
    """Why these reference outputs cannot be judged ("" when they can): NaN, or infinities where the
    task's own draws give none."""
    if all_finite(expected):  # the common case: one pass
        return ""
    if any(not _all(lambda t: ~torch.isnan(t), e) for e in expected if e.is_floating_point()):
        return "NaN"
    return "" if infinite_ok else "infinities"


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
