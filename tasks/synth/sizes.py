"""The size constants of a synthesized task and their values under each shape assignment.

Every size constant takes one value per *environment*: `primary` (the module defaults, the `cuda`
sizes), `cpu` (`KILN_CPU_SHAPES`) and `alt0`/`alt1` (`KILN_ALT_SHAPES`, small odd sizes). An op is
admitted into a graph only if its shapes are valid in every environment, so all four assignments of
the emitted file are valid by construction. Each constant has a role (batch, features, channels,
...) that fixes the ranges its values are drawn from; a `groups` constant is derived: in each
environment it is a divisor of the channel count it splits.

After a graph is sampled, `fit` shrinks the values of one environment until the graph's estimated
cost fits that environment's budget (GPU-sized work that still stays well under 50 ms on an H100 for
`primary`; a naive single-threaded C++ loop in tens of milliseconds for `cpu` and the alts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from random import Random

from tasks.synth.dims import Dim, Var, evaluate

ENVS = ("primary", "cpu", "alt0", "alt1")
ALT_ENVS = ("alt0", "alt1")


@dataclass(frozen=True)
class Role:
    name: str  # base name of the module constant ("dim" -> dim, dim_2, ...)
    primary: tuple[int, ...]  # values drawn for the cuda sizes
    cpu: tuple[int, ...]  # values drawn for KILN_CPU_SHAPES
    alt: tuple[int, ...]  # small odd, non-power-of-two values for KILN_ALT_SHAPES
    floor: int  # fit() never shrinks a value below this


ROLES = {
    "batch": Role("batch_size", (8, 16, 32, 64, 128), (2, 3, 4), (1, 3, 5), 1),
    # the leading axis of a 2-D input: a batch of rows, large like KernelBench's level-1 batches
    "rows": Role("batch_size", (512, 1024, 2048, 4096), (8, 16, 32), (3, 5, 7, 9), 1),
    "features": Role(
        "dim", (256, 384, 512, 768, 1024, 2048, 4096), (32, 48, 64, 96, 128), (17, 23, 33, 37, 45, 57, 71), 4
    ),
    "seq": Role("seq_len", (64, 128, 256, 512, 1024), (8, 12, 16, 24, 32), (5, 7, 9, 13, 19), 2),
    "channels": Role("channels", (16, 32, 64, 96, 128, 256), (4, 6, 8, 12, 16), (3, 5, 7, 11), 2),
    "height": Role("height", (32, 48, 64, 96, 128, 224), (12, 16, 20, 24, 32), (9, 11, 13, 17, 19, 23), 4),
    "width": Role("width", (32, 48, 64, 96, 128, 224), (12, 16, 20, 24, 32), (9, 11, 13, 17, 19, 23), 4),
    "length": Role("length", (512, 1024, 2048, 4096, 8192), (32, 64, 96, 128, 256), (19, 29, 41, 53, 77), 8),
    "groups": Role("groups", (), (), (), 1),  # derived: see group_count()
}


@dataclass(frozen=True)
class Budget:
    flops: float  # estimated floating-point operations of one forward pass
    bytes: float  # float32 bytes of every tensor of the graph (inputs, intermediates, parameters)


# primary: enough work per kernel that a launch is not all there is, and an eager forward far under
# 50 ms and 2 GB on an H100. cpu/alt: a naive single-threaded C++ loop in tens of milliseconds.
BUDGETS = {
    "primary": Budget(flops=5e10, bytes=1.5e9),
    "cpu": Budget(flops=2e7, bytes=8e6),
    "alt0": Budget(flops=2e7, bytes=8e6),
    "alt1": Budget(flops=2e7, bytes=8e6),
}


@dataclass
class SizeVar:
    role: str
    values: dict[str, int]  # environment -> value
    divides: Dim | None = None  # for a groups constant: the channel count it must divide


@dataclass
class SizeTable:
    vars: list[SizeVar] = field(default_factory=list)

    def new(self, role: str, rng: Random) -> Var:
        spec = ROLES[role]
        values = {"primary": rng.choice(spec.primary), "cpu": rng.choice(spec.cpu)}
        alts = rng.sample(spec.alt, 2)
        values.update(zip(ALT_ENVS, alts, strict=True))
        self.vars.append(SizeVar(role, values))
        return Var(len(self.vars) - 1)

    def new_groups(self, channels: Dim) -> Var:
        """A group count for a channel dimension: in each environment a divisor of its value."""
        self.vars.append(SizeVar("groups", {}, divides=channels))
        var = Var(len(self.vars) - 1)
        for env in ENVS:
            self.refresh(env)
        return var

    def env(self, env: str) -> dict[int, int]:
        return {i: v.values[env] for i, v in enumerate(self.vars)}

    def refresh(self, env: str) -> None:
        """Recompute the derived (groups) values of one environment from the others."""
        for v in self.vars:
            if v.divides is not None:
                v.values[env] = group_count(evaluate(v.divides, self.env_partial(env)))

    def env_partial(self, env: str) -> dict[int, int]:
        return {i: v.values[env] for i, v in enumerate(self.vars) if env in v.values}

    def truncate(self, n: int) -> None:
        del self.vars[n:]


def group_count(channels: int) -> int:
    """The largest divisor of `channels` up to 8 that leaves at least two channels per group (so a
    group never normalises a single value), else 1."""
    for g in range(min(8, channels // 2), 1, -1):
        if channels % g == 0:
            return g
    return 1


# The primary sizes grow until the graph's largest tensor has at least this many elements, so that a
# GPU kernel for it is not all launch overhead (budget permitting).
PRIMARY_MIN_ELEMENTS = 2**21
GROW_CAP = 16384  # no size constant grows beyond this


@dataclass(frozen=True)
class Cost:
    flops: int
    bytes: int
    largest: int  # elements of the largest tensor

    def within(self, budget: Budget) -> bool:
        return self.flops <= budget.flops and self.bytes <= budget.bytes


def fit(
    table: SizeTable, env: str, cost: Callable[[dict[int, int]], Cost], valid: Callable[[dict[int, int]], bool]
) -> bool:
    """Halve the largest shrinkable value of `env` until the graph's cost fits the environment's
    budget while every shape stays valid (False when no shrink gets there); then, for `primary`,
    double the smallest values while the largest tensor is under PRIMARY_MIN_ELEMENTS and the budget
    allows."""
    if not _shrink(table, env, cost, valid):
        return False
    if env == "primary":
        _grow(table, env, cost)
    return True


def _grow(table: SizeTable, env: str, cost: Callable[[dict[int, int]], Cost]) -> None:
    budget = BUDGETS[env]
    for _ in range(64):
        if cost(table.env(env)).largest >= PRIMARY_MIN_ELEMENTS:
            return
        order = sorted(
            (i for i, v in enumerate(table.vars) if v.divides is None and v.values[env] * 2 <= GROW_CAP),
            key=lambda i: (table.vars[i].values[env], i),
        )
        for i in order:
            var = table.vars[i]
            var.values[env] *= 2
            table.refresh(env)
            if cost(table.env(env)).within(budget):
                break
            var.values[env] //= 2
            table.refresh(env)
        else:
            return


def _shrink(
    table: SizeTable, env: str, cost: Callable[[dict[int, int]], Cost], valid: Callable[[dict[int, int]], bool]
) -> bool:
    budget = BUDGETS[env]
    for _ in range(256):
        if cost(table.env(env)).within(budget):
            return True
        order = sorted(
            (i for i, v in enumerate(table.vars) if v.divides is None), key=lambda i: (-table.vars[i].values[env], i)
        )
        for i in order:
            var = table.vars[i]
            old = var.values[env]
            new = max(ROLES[var.role].floor, old // 2)
            if new == old:
                continue
            var.values[env] = new
            table.refresh(env)
            if valid(table.env(env)):
                break
            var.values[env] = old
            table.refresh(env)
        else:
            return False
    return False
