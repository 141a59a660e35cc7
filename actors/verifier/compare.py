"""Output comparison, run in the trusted verifier process on outputs read from the sandbox's arena.

A floating-point element passes when |got - expected| <= atol * scale + rtol * |expected|, where
`scale` is the root mean square of the reference output's finite values: the absolute tolerance
follows the output's magnitude, so an output whose values are all smaller than atol cannot be
matched by zeros. Integer and boolean outputs must match exactly. NaN never passes (a reference
that produces NaN from finite inputs is a broken task, reference.py); infinities must match in sign
and position. A constant output (every element equal) fails where the reference's values span more
than 1% of the tolerance bound, however close it came: within tolerance of a nearly flat reference
it still does not compute the task, while a reference that is constant up to rounding (a few ulps,
far below 1% of the bound) is matched by its constant. A mismatch is described the way a model can act on: which output, how many elements,
the largest error, where, and the two values there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# (atol, rtol) by output dtype; atol is in units of the output's scale. float32 at 1e-3 passes fp32
# kernels with any summation order and rejects bf16 arithmetic (~4e-3 relative error); half types get
# the looser bounds their formats allow.
DEFAULT_TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-6, 1e-6),
    torch.float32: (1e-3, 1e-3),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
}


@dataclass(frozen=True)
class Comparison:
    ok: bool
    message: str  # "" when ok
    max_abs_error: float  # over all compared outputs (0.0 when shapes differ)
    mismatched: int  # elements outside tolerance
    numel: int


def declared_tolerance(module) -> tuple[float, float] | None:
    """(atol, rtol) a task's reference module declares with KILN_TOLERANCE (one number for both, or
    {"atol": ..., "rtol": ...}), or None: the override `compare_outputs` takes for that task."""
    tol = getattr(module, "KILN_TOLERANCE", None)
    if isinstance(tol, (int, float)) and not isinstance(tol, bool):
        return float(tol), float(tol)
    if isinstance(tol, dict) and {"atol", "rtol"} <= set(tol):
        return float(tol["atol"]), float(tol["rtol"])
    return None


def tolerance_for(dtype: torch.dtype, override: tuple[float, float] | None) -> tuple[float, float]:
    if override is not None:
        return override
    return DEFAULT_TOLERANCE.get(dtype, (0.0, 0.0))


def scale_of(expected: torch.Tensor) -> float:
    """The root mean square of the reference output's finite values (0 for none)."""
    e = expected.detach().double()
    finite = e[torch.isfinite(e)]
    return float(finite.square().mean().sqrt()) if finite.numel() else 0.0


def compare_outputs(
    got: list[torch.Tensor], expected: list[torch.Tensor], override: tuple[float, float] | None = None
) -> Comparison:
    """Compare a candidate's outputs with the reference's, output by output."""
    if len(got) != len(expected):
        return Comparison(False, f"returned {len(got)} output(s), the reference returns {len(expected)}", 0.0, 0, 0)
    worst, bad, total = 0.0, 0, 0
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        name = "the output" if len(expected) == 1 else f"output {i}"
        if tuple(g.shape) != tuple(e.shape):
            return Comparison(False, f"{name} has shape {tuple(g.shape)}, expected {tuple(e.shape)}", 0.0, 0, 0)
        if g.dtype != e.dtype:
            return Comparison(False, f"{name} has dtype {_dt(g.dtype)}, expected {_dt(e.dtype)}", 0.0, 0, 0)
        result = _compare_one(name, g.to(e.device), e, tolerance_for(e.dtype, override))
        worst, bad, total = max(worst, result.max_abs_error), bad + result.mismatched, total + result.numel
        if not result.ok:
            return Comparison(False, result.message, worst, bad, total)
    return Comparison(True, "", worst, bad, total)


def _compare_one(name: str, got: torch.Tensor, exp: torch.Tensor, tol: tuple[float, float]) -> Comparison:
    n = exp.numel()
    if n == 0:
        return Comparison(True, "", 0.0, 0, 0)
    atol, rtol = tol
    if not (exp.is_floating_point() or exp.is_complex()):
        wrong = got != exp
        count = int(wrong.sum())
        if count:
            idx = _first_index(wrong)
            return Comparison(
                False,
                f"{name}: {count} of {n} elements differ (must match exactly); first at "
                f"{idx}: got {got[idx].item()}, expected {exp[idx].item()}",
                float("inf"),
                count,
                n,
            )
        return Comparison(True, "", 0.0, 0, n)
    g, e = got.double(), exp.double()
    nan = torch.isnan(g)
    if bool(nan.any()):
        count = int(nan.sum())
        return Comparison(
            False,
            f"{name} contains {count} NaN value(s) (first at {_first_index(nan)}); NaN never passes",
            float("nan"),
            count,
            n,
        )
    diff = (g - e).abs()
    same_inf = torch.isinf(e) & (g == e)
    diff = torch.where(same_inf, torch.zeros_like(diff), diff)
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    scale = scale_of(exp)
    bound = atol * scale + rtol * e.abs().nan_to_num(posinf=0.0, neginf=0.0)
    wrong = diff > bound
    wrong |= torch.isinf(g) & ~same_inf
    count = int(wrong.sum())
    max_err = float(diff.max())
    if count:
        idx = _index_of_max(torch.where(wrong, diff, torch.zeros_like(diff)))
        return Comparison(
            False,
            f"{name}: {count} of {n} elements outside tolerance (atol={atol:g} x the output's "
            f"scale {scale:.3g}, rtol={rtol:g}); max abs error {max_err:.4g} at {idx}: "
            f"got {g[idx].item():.6g}, expected {e[idx].item():.6g}",
            max_err,
            count,
            n,
        )
    finite = e[torch.isfinite(e)]
    spread = 0.01 * (atol * scale + rtol * float(finite.abs().max())) if finite.numel() else 0.0
    return _constant_check(name, g, e, spread, Comparison(True, "", max_err, 0, n))


def _constant_check(name: str, got: torch.Tensor, exp: torch.Tensor, spread: float, passed: Comparison) -> Comparison:
    """Every element of `got` equal, where the reference's finite values span more than `spread`."""
    if got.numel() < 2:
        return passed
    flat_g, flat_e = got.reshape(-1), exp.reshape(-1)
    finite = flat_e[torch.isfinite(flat_e)]
    varies = finite.numel() > 1 and float(finite.max() - finite.min()) > spread
    if varies and bool((flat_g == flat_g[0]).all()):
        return Comparison(
            False,
            f"{name} is constant ({flat_g[0].item():.6g} everywhere), the reference's is not",
            passed.max_abs_error,
            got.numel(),
            got.numel(),
        )
    return passed


def _first_index(mask: torch.Tensor) -> tuple[int, ...]:
    flat = int(mask.reshape(-1).nonzero()[0, 0])
    return _unravel(flat, mask.shape)


def _index_of_max(values: torch.Tensor) -> tuple[int, ...]:
    return _unravel(int(values.reshape(-1).argmax()), values.shape)


def _unravel(flat: int, shape) -> tuple[int, ...]:
    idx = []
    for size in reversed(list(shape)):
        idx.append(flat % size)
        flat //= size
    return tuple(reversed(idx))


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
