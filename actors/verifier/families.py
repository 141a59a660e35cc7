"""Input families: the distributions a task's correctness trials are drawn from (docs/verifier.md, P7).

One iid draw of `get_inputs()` is one distribution, not a specification: a softmax without its max
shift, a one-pass variance, a cumprod that writes zeros where randn's products underflow anyway, and
a loss returned as the constant randn makes it all pass it. So the primary shape's trials also come
from the families below, each a pure transform of a fresh draw under parameters drawn per
verification (`secrets`, by the caller), so a candidate can neither predict them nor recognise a
family by the position of its call (`schedule` shuffles them among the plain trials).

Every transform touches the floating-point tensors only (integer and boolean inputs, such as
indices, stay as drawn) and keeps every shape and dtype: a shape's first trial sizes the sandbox.
Power-of-two factors keep values exact. Ranges follow the dtype (`torch.finfo`): a half-precision
input keeps its spread through an offset and stays finite when scaled.

* `offset`: x + s·2^u·std(x), u in [7, 8.5] (fp32/fp64), a sign and u per tensor: |mean| ≫ std, where
  a one-pass variance cancels and an unshifted softmax overflows. The reference's own float32 error
  there is measured against a float64 run and allowed (`Family.float64`; compare.py).
* `large`: x·2^k, k in [4, max_exp/4] (fp32: 4..32), shrunk toward 4 while the reference's outputs are
  not finite (it subsumes the ×16 trial: ReLU6 for ReLU).
* `tiny`: x·2^-k, k in [8, min(30, -min_exp/4)] (fp32: 8..30).
* `sparse`: each element kept with probability p in [0.02, 0.25], and a share r in [0.05, 0.25] of
  rows (the last dimension) zeroed whole.
* `row_scales`: each row times 2^e, e uniform in [-k, k] per row, k in [3, 8] (fp32).
* `near_one`: 1 + c·(x - mean)/(std·√L), c in [0.5, 2], L the last dimension: products of a row stay
  of order 1 (randn's underflow after ~100 factors, so a cumprod that writes zeros there passes iid
  trials).

The sensitivity trial (`mix`, `next_mix`) is not a family: it mixes a fresh draw into an earlier
trial's inputs, a little at first, more until the reference's output moves `MOVE` tolerance bounds,
so an output that ignores its inputs cannot stay within tolerance of both trials.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

NORMAL = "normal"  # the task's own get_inputs() draw, untouched
SENSITIVITY = "sensitivity"  # an earlier trial's inputs perturbed (not a family: see mix)
MOVE = 10.0  # the sensitivity trial's reference output moves at least this many tolerance bounds
FIRST_MIX = 2.0**-10  # the share of a fresh draw mixed in first
MIX_ATTEMPTS = 4  # reference runs spent looking for a mix that moves the output (then: insensitive)


@dataclass(frozen=True)
class Drawn:
    """One family with the parameters drawn for one trial (plain values: they go to diagnostics)."""

    family: str
    params: dict = field(default_factory=dict)

    def describe(self) -> str:
        if self.family == SENSITIVITY:
            return f"an earlier trial's inputs with {self.params.get('mix', 0):.3g} of a fresh draw mixed in"
        return FAMILIES[self.family].describe(self.params) if self.family in FAMILIES else self.family


@dataclass(frozen=True)
class Family:
    name: str
    draw: Callable[[random.Random, list[torch.dtype]], dict]  # parameters, given each float input's dtype
    transform: Callable[[torch.Tensor, int, dict], torch.Tensor]  # (float input, its index among them, params)
    describe: Callable[[dict], str]
    retry: Callable[[dict], dict | None] = lambda params: None  # parameters to try after non-finite outputs
    float64: bool = False  # tolerance allows the reference's own float32 error (a float64 run measures it)


# ------------------------------------------------------------------------------- dtype ranges


def _mantissa(dtype: torch.dtype) -> int:
    return int(-math.log2(torch.finfo(dtype).eps))  # explicit mantissa bits


def _max_exponent(dtype: torch.dtype) -> int:
    return int(math.log2(torch.finfo(dtype).max))


def _min_exponent(dtype: torch.dtype) -> int:
    return int(math.log2(torch.finfo(dtype).tiny))


def _span(lo: int, hi: int) -> tuple[int, int]:
    """[lo, hi], with lo lowered to hi where a narrow dtype cannot reach lo."""
    return min(lo, hi), hi


def offset_range(dtype: torch.dtype) -> tuple[float, float]:
    """Exponents u of an offset 2^u·std, drawn uniformly: from 2^7, where a float32 one-pass variance
    (E[x^2] - E[x]^2, sequential sums) is off by 7 tolerance bounds or more at rows of 77 to 4096,
    to 2^8.5, where an honest float32 two-pass one (sequential sums too) stays within two thirds of
    one (measured; docs/verifier.md); a half type keeps four bits of its spread."""
    hi = min(8.5, _mantissa(dtype) - 4)
    return min(7.0, hi), hi


def large_range(dtypes: list[torch.dtype]) -> tuple[int, int]:
    """x·2^k with k up to a quarter of the narrowest dtype's exponent range (x^4 stays finite)."""
    return _span(4, max(4, min(32, *(_max_exponent(d) // 4 for d in dtypes))))


def tiny_range(dtypes: list[torch.dtype]) -> tuple[int, int]:
    """x·2^-k, squares and products of a few still normal numbers."""
    return _span(8, min(30, min(-_min_exponent(d) for d in dtypes) // 4))


def row_exponent_range(dtypes: list[torch.dtype]) -> tuple[int, int]:
    return _span(3, min(8, min(_max_exponent(d) for d in dtypes) // 8))


# ---------------------------------------------------------------------------------- families


def _spread(x: torch.Tensor) -> float:
    """The standard deviation of x's elements; for a constant x, its magnitude; for zeros, 1. A
    reduction only (accumulated in float32 or wider): at KernelBench's sizes an input is gigabytes,
    and a copy of it in float64 would be twice that."""
    std = float(x.std()) if x.numel() > 1 else 0.0
    if not math.isfinite(std) or std == 0.0:  # constant: every element is the first
        std = abs(float(x.flatten()[0])) if x.numel() else 0.0
    return std if math.isfinite(std) and std > 0.0 else 1.0


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as rows of its last dimension (a vector or a scalar: rows of one element)."""
    return x.reshape(-1, x.shape[-1]) if x.dim() >= 2 else x.reshape(-1, 1)


def _generator(x: torch.Tensor, seed: int) -> torch.Generator:
    return torch.Generator(device=x.device).manual_seed(seed)


def _offset_draw(rng: random.Random, dtypes: list[torch.dtype]) -> dict:
    return {
        "exponents": [round(rng.uniform(*offset_range(d)), 2) for d in dtypes],
        "signs": [rng.choice((1, -1)) for _ in dtypes],
        "flipped": False,
    }


def _offset(x: torch.Tensor, i: int, p: dict) -> torch.Tensor:
    return x + p["signs"][i] * 2.0 ** p["exponents"][i] * _spread(x)


def _offset_retry(p: dict) -> dict | None:
    """The other sign, once (log of negatives: the reference takes +offset, not -offset)."""
    return None if p["flipped"] else {**p, "signs": [-s for s in p["signs"]], "flipped": True}


def _offset_describe(p: dict) -> str:
    terms = [f"{'+' if s > 0 else '-'}2^{k:g}" for s, k in zip(p["signs"], p["exponents"], strict=True)]
    return f"inputs offset by {', '.join(terms)} times their standard deviation"


def _large_retry(p: dict) -> dict | None:
    """Halve the way down to x16 while the reference's outputs are not finite."""
    k = p["exponent"]
    return None if k <= 4 else {**p, "exponent": 4 + (k - 4) // 2}


def _sparse(x: torch.Tensor, i: int, p: dict) -> torch.Tensor:
    g = _generator(x, p["seed"] + i)
    keep = _rows(torch.rand(x.shape, generator=g, device=x.device) < p["keep"])
    keep = keep & (torch.rand((keep.shape[0], 1), generator=g, device=x.device) >= p["zero_rows"])
    return torch.where(keep.reshape(x.shape), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _row_scales(x: torch.Tensor, i: int, p: dict) -> torch.Tensor:
    g = _generator(x, p["seed"] + i)
    rows = _rows(x)
    k = p["max_exponent"]
    e = torch.randint(-k, k + 1, (rows.shape[0], 1), generator=g, device=x.device)
    return (rows * torch.pow(2.0, e.to(torch.float64)).to(x.dtype)).reshape(x.shape)


def _near_one(x: torch.Tensor, i: int, p: dict) -> torch.Tensor:
    length = x.shape[-1] if x.dim() else 1
    mean = float(x.mean()) if x.numel() > 1 else float(x.flatten()[0]) if x.numel() else 0.0
    return (x - mean) * (p["width"] / (_spread(x) * math.sqrt(max(length, 1)))) + 1.0


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "offset",
            _offset_draw,
            _offset,
            _offset_describe,
            retry=_offset_retry,
            float64=True,
        ),
        Family(
            "large",
            lambda rng, dtypes: {"exponent": rng.randint(*large_range(dtypes))},
            lambda x, i, p: x * 2.0 ** p["exponent"],
            lambda p: f"inputs times 2^{p['exponent']}",
            retry=_large_retry,
        ),
        Family(
            "tiny",
            lambda rng, dtypes: {"exponent": rng.randint(*tiny_range(dtypes))},
            lambda x, i, p: x * 2.0 ** -p["exponent"],
            lambda p: f"inputs times 2^-{p['exponent']}",
        ),
        Family(
            "sparse",
            lambda rng, dtypes: {
                "keep": round(rng.uniform(0.02, 0.25), 3),
                "zero_rows": round(rng.uniform(0.05, 0.25), 3),
                "seed": rng.getrandbits(62),
            },
            _sparse,
            lambda p: f"inputs mostly zero ({p['keep']:.0%} of elements kept, {p['zero_rows']:.0%} of rows zeroed)",
        ),
        Family(
            "row_scales",
            lambda rng, dtypes: {"max_exponent": rng.randint(*row_exponent_range(dtypes)), "seed": rng.getrandbits(62)},
            _row_scales,
            lambda p: f"each row of the inputs times its own 2^e, |e| <= {p['max_exponent']}",
        ),
        Family(
            "near_one",
            lambda rng, dtypes: {"width": round(rng.uniform(0.5, 2.0), 3)},
            _near_one,
            lambda p: f"inputs near 1 (1 + {p['width']:g} x standard normal / sqrt(last dimension))",
        ),
    )
}
ALL: tuple[str, ...] = tuple(FAMILIES)


def floating(inputs: list) -> list[torch.Tensor]:
    """The inputs a family transforms: floating-point tensors, in order."""
    return [x for x in inputs if isinstance(x, torch.Tensor) and x.is_floating_point()]


def draw(family: str, inputs: list, rng: random.Random) -> Drawn:
    """Fresh parameters of `family` for these inputs (their float dtypes set the ranges)."""
    dtypes = [x.dtype for x in floating(inputs)]
    return Drawn(family, FAMILIES[family].draw(rng, dtypes) if dtypes else {})


def apply(drawn: Drawn, inputs: list) -> list:
    """The inputs under `drawn`: each floating-point tensor transformed, everything else as given;
    shapes and dtypes unchanged."""
    if drawn.family == NORMAL:
        return list(inputs)
    family, out, i = FAMILIES[drawn.family], [], 0
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            with torch.no_grad():
                y = family.transform(x, i, drawn.params)
            if y.shape != x.shape or y.dtype != x.dtype:  # a family that changed sizes would overrun the arena
                raise AssertionError(
                    f"family {drawn.family} changed {x.dtype}{tuple(x.shape)} into {y.dtype}{tuple(y.shape)}"
                )
            out.append(y)
            i += 1
        else:
            out.append(x)
    return out


def retry(drawn: Drawn) -> Drawn | None:
    """The parameters to try next where the reference's outputs were not finite (None: skip)."""
    params = FAMILIES[drawn.family].retry(drawn.params) if drawn.family in FAMILIES else None
    return Drawn(drawn.family, params) if params is not None else None


# ---------------------------------------------------------------------------------- planning


def schedule(plain: int, rng: random.Random) -> list[str]:
    """What each of the primary shape's trials after its first draws from, in order: its `plain` - 1
    other plain trials, one trial per family and the sensitivity trial, shuffled (a call's position
    says nothing of its family); the last plain trial stays last (the canary is built on it)."""
    middle = [NORMAL] * max(plain - 2, 0) + list(ALL) + [SENSITIVITY]
    rng.shuffle(middle)
    return middle + [NORMAL] * (plain >= 2)


def labels(shape_label: str, kinds: list[str]) -> list[str]:
    """Trial labels as feedback shows them: a plain trial by its shape ("primary#1", "alt0#0"), any
    other by its family ("offset#0", "sensitivity#0"), numbered in order of appearance."""
    counts: dict[str, int] = {}
    out = []
    for kind in kinds:
        name = shape_label if kind == NORMAL else kind
        out.append(f"{name}#{counts.get(name, 0)}")
        counts[name] = counts.get(name, 0) + 1
    return out


# ------------------------------------------------------------------------------- sensitivity


def mix(base: list, fresh: list, t: float) -> list:
    """base + t·(fresh - base) for each floating-point tensor (the others as in base): at small t an
    input the candidate cannot tell from an ordinary draw, or from base, whose output must move."""
    out = []
    for a, b in zip(base, fresh, strict=True):
        if isinstance(a, torch.Tensor) and a.is_floating_point() and isinstance(b, torch.Tensor):
            out.append(torch.lerp(a, b.to(a.device, a.dtype), t) if t < 1.0 else b.to(a.device, a.dtype).clone())
        else:
            out.append(a)
    return out


def next_mix(t: float, moved: float) -> float | None:
    """The next share to mix in, given that mixing in `t` moved the reference's output `moved`
    tolerance bounds; None when it moved enough, or when even a whole fresh draw did not move it.
    Aims at twice MOVE assuming the output moves in proportion, and at least quadruples."""
    if moved >= MOVE or t >= 1.0:
        return None
    if not math.isfinite(moved) or moved <= 0.0:
        return 1.0
    return min(1.0, max(4.0 * t, t * 2.0 * MOVE / moved))
