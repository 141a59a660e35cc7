"""The checks a synthesized task passes before it is written, run on the emitted source itself.

The file is loaded the way the verifier loads a reference (executed as a fresh module) and run on the
CPU at its cpu shapes, at each alt shape (layered on the cpu shapes, as the cpu backend does), and at
its primary shapes when they are cheap enough for a CPU (`PRIMARY_ON_CPU`). Primary shapes over that
budget run on the meta device instead, which checks that every op accepts them and that the output
has the predicted shape, but computes no values; the result says which, with the estimated cost.
At every shape run on the CPU:

* it builds and runs, and the output has the shape and dtype the shape rules predicted;
* the output is finite and of sane magnitude (|y| <= 1e6, so the dtype's default tolerance means
  something);
* it is well conditioned: the float32 output agrees with a float64 run of the same model and inputs
  to `CONDITIONING` (ten times tighter than the verifier's float32 tolerance), so a correct kernel
  that merely sums in another order is not failed by the verifier.

and at the cpu and alt shapes (properties of the graph, not of its sizes):

* it is not constant: two independent input draws give different outputs;
* it is not the identity: the output is not (close to) one of the inputs;
* every input matters: redrawing any one input alone changes the output.

Inputs and parameters are drawn under fixed seeds, so a check's verdict is reproducible.
"""

from __future__ import annotations

import copy
import linecache
import types
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tasks.synth.dims import evaluate
from tasks.synth.graph import Graph
from tasks.synth.ops import graph_cost
from tasks.synth.sizes import ALT_ENVS, Budget, SizeTable

# Primary shapes are also run on the CPU when the graph's estimated cost there is at most this.
PRIMARY_ON_CPU = Budget(flops=1e8, bytes=6.4e7)
PRIMARY_RUN = "primary shapes run on CPU"
MAGNITUDE = 1e6  # outputs beyond this are rejected as ill-scaled
CONDITIONING = 1e-4  # atol = rtol between the float32 and float64 outputs


class LoadError(RuntimeError):
    pass


@dataclass(frozen=True)
class CheckResult:
    reason: str | None  # None when every check passed; else the rejection reason ("constant", ...)
    detail: str  # one line: which shape and what was seen
    primary: str  # PRIMARY_RUN, or what ran at the primary shapes instead and why

    @property
    def passed(self) -> bool:
        return self.reason is None


def load_source(source: str, filename: str) -> types.ModuleType:
    """Execute a task file's source as a fresh module (the verifier's way of loading a reference)."""
    module = types.ModuleType("kiln_synth_task")
    module.__file__ = filename
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    try:
        # by design: the generated reference is run to check it
        exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102
    except Exception as err:
        raise LoadError(f"{type(err).__name__}: {err}") from err
    return module


def overrides(sizes: SizeTable, names: list[str], env: str) -> dict[str, int]:
    return {name: var.values[env] for name, var in zip(names, sizes.vars, strict=True)}


@contextmanager
def constants(module: types.ModuleType, values: dict[str, int]):
    saved = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


def check_task(source: str, filename: str, graph: Graph, names: list[str], seed: int) -> CheckResult:
    """Run the checks; `names` are the size constants' names in the emitted file, `seed` seeds every
    parameter and input draw."""
    cost = graph_cost(graph, graph.sizes.env("primary"))
    on_cpu = cost.within(PRIMARY_ON_CPU)
    if on_cpu:
        primary = PRIMARY_RUN
    else:
        primary = (
            f"primary shapes run on the meta device only (shapes checked, no values): ~{cost.flops / 1e9:.2f} "
            f"GFLOP and {cost.bytes / 1e6:.0f} MB, over the CPU check's {PRIMARY_ON_CPU.flops / 1e9:.1f} "
            f"GFLOP and {PRIMARY_ON_CPU.bytes / 1e6:.0f} MB"
        )
    try:
        module = load_source(source, filename)
    except LoadError as err:
        return CheckResult("load", str(err), primary)
    cpu = overrides(graph.sizes, names, "cpu")
    shapes = [("cpu", cpu)] + [(env, {**cpu, **overrides(graph.sizes, names, env)}) for env in ALT_ENVS]
    shapes.append(("primary", {}))
    for env, values in shapes:
        expected = tuple(evaluate(d, graph.sizes.env(env)) for d in graph.values[graph.output].shape)
        with constants(module, values):
            if env != "primary":
                failure = _check_at(module, expected, seed)
            elif on_cpu:
                failure = _check_at(module, expected, seed, structural=False)
            else:
                failure = _check_meta(module, expected)
        if failure is not None:
            reason, detail = failure
            return CheckResult(reason, f"at the {env} shapes: {detail}", primary)
    return CheckResult(None, "", primary)


