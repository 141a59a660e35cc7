"""The placement plan: which GPU every learner rank, rollout engine and verifier actor gets, and
whether the model fits. `kiln train --dry-run` prints it; the driver computes it once and builds its
Ray placement group from it. An infeasible config fails here, before any actor starts, with a
`PlanError` that says why.

GPU ids are logical (0 .. N-1 over the whole Ray cluster). The plan's GPU slots become the bundles of
one Ray placement group (`bundles`: one bundle per GPU, or per engine when a tensor-parallel engine
spans several), and every actor is scheduled into the bundle of its GPUs (`actor_slot`), so Ray maps
the plan's GPUs to nodes and devices and nothing else chooses. Sharing a GPU is a fractional share
of its bundle (`gpu_fraction`: 1 / residents of that GPU).

Layouts: `cpu` (nothing needs a GPU: torch learner and engines on CPU, cpu verifier backend);
`disaggregated` (engines on GPUs 0.., learner after them, dedicated verifier GPUs last);
`colocated` (engines on the learner's GPUs, which they release around learner steps).

Whether the roles fit a GPU's memory comes from the memory model in launch/driver/model_memory.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from actors.base import Slot
from actors.verifier.workers import CompileWorkers, RunWorkers, compile_workers, run_workers
from configs import KilnConfig
from launch.driver.model_memory import GIB, MemoryEstimate, ModelShape, PlanError, memory_estimate, model_shape


@dataclass(frozen=True)
class LearnerRank:
    rank: int  # global rank; Megatron's order: tp fastest, then dp, then pp
    tp: int
    pp: int
    dp: int
    gpu: int | None  # None = CPU
    gpu_fraction: float


@dataclass(frozen=True)
class EngineSlot:
    index: int
    gpus: tuple[int, ...]  # empty = CPU or external
    gpu_fraction: float
    external_url: str = ""  # served outside Kiln (rollout.sglang.urls)


@dataclass(frozen=True)
class VerifierSlot:
    index: int
    gpus: tuple[int, ...]  # its GPUs, one sandbox worker pinned to each by default; () = cpu backend
    gpu_fraction: float
    shared: bool  # on a GPU that also hosts engines or learner ranks
    compile_workers: CompileWorkers  # resolved on the machine that plans (0 = its cores ÷ verifier actors)
    run_workers: RunWorkers  # its sandbox workers, each by its GPU's position in `gpus`


@dataclass(frozen=True)
class GpuLoad:
    gpu: int
    residents: tuple[str, ...]
    need_gib: float
    how: str  # how need_gib was summed


@dataclass(frozen=True)
class GpuBundle:
    """One bundle of the run's Ray placement group: the logical GPUs of one GPU slot, reserved together."""

    index: int
    gpus: tuple[int, ...]  # one GPU, or all GPUs of an engine that spans several (SGLang TP)

    @property
    def resources(self) -> dict[str, float]:
        return {"GPU": float(len(self.gpus))}


@dataclass(frozen=True)
class PlacementPlan:
    layout: Literal["cpu", "colocated", "disaggregated"]
    model: ModelShape
    learner_backend: str
    learner: tuple[LearnerRank, ...]
    engines: tuple[EngineSlot, ...]
    verifiers: tuple[VerifierSlot, ...]
    gpus_needed: int
    gpus_available: int | None
    gpu_memory_gb: float | None
    memory: MemoryEstimate
    gpus: tuple[GpuLoad, ...]


