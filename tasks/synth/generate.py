"""`synthesize`: sample graphs until `count` tasks pass every filter, and write them.

Each attempt k draws its graph from its own random stream, seeded by (seed, k), so what attempt k
produces does not depend on what earlier attempts did, and a seed's output is byte-identical from
run to run. An attempt becomes a task only after passing, in order:

    sampling      the graph has a compute op            (else "no-graph")
    sizing        every environment fits its budget     (else "over-budget")
    dedup         its canonical hash is new in this run (else "duplicate")
    exclusion     it matches no --exclude task          (else counted as excluded, by match kind)
    checks        the CPU checks of checks.py           (else their reason)

Accepted tasks go to `<out>/level<L>/synth<seed>_<k>_<ops>.py` (the layout tasks.loader reads, so
`replay.tasks=<out>` serves them), with `<out>/synth_manifest.json` listing them and the counts.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from random import Random

from tasks.synth import emit as emitter
from tasks.synth.canonical import canonical_hash
from tasks.synth.checks import PRIMARY_RUN, check_task
from tasks.synth.decontam import ExcludeIndex, build_index
from tasks.synth.levels import level_of
from tasks.synth.ops import FAMILIES, REGISTRY, resolve_ops
from tasks.synth.sampler import fit_sizes, sample_graph

MAX_OPS_LIMIT = 16
MANIFEST = "synth_manifest.json"


class SynthError(ValueError):
    """A bad request (count, ops, output or exclude directory): reported as one line."""


@dataclass(frozen=True)
class SynthConfig:
    out: Path  # directory to write; must be empty or absent
    count: int  # tasks to write
    seed: int  # the same seed writes byte-identical files
    ops: tuple[str, ...] = ()  # family or op names to draw from (empty: all)
    max_ops: int = 6  # most nodes per graph
    exclude: tuple[Path, ...] = ()  # task directories whose graphs must not be generated
    max_attempts: int = 0  # graphs to sample before giving up (0: 40 per task + 200)


@dataclass(frozen=True)
class WrittenTask:
    file: str  # path relative to the output directory
    level: int
    ops: tuple[str, ...]
    families: tuple[str, ...]
    graph_hash: str
    primary_check: str  # PRIMARY_RUN, or what was done instead and why


@dataclass
class SynthReport:
    config: SynthConfig
    tasks: list[WrittenTask] = field(default_factory=list)
    attempts: int = 0
    rejected: Counter = field(default_factory=Counter)  # reason -> graphs
    excluded: Counter = field(default_factory=Counter)  # "structure"/"source" -> graphs
    exclude_files: int = 0
    exclude_untraced: dict[str, str] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.tasks) == self.config.count

    def levels(self) -> Counter:
        return Counter(t.level for t in self.tasks)

    def family_ops(self) -> Counter:
        """Op occurrences per family over all written tasks."""
        return Counter(f for t in self.tasks for f in t.families)

    def family_tasks(self) -> Counter:
        """Tasks containing at least one op of each family."""
        return Counter(f for t in self.tasks for f in set(t.families))

    def manifest(self) -> dict:
        cfg = self.config
        return {
            "seed": cfg.seed,
            "count": cfg.count,
            "ops": list(cfg.ops),
            "max_ops": cfg.max_ops,
            "exclude": [str(p) for p in cfg.exclude],
            "attempts": self.attempts,
            "levels": {str(k): v for k, v in sorted(self.levels().items())},
            "rejected": dict(sorted(self.rejected.items())),
            "excluded": dict(sorted(self.excluded.items())),
            "tasks": [asdict(t) for t in self.tasks],
        }

    def summary(self) -> list[str]:
        cfg = self.config
        lines = [
            (
                f"wrote {len(self.tasks)} of {cfg.count} tasks to {cfg.out} (seed {cfg.seed}, "
                f"{self.attempts} graphs sampled)"
            )
        ]
        lines.append("levels: " + ", ".join(f"L{k} {v}" for k, v in sorted(self.levels().items())))
        ops, tasks = self.family_ops(), self.family_tasks()
        lines.append("families (ops / tasks): " + ", ".join(f"{f} {ops[f]}/{tasks[f]}" for f in FAMILIES if ops[f]))
        lines.append("rejected: " + (", ".join(f"{k} {v}" for k, v in sorted(self.rejected.items())) or "none"))
        if cfg.exclude:
            how = ", ".join(f"{v} by {k}" for k, v in sorted(self.excluded.items()))
            lines.append(
                f"excluded: {sum(self.excluded.values())}{f' ({how})' if how else ''}, matching "
                f"against {self.exclude_files} files ({len(self.exclude_untraced)} not traceable: "
                "matched by normalised source only)"
            )
        on_cpu = sum(t.primary_check == PRIMARY_RUN for t in self.tasks)
        lines.append(
            f"primary shapes run on CPU for {on_cpu} of {len(self.tasks)} tasks (the rest are over the "
            "CPU check budget: run on the meta device, shapes only)"
        )
        return lines


def validate(cfg: SynthConfig) -> None:
    if cfg.count < 1:
        raise SynthError(f"--count must be at least 1, got {cfg.count}")
    if not 1 <= cfg.max_ops <= MAX_OPS_LIMIT:
        raise SynthError(f"--max-ops must be in 1..{MAX_OPS_LIMIT}, got {cfg.max_ops}")
    if cfg.out.exists() and (not cfg.out.is_dir() or any(cfg.out.iterdir())):
        raise SynthError(f"--out {cfg.out} exists and is not an empty directory")
    for path in cfg.exclude:
        if not path.exists():
            raise SynthError(f"--exclude {path}: no such file or directory")


def synthesize(cfg: SynthConfig) -> SynthReport:
    validate(cfg)
    ops = resolve_ops(cfg.ops)  # raises OpSelectionError (a ValueError) with the valid names
    index = build_index(list(cfg.exclude)) if cfg.exclude else None
    report = SynthReport(cfg)
    if index is not None:
        report.exclude_files, report.exclude_untraced = index.files, dict(index.untraced)
    seen: set[str] = set()
    attempts = cfg.max_attempts or 40 * cfg.count + 200
    cfg.out.mkdir(parents=True, exist_ok=True)
    for attempt in range(attempts):
        if report.complete:
            break
        report.attempts = attempt + 1
        written = _attempt(cfg, attempt, ops, index, seen, report)
        if written is not None:
            report.tasks.append(written)
    (cfg.out / MANIFEST).write_text(json.dumps(report.manifest(), indent=1) + "\n", encoding="utf-8")
    return report


def _attempt(
    cfg: SynthConfig, attempt: int, ops, index: ExcludeIndex | None, seen: set[str], report: SynthReport
) -> WrittenTask | None:
    rng = Random(f"kiln-tasks-synth:{cfg.seed}:{attempt}")
    graph = sample_graph(rng, ops, cfg.max_ops)
    if graph is None:
        report.rejected["no-graph"] += 1
        return None
    if not fit_sizes(graph):
        report.rejected["over-budget"] += 1
        return None
    graph_hash = canonical_hash(graph)
    if graph_hash in seen:
        report.rejected["duplicate"] += 1
        return None
    op_names = tuple(n.op for n in graph.nodes)
    families = tuple(REGISTRY[n].family for n in op_names)
    level = level_of(list(zip(op_names, families, strict=True)))
    source = emitter.emit(graph, emitter.TaskHeader(cfg.seed, graph_hash, level))
    rel = f"level{level.level}/synth{cfg.seed}_{len(report.tasks):03d}_{_slug(op_names)}.py"
    if index is not None:
        hit = index.match(source, rel)
        if hit is not None:
            report.excluded[hit[0]] += 1
            return None
    result = check_task(source, rel, graph, emitter.size_names(graph), seed=_check_seed(cfg.seed, attempt))
    if not result.passed:
        report.rejected[result.reason] += 1
        return None
    seen.add(graph_hash)
    path = cfg.out / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source, encoding="utf-8")
    return WrittenTask(rel, level.level, op_names, families, graph_hash, result.primary)


def _slug(op_names: tuple[str, ...]) -> str:
    return "_".join(dict.fromkeys(op_names[:3]))


def _check_seed(seed: int, attempt: int) -> int:
    return Random(f"kiln-tasks-synth-check:{seed}:{attempt}").randrange(2**31)