def _check_meta(module: types.ModuleType, expected: tuple[int, ...]) -> tuple[str, str] | None:
    """Build and run the model on the meta device: shapes and dtypes propagate, nothing is computed."""
    try:
        with torch.device("meta"), torch.no_grad():
            out = module.Model(*module.get_init_inputs())(*module.get_inputs())
    except Exception as err:  # noqa: BLE001 - any failure on the meta device rejects the generated task
        return "run", f"on the meta device: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected or out.dtype != torch.float32:
        return "shape", f"on the meta device: output {getattr(out, 'shape', out)}, the shape rules predicted {expected}"
    return None


def _draw(module: types.ModuleType, seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    return list(module.get_inputs())


def _check_at(
    module: types.ModuleType, expected: tuple[int, ...], seed: int, structural: bool = True
) -> tuple[str, str] | None:
    """The checks at the shapes currently set on the module. `structural` adds the checks that do not
    depend on the sizes (constant, identity, unused input); they run at the cpu and alt shapes and
    are skipped at the (large) primary shapes."""
    with torch.random.fork_rng(devices=[]):
        try:
            torch.manual_seed(seed)
            model = module.Model(*module.get_init_inputs())
            first = _draw(module, seed + 1)
            with torch.no_grad():
                out = model(*first)
                if not isinstance(out, torch.Tensor):
                    return "run", f"forward returned {type(out).__name__}, not a tensor"
                exact = copy.deepcopy(model).double()(*(x.double() for x in first))
                if structural:
                    second = _draw(module, seed + 2)
                    other = model(*second)
                    redrawn = [model(*first[:i], second[i], *first[i + 1 :]) for i in range(len(first))]
        except Exception as err:  # noqa: BLE001 - the reference itself failed: a shape rule let through an invalid op
            return "run", f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    if tuple(out.shape) != expected or out.dtype != torch.float32:
        return "shape", f"output {tuple(out.shape)} {out.dtype}, the shape rules predicted {expected} float32"
    outputs = [out, other] if structural else [out]
    if not all(torch.isfinite(y).all() for y in outputs):
        return "non-finite", "the output holds inf or nan"
    peak = max(y.abs().max().item() for y in outputs)
    if peak > MAGNITUDE:
        return "magnitude", f"|output| reaches {peak:.3g}"
    if structural:
        if torch.allclose(out, other, rtol=1e-5, atol=1e-6):
            return "constant", "two independent input draws give the same output"
        for i, x in enumerate(first):
            if x.shape == out.shape and torch.allclose(out, x, rtol=1e-5, atol=1e-6):
                return "identity", f"the output equals input {i}"
        for i, y in enumerate(redrawn):
            if torch.equal(y, out):
                return "unused-input", f"redrawing input {i} alone leaves the output unchanged"
    if not torch.allclose(out.double(), exact, rtol=CONDITIONING, atol=CONDITIONING):
        worst = (out.double() - exact).abs().max().item()
        return "ill-conditioned", f"float32 and float64 outputs differ by up to {worst:.3g}"
    return None