def plan(
    cfg: KilnConfig, *, gpus_available: int | None = None, gpu_memory_gb: float | None = None, check_fit: bool = True
) -> PlacementPlan:
    """Place every actor of `cfg` on logical GPUs and check that it fits. `gpus_available` and
    `gpu_memory_gb` default to cluster.num_gpus and cluster.gpu_memory_gb; None skips that check, and
    so does check_fit=False (the driver's GPU shares, read from a plan already checked)."""
    if gpus_available is None and check_fit:
        gpus_available = cfg.cluster.num_gpus
    if gpu_memory_gb is None and check_fit:
        gpu_memory_gb = cfg.cluster.gpu_memory_gb
    shape = model_shape(cfg.model)
    tp, pp, dp = _check_learner(cfg, shape)
    engine_gpus = _check_engines(cfg, shape)
    _check_verifier(cfg)
    c = cfg.cluster
    external = bool(cfg.rollout.engine == "sglang" and cfg.rollout.sglang.urls)
    uses_gpus = c.learner_gpus or c.verifier_gpus or (engine_gpus and not external) or cfg.verifier.backend != "cpu"
    layout = "cpu" if not uses_gpus else c.layout

    learner_ids, engine_ids, verifier_ids = _assign_gpus(cfg, layout, engine_gpus, external)
    needed = len(set(learner_ids) | {g for ids in engine_ids for g in ids} | set(verifier_ids))
    if gpus_available is not None and needed > gpus_available:
        raise PlanError(
            f"this config needs {needed} GPUs ({_gpu_count_story(cfg, layout, engine_gpus, external)}) "
            f"but {gpus_available} are available; lower cluster.learner_gpus / rollout.num_actors / "
            f"cluster.verifier_gpus, or use cluster.layout=colocated"
        )
    verifier_gpu = _verifier_gpus(cfg, layout, learner_ids, engine_ids, verifier_ids)
    residents = _residents(learner_ids, engine_ids, verifier_gpu)
    learner, engines, verifiers = _slots(
        cfg, (tp, pp, dp), residents, learner_ids, engine_ids, verifier_gpu, verifier_ids, external
    )

    memory = memory_estimate(cfg, shape, tp, pp, dp, engine_gpus)
    loads = tuple(_gpu_load(gpu, tuple(residents[gpu]), memory, layout) for gpu in sorted(residents))
    result = PlacementPlan(
        layout=layout,
        model=shape,
        learner_backend=cfg.learner.backend,
        learner=learner,
        engines=engines,
        verifiers=verifiers,
        gpus_needed=needed,
        gpus_available=gpus_available,
        gpu_memory_gb=gpu_memory_gb,
        memory=memory,
        gpus=loads,
    )
    if gpu_memory_gb is not None:
        _check_memory(result, gpu_memory_gb)
    return result


