"""What a candidate run will pose, decided before its sandbox starts: the trusted side's plan.

For every shape config of the task, its reference instance and first trial are drawn now (their
sizes size the sandbox: its arena and memory limit); the later trials are only planned (their
family and label) and drawn when the sandbox is ready for each (runner.py), so a candidate stopped
on its first trial costs one draw per shape. The primary shape goes last, so the sandbox's last
ModelNew is the one timed.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass

import torch

from actors.verifier import families
from actors.verifier.devmem import DeviceMemory
from actors.verifier.families import NORMAL
from actors.verifier.jailed_reference import ReferenceRaised
from actors.verifier.performance import stage_calls
from actors.verifier.reference import Instance, Reference, ReferenceError, ShapeConfig, Trial, all_finite
from actors.verifier.tensors import dtype_name, nbytes
from configs import VerifierConfig
from protocols.lease import DeviceLease

# Orders each run's primary trials (families.schedule): from the operating system's randomness, so a
# candidate cannot tell a family by the position of its call.
SCHEDULE_RNG = secrets.SystemRandom()


@dataclass(frozen=True)
class Planned:
    """One trial of the plan, before it is drawn."""

    index: int  # across all trials of the job
    family: str  # families.NORMAL, a family of families.ALL, or families.SENSITIVITY
    label: str  # as feedback names it ("primary#1", "offset#0")


@dataclass
class ShapeTrials:
    """One shape config's reference instance and its trials. The first (a plain draw) is drawn while
    planning (its size sizes the sandbox); the rest when the sandbox is ready for them, so a candidate
    stopped on its first trial costs the trusted side one draw per shape rather than every trial's."""

    config: ShapeConfig
    inst: Instance
    first: Trial
    later: list[Planned]  # the trials after the first, in order
    label: str  # the first trial's
    infinite_ok: bool = False  # the task's own draw gives infinite outputs: a family's may too

    @property
    def count(self) -> int:
        return 1 + len(self.later)


@dataclass
class Plan:
    """The trusted work done before the sandbox starts: every instance, each shape's first trial,
    and the arena size (which every later trial of the shape must fit: the same shapes)."""

    configs: list[ShapeTrials]
    arena_bytes: int
    largest_trial: int  # bytes of arena one trial takes (inputs and outputs twice each)
    footprint: int  # bytes of the largest trial's inputs and outputs (what device memory is counted in)
    notes: list[str]


def draw_plan(
    cfg: VerifierConfig,
    ref: Reference,
    memory: DeviceMemory,
    lease: DeviceLease,
    tol_override: tuple[float, float] | None,
    cancelled: threading.Event,
    *,
    drawn_alone: bool,
) -> Plan:
    """Every shape config's reference instance and first trial (alternative shapes first, the
    primary last, so the sandbox's last ModelNew is the one timed), the order of the later trials
    (the primary's: its plain trials, one per input family and the sensitivity trial, shuffled,
    then its last plain one, on which the canary is built; families.schedule), and an arena that
    holds the largest trial's inputs, its outputs twice and its inputs again, or the timed calls.
    `drawn_alone`: the task's size is unknown (no reservation is held), so each first draw
    reserves the lane's whole budget (`memory`'s); `cancelled` ends such a wait."""
    configs, notes = [], []
    largest_trial, largest_inputs = 0, 1
    shape_configs = ref.shape_configs(cfg.backend, cfg.trials)
    for config in shape_configs[1:] + shape_configs[:1]:
        with memory.reserve(memory.budget if drawn_alone else 0, cancelled), lease.shared():
            try:
                inst = ref.instance(config)
            except ReferenceError:  # a jailed reference's process that failed: no other shape would do
                raise
            except Exception as err:
                if config.label != "primary":  # a derived alternative shape the reference rejects
                    notes.append(f"skipped shapes {config.describe()}: the reference fails there ({err})")
                    continue
                raise fails_at_own_shapes(err) from err
            base = len(configs) * 100
            try:
                first = ref.trial(inst, base, tolerance=tol_override)
            except ReferenceError:
                raise
            except Exception as err:
                if config.label != "primary":  # a derived alternative its forward rejects (broadcasts)
                    notes.append(f"skipped shapes {config.describe()}: the reference fails there ({err})")
                    continue
                raise fails_at_own_shapes(err) from err
        if config.label == "primary":
            kinds = families.schedule(config.trials, SCHEDULE_RNG)
        else:
            kinds = [NORMAL] * (config.trials - 1)
        names = families.labels(config.label, [NORMAL, *kinds])
        later = [Planned(base + k, kind, names[k]) for k, kind in enumerate(kinds, start=1)]
        carried(first)
        configs.append(ShapeTrials(config, inst, first, later, names[0], not all_finite(first.expected)))
        largest_trial = max(largest_trial, arena_bytes(first))
        largest_inputs = max(largest_inputs, nbytes(first.inputs))
    params = sum(nbytes(list(s.inst.state_dict.values())) + 64 * len(s.inst.state_dict) for s in configs)
    # the timed calls of one stage (performance.py), each with room for its tensors' alignment
    timed = stage_calls(largest_inputs) * (largest_inputs + 1024)
    primary_out = nbytes(configs[-1].first.expected) if configs else 0
    arena = max(largest_trial, params, timed + primary_out) + 64 * 1024
    footprint = max((nbytes(s.first.inputs) + nbytes(s.first.expected) for s in configs), default=0)
    return Plan(configs, arena, largest_trial, footprint, notes)


def fails_at_own_shapes(err: Exception) -> ReferenceError:
    """A reference that fails at its primary shapes: a broken task (infra), in one line. A jailed
    reference's own exception already names its type (ReferenceRaised)."""
    why = str(err) if isinstance(err, ReferenceRaised) else f"{type(err).__name__}: {err}"
    return ReferenceError(f"the reference fails at its own shapes: {why}")


def carried(trial: Trial) -> None:
    """A task whose inputs or outputs have a dtype the sandbox's channel cannot carry is the verifier's
    limit, not the candidate's failure: infra (a ReferenceError), never its -1."""
    from actors.verifier.sandbox import DTYPE_NAMES

    for t in [x for x in trial.inputs if isinstance(x, torch.Tensor)] + list(trial.expected):
        if t.dtype not in DTYPE_NAMES:
            raise ReferenceError(
                f"the verifier cannot carry tensors of dtype {dtype_name(t.dtype)}: this task is unsupported"
            )


def arena_bytes(trial: Trial) -> int:
    """Arena one trial takes: its inputs and its outputs twice each (written, then read back)."""
    return 2 * nbytes(trial.inputs) + 2 * nbytes(trial.expected)
