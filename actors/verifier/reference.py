"""The trusted side of a kernel task: its reference module, shapes, inputs and expected outputs.

Every decision about a reference is made here, in the verifier's own process; the reference's own
code (its module, `get_inputs`, `get_init_inputs`, `Model`, `forward`) runs behind a program
(reference_program.py): in this process for the operator's own task set, in a jailed process of its
own for a reference a client sent (jailed_reference.py). Either way it never runs in the process that
imports a candidate. Inputs come from the reference's `get_inputs()` under a fresh seed from
`secrets`, so a candidate can neither predict nor replay them; a trial of an input family
(families.py) transforms such a draw under parameters drawn from `secrets` too, and the sensitivity
trial mixes one into an earlier trial's inputs until the reference's output moves.

Shapes follow KernelBench plus two module-level extensions (tasks/README.md):
* `KILN_CPU_SHAPES = {"batch_size": 16, ...}` replaces module constants on the cpu backend;
* `KILN_ALT_SHAPES = [{...}, ...]` lists other valid shapes, layered on top of the primary shape.
A plain KernelBench file has neither; it gets one derived alternative (a different `batch_size`)
when it has an integer `batch_size`, and keeps it only if the reference runs at that shape.
An optional `KILN_TOLERANCE` (a number, or {"atol": ..., "rtol": ...}) overrides the dtype defaults.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from actors.verifier import families
from actors.verifier.compare import (
    ALLOWANCE_FACTOR,
    ALLOWANCE_LIMIT,
    allowances,
    degeneracy,
    move_ratio,
    scale_of,
)
from actors.verifier.families import NORMAL, SENSITIVITY, Drawn
from actors.verifier.reference_program import (  # noqa: F401 - DeviceFull: its importers take it from here
    DeviceFull,
    InProcessProgram,
    ReferenceDied,
    ReferenceError,
    ReferenceProgram,
    held_bytes,
)
from protocols import Task

# A trial that waits (it is drawn while planning, before the sandbox is ready) and is larger than this
# waits on the host once its expected outputs exist. A trial drawn just before it is used never waits.
KEEP_ON_DEVICE_BYTES = 256 << 20
# The float64 run that measures the reference's own float32 error (an offset trial's tolerance
# allowance) is taken up to this many bytes of float64 inputs, outputs and parameters: above it, on
# the device beside the run's other trials, it could take memory the run did not reserve (devmem.py).
FLOAT64_MAX_BYTES = 2 << 30
# Family parameters are drawn from the operating system's randomness, fresh for every trial.
_FAMILY_RNG = secrets.SystemRandom()


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
    model: object = field(repr=False)  # its program's handle: the nn.Module in process, an id when jailed


class Reference:
    """A task's reference, loaded from its source once per lane: the verifier's logic over its program
    (in process, or jailed: `program`)."""

    def __init__(self, task: Task, device: str, program: ReferenceProgram | None = None):
        spec = task.kernel
        self.task_id = task.task_id
        self.device = device
        self.source = spec.reference
        self.hash = hashlib.sha256(spec.reference.encode()).hexdigest()
        self.source_path = spec.source_path
        filename = spec.source_path or f"<reference {task.task_id}>"
        self.program = program or InProcessProgram(spec.reference, filename, task.task_id, device)
        self.declared = self.program.declared
        self.defaults = self.declared.defaults
        self._footprints: dict[tuple, int | None] = {}  # by shape overrides: see footprint()

    @property
    def jailed(self) -> bool:
        """Whether the reference's code runs in a jailed process (a client's reference)."""
        return self.program.jailed

    # ---------------------------------------------------------------------------------- shapes

    def primary_overrides(self, backend: str) -> dict:
        return dict(self.declared.cpu_shapes or {}) if backend == "cpu" else {}

    def alt_overrides(self, backend: str) -> list[dict]:
        primary = self.primary_overrides(backend)
        alts = self.declared.alt_shapes
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

    # -------------------------------------------------------------------------------- tolerance

    def tolerance(self) -> tuple[float, float] | None:
        """(atol, rtol) declared by the task with KILN_TOLERANCE, or None."""
        return self.declared.tolerance

    # ---------------------------------------------------------------------------- trusted runs

    def footprint(self, config: ShapeConfig) -> int | None:
        """Bytes of one trial's inputs and reference outputs at `config`'s shapes, known before any
        is drawn: the first real draw's, or else `get_inputs()` and forward run on meta tensors
        (shapes and dtypes only, nothing allocated). None when neither can say (a forward that meta
        tensors cannot run); the caller then assumes the worst."""
        key = tuple(sorted(config.overrides.items()))
        if key not in self._footprints:
            self._footprints[key] = self.program.footprint(config.overrides)
        return self._footprints[key]

    def instance(self, config: ShapeConfig) -> Instance:
        """Build the reference Model for a shape config under a fresh seed."""
        seed = secrets.randbits(62)
        built = self.program.build(config.overrides, seed)
        return Instance(config, built.init_args, seed, built.state_dict, built.model)

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
        base = self._draw(instance.config.overrides)
        if family == NORMAL:
            made = Trial(instance.config, index, base, self._forward(instance, base))
            made.degenerate = degeneracy(made.expected, tolerance, self.device)
        else:
            made = self._family_trial(instance, index, family, base, infinite_ok, tolerance)
            if isinstance(made, Skipped):
                return made
        self.check_outputs(made.inputs, made.expected)
        if family == NORMAL:
            self._footprints[tuple(sorted(instance.config.overrides.items()))] = held_bytes(made.inputs, made.expected)
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
                expected = self._forward(instance, inputs)
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
        params = self.program.elements(instance.model)
        elements = params + sum(x.numel() for x in inputs if isinstance(x, torch.Tensor))
        elements += sum(e.numel() for e in expected)
        if 8 * elements > FLOAT64_MAX_BYTES:
            return f"no float64 check of the reference (it would take {8 * elements >> 20} MB): plain tolerance"
        try:
            wide = [x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs]
            exact = self.run(instance.model, wide, overrides=instance.config.overrides, wide=True)
        except ReferenceDied:  # its process is gone: no other run of it will answer either
            raise
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
        fresh = self._draw(instance.config.overrides)
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
            expected = self._forward(instance, inputs)
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
        if held_bytes(inputs, expected) <= KEEP_ON_DEVICE_BYTES:
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
        return self._draw(instance.config.overrides)

    def _draw(self, overrides: dict) -> list:
        """`get_inputs()` at `overrides` under a fresh seed from `secrets`, drawn where the reference
        runs (on its device: InProcessProgram.draw). Every draw of a trial's inputs comes through here."""
        return self.program.draw(overrides, secrets.randbits(62))

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
        expected = self._forward(instance, inputs)
        self.check_outputs(inputs, expected)
        return Trial(instance.config, -1, inputs, expected)  # used at once: it never waits

    def run(
        self, model, inputs: list, *, wait: bool = True, overrides: dict | None = None, wide: bool = False
    ) -> list[torch.Tensor]:
        """The reference's outputs (of `model`, an instance's handle) as a list of tensors on the
        reference device; `wait=False` leaves them queued on the device's stream (the caller reads
        them in stream order, or waits itself). `overrides`: the module constants it runs under (its
        instance's shapes; None: the module's defaults). `wide`: its float64 copy runs."""
        return self.program.forward(model, self.to_device(inputs), overrides=overrides, wide=wide, wait=wait)

    def _forward(self, instance: Instance, inputs: list) -> list[torch.Tensor]:
        """The instance's model on `inputs`, under its shapes' module constants."""
        return self.run(instance.model, inputs, overrides=instance.config.overrides)

    def to_device(self, inputs: list) -> list:
        return [x.to(self.device) if isinstance(x, torch.Tensor) else x for x in inputs]


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