def local_gpus() -> tuple[int, float | None]:
    """GPUs visible to this process and the memory of the first, in GiB (0, None without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return 0, None
    return torch.cuda.device_count(), torch.cuda.get_device_properties(0).total_memory / GIB


# --------------------------------------------------------------------------- Ray placement


def bundles(p: PlacementPlan) -> tuple[GpuBundle, ...]:
    """The placement group's bundles: the GPUs of the plan, grouped so that the GPUs of one engine
    (tensor parallel) are one bundle and every other GPU is a bundle of its own, in GPU order."""
    groups: list[set[int]] = [{g} for g in sorted(load.gpu for load in p.gpus)]
    for engine in p.engines:
        if len(engine.gpus) > 1:
            joined = [g for g in groups if g & set(engine.gpus)]
            groups = [g for g in groups if not g & set(engine.gpus)] + [set().union(*joined)]
    ordered = sorted(groups, key=min)
    return tuple(GpuBundle(index=i, gpus=tuple(sorted(g))) for i, g in enumerate(ordered))


def actor_slot(p: PlacementPlan, role: str, index: int) -> Slot:
    """Where actor `index` of `role` ("learner" rank, "rollout" engine, "verifier") runs: its GPUs, its
    share of them, and its bundle (None without a GPU: CPU, or an external SGLang server)."""
    if role == "learner":
        r = p.learner[index]
        gpus, share = (() if r.gpu is None else (r.gpu,)), r.gpu_fraction
    elif role == "rollout":
        e = p.engines[index]
        gpus, share = (() if e.external_url else e.gpus), e.gpu_fraction
    elif role == "verifier":
        v = p.verifiers[index]
        gpus, share = v.gpus, v.gpu_fraction
    else:
        return Slot()
    if not gpus:
        return Slot()
    bundle = next(b.index for b in bundles(p) if gpus[0] in b.gpus)
    residents = next(load.residents for load in p.gpus if load.gpu == gpus[0])
    colocated = (
        p.layout == "colocated"
        and any(r.startswith("learner") for r in residents)
        and any(r.startswith("engine") for r in residents)
    )
    return Slot(gpus=tuple(gpus), num_gpus=share * len(gpus), bundle=bundle, colocated=colocated)


# ------------------------------------------------------------------------------------ checks


def learner_ranks(cfg: KilnConfig) -> int:
    """Processes the learner runs as: one per learner GPU, else `learner.cpu_ranks` (CPU, gloo)."""
    return cfg.cluster.learner_gpus or cfg.learner.cpu_ranks


def _check_learner(cfg: KilnConfig, shape: ModelShape) -> tuple[int, int, int]:
    lc, gpus = cfg.learner, cfg.cluster.learner_gpus
    tp, pp = lc.tensor_parallel, lc.pipeline_parallel
    ranks = learner_ranks(cfg)
    if ranks > 1 and not cfg.cluster.use_ray:
        raise PlanError(f"a learner of {ranks} ranks runs one process per rank: it needs cluster.use_ray=true")
    if ranks > 1 and cfg.cluster.layout == "colocated":
        raise PlanError(
            f"cluster.layout=colocated runs one learner rank, got {ranks}: Ray may pack two ranks' "
            "fractional GPU shares onto one GPU, where NCCL refuses two ranks; use disaggregated"
        )
    if gpus and lc.cpu_ranks > 1:
        raise PlanError(
            f"learner.cpu_ranks={lc.cpu_ranks} is for a CPU learner; with cluster.learner_gpus={gpus} "
            "the learner has one rank per GPU"
        )
    if lc.backend == "torch":
        if tp > 1 or pp > 1:
            raise PlanError(
                f"learner.tensor_parallel={tp} / pipeline_parallel={pp} need learner.backend=megatron; "
                "the torch learner is data-parallel only (one full replica per rank)"
            )
        return 1, 1, ranks
    if gpus == 0:
        raise PlanError(
            f"learner.backend=megatron needs GPUs: set cluster.learner_gpus to a multiple of TP×PP = {tp * pp}"
        )
    if gpus % (tp * pp):
        raise PlanError(
            f"cluster.learner_gpus={gpus} is not divisible by learner.tensor_parallel × "
            f"pipeline_parallel = {tp}×{pp} = {tp * pp} (DP = learner_gpus / (TP·PP))"
        )
    for what, heads in (("num_heads", shape.heads), ("num_kv_heads", shape.kv_heads)):
        if heads % tp:
            raise PlanError(
                f"learner.tensor_parallel={tp} must divide the model's {what}={heads} "
                f"(attention heads are split across TP ranks)"
            )
    if shape.layers % pp:
        raise PlanError(f"learner.pipeline_parallel={pp} must divide the model's num_layers={shape.layers}")
    return tp, pp, gpus // (tp * pp)


def _check_engines(cfg: KilnConfig, shape: ModelShape) -> int:
    """GPUs per engine (0 = CPU or external servers)."""
    ro, per_engine = cfg.rollout, cfg.cluster.engine_gpus
    if ro.engine == "torch" and per_engine > 1:
        raise PlanError(
            f"cluster.engine_gpus={per_engine}: the embedded torch engine runs on one device; "
            "use rollout.engine=sglang for tensor-parallel engines"
        )
    if ro.engine == "sglang" and not ro.sglang.urls:
        if per_engine == 0:
            raise PlanError(
                "rollout.engine=sglang launches SGLang servers, which need GPUs: set "
                f"cluster.engine_gpus={ro.sglang.tp_size} (= rollout.sglang.tp_size), or give "
                "rollout.sglang.urls of running servers"
            )
        if per_engine != ro.sglang.tp_size:
            raise PlanError(
                f"cluster.engine_gpus={per_engine} must equal rollout.sglang.tp_size="
                f"{ro.sglang.tp_size}: each launched SGLang server spans its engine's GPUs"
            )
    if per_engine and shape.heads % per_engine:
        raise PlanError(f"cluster.engine_gpus={per_engine} (engine TP) must divide the model's num_heads={shape.heads}")
    return per_engine


def _check_verifier(cfg: KilnConfig) -> None:
    c = cfg.cluster
    if cfg.verifier.remote:  # a verifier service verifies: the run places no verifier of its own
        if c.verifier_gpus:
            raise PlanError(
                f"verifier.remote={cfg.verifier.remote}: the run starts no verifier actor; set "
                f"cluster.verifier_gpus=0 (it is {c.verifier_gpus})"
            )
        return
    if cfg.verifier.backend == "cpu":
        if c.verifier_gpus:
            raise PlanError(
                f"verifier.backend=cpu needs no GPUs; set cluster.verifier_gpus=0 "
                f"(it is {c.verifier_gpus}) or verifier.backend=cuda"
            )
        return
    if c.verifier_gpus > cfg.verifier.num_actors:
        raise PlanError(
            f"cluster.verifier_gpus={c.verifier_gpus} exceeds verifier.num_actors="
            f"{cfg.verifier.num_actors}: a GPU without a verifier actor would sit idle"
        )
    has_other = c.learner_gpus or (c.engine_gpus and not cfg.rollout.sglang.urls)
    if c.verifier_gpus == 0 and not has_other:
        raise PlanError(
            f"verifier.backend={cfg.verifier.backend} runs candidates on a GPU: set "
            "cluster.verifier_gpus, or give the engines or the learner GPUs to share"
        )


def _assign_gpus(cfg: KilnConfig, layout: str, engine_gpus: int, external: bool):
    """Logical GPU ids: (learner ids per rank, engine ids per engine, dedicated verifier ids)."""
    c, n_engines = cfg.cluster, cfg.rollout.num_actors
    if layout == "cpu":
        return [], [], []
    engine_total = 0 if external else n_engines * engine_gpus
    if layout == "colocated" and engine_total:
        if c.learner_gpus == 0:
            raise PlanError(
                "cluster.layout=colocated puts engines on the learner's GPUs, but "
                "cluster.learner_gpus=0; give the learner GPUs or use disaggregated"
            )
        if engine_total > c.learner_gpus:
            raise PlanError(
                f"cluster.layout=colocated: {n_engines} engines × {engine_gpus} GPUs = {engine_total} "
                f"do not fit on the learner's {c.learner_gpus} GPUs"
            )
        learner_ids = list(range(c.learner_gpus))
        engine_ids = [list(range(i * engine_gpus, (i + 1) * engine_gpus)) for i in range(n_engines)]
        first_free = c.learner_gpus
    else:
        engine_ids = (
            [list(range(i * engine_gpus, (i + 1) * engine_gpus)) for i in range(n_engines)] if engine_total else []
        )
        learner_ids = list(range(engine_total, engine_total + c.learner_gpus))
        first_free = engine_total + c.learner_gpus
    verifier_ids = list(range(first_free, first_free + c.verifier_gpus)) if cfg.verifier.backend != "cpu" else []
    return learner_ids, engine_ids, verifier_ids


def _verifier_gpus(cfg, layout, learner_ids, engine_ids, verifier_ids) -> list[int | None]:
    """The GPU of each verifier actor: round-robin over dedicated GPUs, else over the engines' GPUs,
    else over the learner's."""
    n = 0 if cfg.verifier.remote else cfg.verifier.num_actors
    if cfg.verifier.backend == "cpu" or layout == "cpu":
        return [None] * n
    pool = verifier_ids or sorted({g for ids in engine_ids for g in ids}) or learner_ids
    return [pool[i % len(pool)] for i in range(n)]


