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

Where a trial's inputs sit at a large offset (families.py), the reference's own float32 result is
itself off the exact one; `allowances` measures that against a float64 run of the reference, and the
bound grows by twice it (an honest kernel as accurate as the reference is off the reference by at
most its own error plus the reference's). `move_ratio` says how many tolerance bounds an output moved
between two trials (the sensitivity trial's threshold), and `degeneracy` when a trial's reference
output is one a candidate could match without computing much (reported, not scored).
"""

from __future__ import annotations

from collections.abc import Iterator
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


# The bound at large offsets grows by this many times the reference's own float32 error (its distance
# from a float64 run of itself): |got - ref| <= |got - exact| + |exact - ref|.
ALLOWANCE_FACTOR = 2.0
# A reference whose own float32 error is more than this share of its output's scale computes nothing
# reliable at those inputs: the trial is skipped (runner.py), not scored.
ALLOWANCE_LIMIT = 0.1
# A trial's reference output is degenerate when a zero output would match at least this share of its
# elements, or when it is constant (compare's 1% rule): it tests little of what a kernel computes.
DEGENERATE_ZERO_SHARE = 0.95


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


# Elements compared at a time: the comparison works in float64, so a 4 GiB float32 output (KernelBench
# level1_5) compared whole would take tens of GiB of temporaries. On a GPU, slices of 2**25 (256 MB in
# float64) keep it small and each kernel long; on the host, slices of 2**20 (8 MB) stay in the
# allocator's reused blocks and the caches, where 256 MB temporaries were fresh pages every time
# (a 512 MB output took 11 s to compare on two cores, most of it page faults).
CHUNK = {"cuda": 1 << 25, "cpu": 1 << 20}


def _slices(n: int, device) -> Iterator[tuple[int, int]]:
    step = CHUNK["cuda" if torch.device(device).type == "cuda" else "cpu"]
    for start in range(0, n, step):
        yield start, min(n, start + step)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1)


def scale_of(expected: torch.Tensor, device: torch.device | str | None = None) -> float:
    """The root mean square of the reference output's finite values (0 for none)."""
    flat, squares, count = _flat(expected), 0.0, 0
    device = device or flat.device
    for a, b in _slices(flat.numel(), device):
        e = flat[a:b].to(device).double()
        if not bool(torch.isfinite(e).all()):
            e = e[torch.isfinite(e)]
        squares += float(torch.dot(e, e))
        count += e.numel()
    return (squares / count) ** 0.5 if count else 0.0


def compare_outputs(
    got: list[torch.Tensor],
    expected: list[torch.Tensor],
    override: tuple[float, float] | None = None,
    device: torch.device | str | None = None,
    allowance: list[float] | None = None,
) -> Comparison:
    """Compare a candidate's outputs with the reference's, output by output, slice by slice on
    `device` (default: where each expected output is). `allowance`: per output, an absolute amount
    added to every element's bound (`allowances`: the reference's own float32 error, doubled)."""
    if len(got) != len(expected):
        return Comparison(False, f"returned {len(got)} output(s), the reference returns {len(expected)}", 0.0, 0, 0)
    worst, bad, total = 0.0, 0, 0
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        name = "the output" if len(expected) == 1 else f"output {i}"
        if tuple(g.shape) != tuple(e.shape):
            return Comparison(False, f"{name} has shape {tuple(g.shape)}, expected {tuple(e.shape)}", 0.0, 0, 0)
        if g.dtype != e.dtype:
            return Comparison(False, f"{name} has dtype {_dt(g.dtype)}, expected {_dt(e.dtype)}", 0.0, 0, 0)
        if e.is_complex():  # compared as the pairs of reals they are, at their components' tolerance
            g, e = torch.view_as_real(g.detach().resolve_conj()), torch.view_as_real(e.detach().resolve_conj())
        extra = allowance[i] if allowance else 0.0
        result = _compare_one(name, g, e, tolerance_for(e.dtype, override), device or e.device, extra)
        worst, bad, total = max(worst, result.max_abs_error), bad + result.mismatched, total + result.numel
        if not result.ok:
            return Comparison(False, result.message, worst, bad, total)
    return Comparison(True, "", worst, bad, total)


# A fast pass (`surely_passes`) holds every element this far inside its bound, so that its float64
# arithmetic, summed in another order than compare_outputs', cannot pass what compare_outputs fails.
FAST_MARGIN = 0.999


def surely_passes(
    got: list[torch.Tensor],
    expected: list[torch.Tensor],
    override: tuple[float, float] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor | None:
    """A 0-d bool tensor on the device, computed with no wait for it: true only where compare_outputs
    passes these outputs with a margin (every value finite, every element within FAST_MARGIN of its
    bound, and the output not constant where the reference varies). None where this does not apply
    (shapes or dtypes differ, complex outputs, outputs above one slice). A false or None flag decides
    nothing: compare_outputs then judges, with its message. The timed calls are checked this way, all
    of a trip's flags read at once (performance.py): per call, compare_outputs waits on the device
    a dozen times."""
    if len(got) != len(expected):
        return None
    flags = []
    for g, e in zip(got, expected, strict=True):
        if tuple(g.shape) != tuple(e.shape) or g.dtype != e.dtype or e.is_complex():
            return None
        dev = device or e.device
        if e.numel() == 0:
            continue
        if e.numel() > CHUNK["cuda" if torch.device(dev).type == "cuda" else "cpu"]:
            return None
        gf, ef = _flat(g).to(dev), _flat(e).to(dev)
        if not e.is_floating_point():
            flags.append((gf == ef).all())
            continue
        gd, ed = gf.double(), ef.double()
        atol, rtol = tolerance_for(e.dtype, override)
        finite = torch.isfinite(gd).all() & torch.isfinite(ed).all()
        scale = ed.square().mean().sqrt()
        within = ((gd - ed).abs() <= (ed.abs() * rtol + atol * scale) * FAST_MARGIN).all()
        varies = (gd.amax() > gd.amin()) | (ed.amax() <= ed.amin())  # compare's constant rule, strictly
        flags.append(finite & within & varies)
    if not flags:
        return torch.tensor(True)
    return torch.stack(flags).all()


def _compare_one(
    name: str, got: torch.Tensor, exp: torch.Tensor, tol: tuple[float, float], device, allowance: float = 0.0
) -> Comparison:
    n = exp.numel()
    if n == 0:
        return Comparison(True, "", 0.0, 0, 0)
    flat_g, flat_e, shape = _flat(got), _flat(exp), exp.shape
    if not (exp.is_floating_point() or exp.is_complex()):
        count, first = 0, None
        for a, b in _slices(n, device):
            wrong = flat_g[a:b].to(device) != flat_e[a:b].to(device)
            k = int(wrong.sum())
            if k and first is None:
                first = a + int(wrong.nonzero()[0, 0])
            count += k
        if count:
            idx = _unravel(first, shape)
            return Comparison(
                False,
                f"{name}: {count} of {n} elements differ (must match exactly); first at "
                f"{idx}: got {flat_g[first].item()}, expected {flat_e[first].item()}",
                float("inf"),
                count,
                n,
            )
        return Comparison(True, "", 0.0, 0, n)
    atol, rtol = tol
    scale = scale_of(exp, device)
    floor = atol * scale + allowance  # the bound's absolute part
    nans, first_nan, count, max_err, worst_wrong, worst_at = 0, None, 0, 0.0, -1.0, 0
    e_min, e_max, e_absmax, g_first, g_constant = float("inf"), float("-inf"), 0.0, None, True
    for a, b in _slices(n, device):
        g, e = flat_g[a:b].to(device).double(), flat_e[a:b].to(device).double()
        if bool(torch.isfinite(g).all()) and bool(torch.isfinite(e).all()):
            # Every value finite (the common case): no NaN or infinity to place, a third of the passes.
            diff = (g - e).abs_()
            wrong = diff > e.abs().mul_(rtol).add_(floor)
            e_lo, e_hi = (float(v) for v in torch.aminmax(e))
            e_min, e_max = min(e_min, e_lo), max(e_max, e_hi)
            e_absmax = max(e_absmax, abs(e_lo), abs(e_hi))
        else:
            nan = torch.isnan(g)
            k = int(nan.sum())
            if k and first_nan is None:
                first_nan = a + int(nan.nonzero()[0, 0])
            nans += k
            diff = (g - e).abs()
            same_inf = torch.isinf(e) & (g == e)
            diff = torch.where(same_inf, torch.zeros_like(diff), diff)
            diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
            bound = floor + rtol * e.abs().nan_to_num(posinf=0.0, neginf=0.0)
            wrong = (diff > bound) | (torch.isinf(g) & ~same_inf)
            finite = e[torch.isfinite(e)]
            if finite.numel():
                e_min, e_max = min(e_min, float(finite.min())), max(e_max, float(finite.max()))
                e_absmax = max(e_absmax, float(finite.abs().max()))
        k = int(wrong.sum())
        count += k
        max_err = max(max_err, float(diff.max()))
        if k:
            masked = diff.masked_fill(~wrong, -1.0)
            at = int(masked.argmax())
            if float(masked[at]) > worst_wrong:
                worst_wrong, worst_at = float(masked[at]), a + at
        g_first = float(g[0]) if g_first is None else g_first
        if g_constant:
            g_lo, g_hi = torch.aminmax(g)
            g_constant = float(g_lo) == g_first == float(g_hi) or bool((g == g_first).all())
    if nans:
        return Comparison(
            False,
            f"{name} contains {nans} NaN value(s) (first at {_unravel(first_nan, shape)}); NaN never passes",
            float("nan"),
            nans,
            n,
        )
    if count:
        idx = _unravel(worst_at, shape)
        return Comparison(
            False,
            f"{name}: {count} of {n} elements outside tolerance (atol={atol:g} x the output's "
            f"scale {scale:.3g}, rtol={rtol:g}{_allowed(allowance)}); max abs error {max_err:.4g} at {idx}: "
            f"got {flat_g[worst_at].item():.6g}, expected {flat_e[worst_at].item():.6g}",
            max_err,
            count,
            n,
        )
    # A constant output (every element equal) fails where the reference's finite values span more
    # than 1% of the tolerance bound.
    spread = 0.01 * (floor + rtol * e_absmax) if e_max >= e_min else 0.0
    varies = e_max >= e_min and e_max - e_min > spread and n > 1
    if varies and g_constant:
        return Comparison(
            False, f"{name} is constant ({g_first:.6g} everywhere), the reference's is not", max_err, n, n
        )
    return Comparison(True, "", max_err, 0, n)


def _allowed(allowance: float) -> str:
    return f", plus {allowance:.3g} for the reference's own float32 error" if allowance else ""


def allowances(expected: list[torch.Tensor], exact: list[torch.Tensor], device=None) -> list[float]:
    """Per output, ALLOWANCE_FACTOR times the largest distance between the reference's outputs and a
    float64 run's (`exact`), over the elements finite in both (0 for integer outputs)."""
    out = []
    for e, x in zip(expected, exact, strict=True):
        worst, flat_e, flat_x = 0.0, _flat(e), _flat(x)
        if e.is_floating_point():
            for a, b in _slices(flat_e.numel(), device or e.device):
                d = (flat_e[a:b].to(device or e.device).double() - flat_x[a:b].to(device or e.device).double()).abs()
                d = d[torch.isfinite(d)]
                worst = max(worst, float(d.max()) if d.numel() else 0.0)
        out.append(ALLOWANCE_FACTOR * worst)
    return out


def move_ratio(
    before: list[torch.Tensor], after: list[torch.Tensor], override: tuple[float, float] | None = None, device=None
) -> float:
    """How many tolerance bounds the reference's output moved from `before` to `after`: the largest
    |after - before| / (atol·scale + rtol·|after|) over the elements (bounds of `after`'s trial); an
    exact (integer) output that changed anywhere moved infinitely far."""
    worst = 0.0
    for b, a in zip(before, after, strict=True):
        flat_b, flat_a, where = _flat(b), _flat(a), device or a.device
        if not a.is_floating_point():
            if any(bool((flat_a[s:t].to(where) != flat_b[s:t].to(where)).any()) for s, t in _slices(a.numel(), where)):
                return float("inf")
            continue
        atol, rtol = tolerance_for(a.dtype, override)
        scale = scale_of(a, where)
        for s, t in _slices(a.numel(), where):
            x, y = flat_a[s:t].to(where).double(), flat_b[s:t].to(where).double()
            diff = (x - y).abs().nan_to_num(nan=0.0, posinf=0.0)
            bound = x.abs().nan_to_num(posinf=0.0).mul_(rtol).add_(atol * scale)
            moved = diff / bound
            moved = torch.where(bound > 0, moved, torch.where(diff > 0, float("inf"), 0.0))
            worst = max(worst, float(moved.max()) if moved.numel() else 0.0)
    return worst


def degeneracy(expected: list[torch.Tensor], override: tuple[float, float] | None = None, device=None) -> str:
    """Why a trial's reference output tests little ("" when it does not): a constant output (the
    comparison's 1% rule), or one a zero output would match at DEGENERATE_ZERO_SHARE of its elements
    (randn's cumprod: its products underflow after ~100 factors)."""
    for i, e in enumerate(expected):
        if not e.is_floating_point() or e.numel() < 2:
            continue
        name = "the output" if len(expected) == 1 else f"output {i}"
        atol, rtol = tolerance_for(e.dtype, override)
        where = device or e.device
        scale, zeros, lo, hi, absmax = scale_of(e, where), 0, float("inf"), float("-inf"), 0.0
        for a, b in _slices(e.numel(), where):
            v = _flat(e)[a:b].to(where).double()
            v = v[torch.isfinite(v)]
            if not v.numel():
                continue
            zeros += int((v.abs() * (1.0 - rtol) <= atol * scale).sum())
            v_lo, v_hi = (float(t) for t in torch.aminmax(v))
            lo, hi, absmax = min(lo, v_lo), max(hi, v_hi), max(absmax, abs(v_lo), abs(v_hi))
        if hi >= lo and hi - lo <= 0.01 * (atol * scale + rtol * absmax):
            return f"{name} is constant up to 1% of the tolerance bound"
        if zeros >= DEGENERATE_ZERO_SHARE * e.numel():
            return f"{zeros / e.numel():.1%} of {name} is within tolerance of 0"
    return ""


def _unravel(flat: int, shape) -> tuple[int, ...]:
    idx = []
    for size in reversed(list(shape)):
        idx.append(flat % size)
        flat //= size
    return tuple(reversed(idx))


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