# Jailed references a lane keeps loaded (least recently used first out, once no run uses it): each is a
# process with torch loaded, and on cuda a CUDA context (some hundreds of MB of device memory).
JAILED_PER_LANE = 4


@dataclass
class _Slot:
    """One cached reference: made under its own lock (a slow load blocks no other task), counted while
    runs use it (never closed under them)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    ref: Reference | None = None
    users: int = 0
    used: float = 0.0  # time.monotonic() of its last use: the eviction order


class ReferenceCache:
    """A lane's loaded references, by (task id, reference hash, jailed): a module is executed once,
    in this process for the operator's own task set, or in a jailed process of its own
    (`jail.open`, jailed_reference.py) for a reference a client sent (`KernelSpec.reference_origin`),
    or for every reference with `sandbox_all` (verifier.sandbox_references). Jailed ones are bounded
    (JAILED_PER_LANE), replaced when their process died, and closed with the cache. Whether one runs
    jailed is in the key, so a client's reference and the operator's never share a program; the
    verdict and baseline caches need nothing new: one (task id, reference source) is one program,
    wherever it runs, and a client cannot name a task of the operator's set with its own source."""

    def __init__(self, device: str, jail=None, *, sandbox_all: bool = False):
        self.device = device
        self.jail = jail  # jailed_reference.ReferenceJail, or None where references are not sandboxed
        self.sandbox_all = sandbox_all
        self._slots: dict[tuple[str, str, bool], _Slot] = {}
        self._lock = threading.Lock()

    def jailed(self, task: Task) -> bool:
        return self.sandbox_all or task.kernel.reference_origin == "client"

    @contextmanager
    def use(self, task: Task) -> Iterator[Reference]:
        """The task's reference, loaded (or its dead process replaced) on first use, held for the block."""
        jailed = self.jailed(task)
        if jailed and self.jail is None:
            raise ReferenceError(f"the reference of {task.task_id} must run sandboxed, and this verifier cannot")
        key = (task.task_id, hashlib.sha256(task.kernel.reference.encode()).hexdigest(), jailed)
        with self._lock:
            slot = self._slots.setdefault(key, _Slot())
            slot.users += 1
            slot.used = time.monotonic()
        try:
            with slot.lock:
                if slot.ref is None or not slot.ref.program.alive:
                    dead, slot.ref = slot.ref, None
                    if dead is not None:
                        dead.program.close()
                    slot.ref = Reference(task, self.device, self.jail.open(task) if jailed else None)
                ref = slot.ref
            yield ref
        finally:
            with self._lock:
                slot.users -= 1
                retired = self._over(JAILED_PER_LANE)
            for old in retired:
                old.program.close()

    def _over(self, keep: int) -> list[Reference]:
        """Unused jailed references beyond the newest `keep`, taken out of the cache (to be closed),
        and the slots of loads that failed. Called under the cache's lock."""
        for key in [k for k, s in self._slots.items() if s.ref is None and s.users == 0]:
            del self._slots[key]
        jailed = sorted(((s.used, k) for k, s in self._slots.items() if k[2]), reverse=True)
        out = []
        for _, key in jailed[keep:]:
            slot = self._slots[key]
            if slot.users == 0:
                out.append(self._slots.pop(key).ref)
        return out

    def renew(self) -> None:
        """Close every jailed reference no run uses, so that its next use is a fresh process (a
        benchmark that repeats baselines across processes: KernelVerifier.forget_baselines)."""
        with self._lock:
            retired = self._over(0)
        for old in retired:
            old.program.close()

    def close(self) -> None:
        with self._lock:
            refs = [s.ref for s in self._slots.values() if s.ref is not None]
            self._slots.clear()
        for ref in refs:
            ref.program.close()