def _residents(learner_ids, engine_ids, verifier_gpu) -> dict[int, list[str]]:
    """Who lives on each GPU, in placement order."""
    residents: dict[int, list[str]] = {}
    for rank, gpu in enumerate(learner_ids):
        residents.setdefault(gpu, []).append(f"learner rank {rank}")
    for index, ids in enumerate(engine_ids):
        for gpu in ids:
            residents.setdefault(gpu, []).append(f"engine {index}")
    for index, gpu in enumerate(verifier_gpu):
        if gpu is not None:
            residents.setdefault(gpu, []).append(f"verifier {index}")
    return residents


def _slots(cfg, parallel, residents, learner_ids, engine_ids, verifier_gpu, verifier_ids, external):
    """The typed placements; each resident of a GPU gets an equal fractional Ray share of it."""
    tp, pp, dp = parallel

    def share(gpu: int | None) -> float:
        return 0.0 if gpu is None else 1.0 / len(residents[gpu])

    learner = tuple(
        LearnerRank(
            rank=r,
            tp=r % tp,
            dp=(r // tp) % dp,
            pp=r // (tp * dp),
            gpu=learner_ids[r] if learner_ids else None,
            gpu_fraction=share(learner_ids[r]) if learner_ids else 0.0,
        )
        for r in range(tp * pp * dp)
    )
    urls = cfg.rollout.sglang.urls
    engines = tuple(
        EngineSlot(
            index=i,
            gpus=tuple(engine_ids[i]) if engine_ids else (),
            gpu_fraction=share(engine_ids[i][0]) if engine_ids and engine_ids[i] else 0.0,
            external_url=urls[i % len(urls)] if external else "",
        )
        for i in range(cfg.rollout.num_actors)
    )
    v = cfg.verifier
    verifiers = tuple(
        VerifierSlot(
            index=i,
            gpus=() if g is None else (g,),
            gpu_fraction=share(g),
            shared=g is not None and g not in verifier_ids,
            compile_workers=compile_workers(v.compile_workers, v.num_actors),
            run_workers=run_workers(v.backend, v.run_workers, 0 if g is None else 1, verifiers_on_node=v.num_actors),
        )
        for i, g in enumerate(verifier_gpu)
    )
    return learner, engines, verifiers


def _gpu_count_story(cfg, layout, engine_gpus, external) -> str:
    c = cfg.cluster
    engines = "external" if external else f"{cfg.rollout.num_actors}×{engine_gpus}"
    joiner = " sharing " if layout == "colocated" else " + "
    return f"learner {c.learner_gpus}{joiner}engines {engines} + verifiers {c.verifier_gpus} dedicated"


def _gpu_load(gpu: int, residents: tuple[str, ...], mem: MemoryEstimate, layout: str) -> GpuLoad:
    learner = any(r.startswith("learner") for r in residents)
    engine = any(r.startswith("engine") for r in residents)
    verifiers = sum(r.startswith("verifier") for r in residents)
    # An engine's budget is its share of the GPU (SGLang preallocates mem_fraction of it).
    engine_gib = mem.engine_gib / mem.engine_budget_fraction
    parts, how = [], []
    if learner and engine and layout == "colocated":
        parts.append(max(mem.learner_gib, engine_gib))
        how.append(f"max(learner {mem.learner_gib:.1f}, engine {engine_gib:.1f})")
    else:
        if learner:
            parts.append(mem.learner_gib)
            how.append(f"learner {mem.learner_gib:.1f}")
        if engine:
            parts.append(engine_gib)
            how.append(f"engine {engine_gib:.1f}")
    if verifiers:
        parts.append(verifiers * mem.verifier_gib)
        how.append(f"{verifiers} verifier × {mem.verifier_gib:.1f}")
    return GpuLoad(gpu=gpu, residents=residents, need_gib=sum(parts), how=" + ".join(how))


def _check_memory(p: PlacementPlan, gpu_memory_gb: float) -> None:
    for load in p.gpus:
        if load.need_gib > gpu_memory_gb:
            mem = p.memory
            detail = ", ".join(
                f"{k} {v:.1f}" for k, v in (mem.learner_parts if "learner" in load.how else mem.engine_parts).items()
            )
            raise PlanError(
                f"GPU {load.gpu} ({', '.join(load.residents)}) needs ~{load.need_gib:.1f} GiB = {load.how} "
                f"[{detail} GiB] but has {gpu_memory_gb:.1f} GiB; raise learner.tensor_parallel / "
                f"pipeline_parallel / cluster.learner_gpus (DP), lower learner.micro_batch_tokens, "
                f"rollout.max_batch or model.max_seq_len, or spread the roles over more GPUs"
            )


# ------------------------------------------------------------------------------------ render


def render(p: PlacementPlan) -> str:
    """The plan as a plain-text table (for `kiln train --dry-run` and the run log)."""
    m = p.model
    avail = "?" if p.gpus_available is None else str(p.gpus_available)
    size = "unknown size" if p.gpu_memory_gb is None else f"{p.gpu_memory_gb:.0f} GiB each"
    lines = [
        f"placement plan: layout {p.layout}, {p.gpus_needed} GPUs needed of {avail} ({size})",
        (
            f"model: {m.params / 1e9:.3f}B parameters (h={m.hidden}, L={m.layers}, heads={m.heads}/{m.kv_heads} kv, "
            f"head_dim={m.head_dim}, ffn={m.intermediate}, vocab={m.vocab}; from {m.source})"
        ),
        "",
    ]
    if p.gpus:
        lines += _table(
            ["GPU", "residents", "need GiB", "how"],
            [[str(g.gpu), ", ".join(g.residents), f"{g.need_gib:.1f}", g.how] for g in p.gpus],
        )
        lines += [
            "",
            "Ray placement group bundles: "
            + ", ".join(f"[{b.index}] GPU {','.join(map(str, b.gpus))}" for b in bundles(p)),
            "",
        ]
    ranks = [[str(r.rank), str(r.tp), str(r.pp), str(r.dp), _where(r.gpu), _frac(r.gpu_fraction)] for r in p.learner]
    lines += [f"learner ({p.learner_backend}):"] + _table(["rank", "tp", "pp", "dp", "device", "GPU share"], ranks)
    engines = [
        [
            str(e.index),
            e.external_url or ("gpu " + ",".join(map(str, e.gpus)) if e.gpus else "cpu"),
            _frac(e.gpu_fraction),
        ]
        for e in p.engines
    ]
    lines += ["", "engines:"] + _table(["engine", "device", "GPU share"], engines)
    verifiers = [
        [
            str(v.index),
            "gpu " + ",".join(map(str, v.gpus)) if v.gpus else "cpu",
            _frac(v.gpu_fraction),
            "shared" if v.shared else "dedicated" if v.gpus else "-",
            str(v.compile_workers.count),
            str(v.run_workers.count),
            ", ".join(f"{w}: {_where(None if g is None else v.gpus[g])}" for w, g in enumerate(v.run_workers.gpus)),
        ]
        for v in p.verifiers
    ]
    header = ["verifier", "device", "GPU share", "GPU use", "compile workers", "run workers", "run worker: device"]
    lines += ["", "verifiers:"] + _table(header, verifiers)
    for why in sorted(
        {f"compile workers {v.compile_workers.why}; run workers {v.run_workers.why}" for v in p.verifiers}
    ):
        lines.append(f"  ({why})")
    mem = p.memory
    lines += [
        "",
        "memory estimate per device (GiB):",
        "  learner  " + _parts(mem.learner_parts) + f" = {mem.learner_gib:.2f}",
        "  engine   "
        + _parts(mem.engine_parts)
        + f" = {mem.engine_gib:.2f}"
        + (f" (within {mem.engine_budget_fraction:.0%} of the GPU)" if mem.engine_budget_fraction < 1 else ""),
        f"  verifier {mem.verifier_gib:.2f} per actor",
    ]
    return "\n".join(lines)


def _where(gpu: int | None) -> str:
    return "cpu" if gpu is None else f"gpu {gpu}"


def _frac(f: float) -> str:
    return "-" if f == 0 else f"{f:.2f}"


def _parts(parts: dict[str, float]) -> str:
    return " + ".join(f"{k} {v:.2f}" for k, v in parts.items())


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(x) for x in col) for col in zip(header, *rows, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return ["  " + fmt.format(*header).rstrip(), "  " + "  ".join("-" * w for w in widths)] + [
        "  " + fmt.format(*row).rstrip() for row in rows
    ]
