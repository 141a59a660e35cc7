"""The megatron GPU check's throughput rows: a ~1.1B Qwen3-style model at 8192 tokens per GPU per
step (`sequences` changes it: a host-bound step gains MFU from longer micro-batches), for each kernel switch of `learner.megatron` on its own and all together, with peak memory
against the plan's estimate, and (`--profile`) torch.profiler's top CUDA kernels of one SFT step.
launch/bench/gpu_megatron.py runs them after its correctness rows.

The variants of one model are timed in interleaved rounds (`interleaved`), each row the median with
the rounds' range. Timed one after another, the same code's step moved by up to 16% between runs on
two H200s (0.165 to 0.192 s), more than the differences the rows exist to show."""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from actors.learner.algorithm import Trainer
from actors.learner.megatron.backend import MegatronBackend
from actors.learner.megatron.model import Kernels
from configs import AlgoConfig, LearnerConfig
from launch.bench import trace_gaps
from launch.bench.megatron_rows import (
    H100_BF16_FLOPS,
    LARGE,
    check,
    free,
    make_batch,
    plan_estimate,
    rank0,
    row,
    with_behaviour,
)

SWITCHES = ("fused_logprobs", "fused_swiglu", "fused_rope", "fused_grad_accumulation", "fused_grad_clip")
VARIANTS = {  # learner.megatron switches: every one off, each alone, all on
    "plain": dict.fromkeys(SWITCHES, False),
    **{name: {s: s == name for s in SWITCHES} for name in SWITCHES},
    "all fused": dict.fromkeys(SWITCHES, True),
    # the step of session 26: the three compiled kernels only
    "the three compiled kernels": {s: s in ("fused_logprobs", "fused_swiglu", "fused_rope") for s in SWITCHES},
}


SEQUENCE_TOKENS = 2048  # the timed batch's sequences
SEQUENCES_PER_GPU = 4  # per step: the SFT step trains them as one micro-batch, the MFU target's batch
OVERLAP = " + overlap_grad_reduce"  # a variant's suffix when its model reduces gradients during backward


def throughput(
    learner: LearnerConfig,
    algo: AlgoConfig,
    device,
    world: int,
    *,
    rounds: int,
    profile: bool,
    sequences: int = SEQUENCES_PER_GPU,
) -> None:
    """Every switch variant on one model, then (DP > 1) every switch on and overlap_grad_reduce on a
    second model (the overlap is how megatron's DDP is built, so it takes a model of its own), then
    the MFU target against the best variant."""
    mfu: dict[str, float] = {}
    common = {"rounds": rounds, "profile": profile, "mfu": mfu, "sequences": sequences}
    measure(learner, algo, device, list(VARIANTS), overlap=False, **common)
    if world > 1:
        measure(learner, algo, device, ["all fused"], overlap=True, **common)
    if "plain" in mfu and len(mfu) > 1:
        best = max(mfu, key=mfu.get)
        row(
            "MFU target (>= 40%)",
            mfu[best] >= 0.40,
            f"SFT step {mfu['plain']:.1%} plain -> {mfu[best]:.1%} with {best} "
            f"(dp={world}, {sequences * SEQUENCE_TOKENS} tokens per GPU)",
        )


def interleaved(
    calls: dict[str, Callable[[], None]],
    *,
    rounds: int,
    per_round: int = 1,
    sync: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Seconds per call of each of `calls`, one figure per round. Each round times every variant
    (`per_round` calls each), in alternating order (A B C, then C B A), so a drift in the machine's
    speed falls on every variant alike and no variant always runs first."""
    if rounds < 1 or per_round < 1:
        raise ValueError(f"rounds and per_round must be >= 1, got {rounds} and {per_round}")
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds):
        for name in list(calls) if r % 2 == 0 else list(reversed(calls)):
            sync()
            start = clock()
            for _ in range(per_round):
                calls[name]()
            sync()
            times[name].append((clock() - start) / per_round)
    return times


def spread(seconds: list[float]) -> str:
    """The rounds' range beside a median: `[min-max]`, in seconds."""
    return f"[{min(seconds):.3f}-{max(seconds):.3f}]"


def measure(
    learner: LearnerConfig,
    algo: AlgoConfig,
    device,
    names: list[str],
    *,
    overlap: bool,
    rounds: int,
    profile: bool,
    mfu: dict[str, float],
    per_round: int = 1,
    sequences: int = SEQUENCES_PER_GPU,
    rl_variants: tuple[str, ...] = ("plain", "all fused"),
) -> None:
    """The ~1.1B model's SFT step (and for plain and all fused, its RL step) under each variant of
    `names`, into `mfu`: each variant warmed (its peak memory from a warm step), then all of them
    timed in `rounds` interleaved rounds. With `profile`, the profile of plain and all fused."""
    big, n_params = None, 0
    per_gpu = sequences * SEQUENCE_TOKENS
    suffix = OVERLAP if overlap else ""
    # A training process compiles its kernels for one model. This one compiled them first for the
    # correctness rows' small model; dynamo would then treat every dim that differs here (the hidden
    # and vocabulary sizes too) as symbolic, and time code no training run executes.
    torch._dynamo.reset()
    learner = dataclasses.replace(
        learner,
        micro_batch_tokens=per_gpu,
        megatron=dataclasses.replace(learner.megatron, overlap_grad_reduce=overlap),
    )

    @check("throughput ~1B" + suffix)
    def _():
        nonlocal big, n_params
        # lr = 0: the same arithmetic, but the weights stay put, so μ stays on-policy and MirrorPop keeps
        # every sequence in every timed RL step (a moving policy would make it drop them all).
        big = Trainer(
            MegatronBackend(LARGE, dataclasses.replace(learner, lr=0.0), device=device), algo, temperature=1.0
        )
        n_params = sum(t.numel() for _, t in big.named_weights())
        row(
            "throughput ~1B" + suffix,
            True,
            f"N={n_params / 1e9:.2f}B, {per_gpu} tok/GPU/step ({sequences} x {SEQUENCE_TOKENS}), "
            f"dp={big.backend.layout.dp}, TP=1; MFU = 6·N·tokens/(s·989e12)",
            params=n_params,
        )

    if big is None:
        return
    backend = big.backend
    dp = backend.layout.dp
    tokens_batch = make_batch(LARGE, [SEQUENCE_TOKENS] * (sequences * dp), seed=7)
    rl_batch = with_behaviour(tokens_batch, big.logprobs(tokens_batch, 1.0).numpy(), drifted=None, seed=8)

    def under(name: str, step):
        """`step` on the timed batch with the variant's switches (switching is free once each variant's
        kernels have compiled)."""

        def call():
            backend.kernels = Kernels(**VARIANTS[name], compile=True)
            step(rl_batch)

        return call

    peaks: dict[str, float] = {}
    sft: dict[str, list[float]] = {}
    rl: dict[str, list[float]] = {}
    rl_names = [n for n in names if n in rl_variants]

    @check("timed rounds" + suffix)
    def _():  # a failure here is one FAIL row; the variants' rows then have nothing to show
        for name in names:  # warm each variant (its first call compiles); its peak memory from a warm step
            under(name, big.sft_step)()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            under(name, big.sft_step)()
            peaks[name] = torch.cuda.max_memory_allocated()
        for name in rl_names:
            under(name, big.train_step)()
            kept = big.train_step(rl_batch).metrics["kept_fraction"]
            if kept < 1.0:
                raise RuntimeError(f"MirrorPop kept only {kept:.2f} of the timed RL batch: not a full step")
        sync = torch.cuda.synchronize
        sft.update(
            interleaved({n: under(n, big.sft_step) for n in names}, rounds=rounds, per_round=per_round, sync=sync)
        )
        rl.update(
            interleaved({n: under(n, big.train_step) for n in rl_names}, rounds=rounds, per_round=per_round, sync=sync)
        )

    for name in names if sft else []:
        label = name + suffix

        @check(f"SFT step: {label}")
        def _(name=name, label=label):  # bound here: this iteration's variant
            sft_s = statistics.median(sft[name])
            estimate = plan_estimate(
                dataclasses.replace(learner, megatron=dataclasses.replace(learner.megatron, **VARIANTS[name])),
                tp=1,
                pp=1,
                dp=dp,
                stage=0,
            )
            mfu[label] = 6 * n_params * per_gpu / (sft_s * H100_BF16_FLOPS)
            extra = ""
            if name in rl:
                rl_s = statistics.median(rl[name])
                extra = f"; RL step {rl_s:.3f}s {spread(rl[name])} MFU(10N) {10 * n_params * per_gpu / (rl_s * H100_BF16_FLOPS):.1%}"
            peak = peaks[name]
            row(
                f"SFT step: {label}",
                True,
                f"{sft_s:.3f}s {spread(sft[name])} {per_gpu / sft_s:,.0f} tok/s/GPU MFU {mfu[label]:.1%}{extra}; "
                f"peak {peak / 2**30:.1f} GiB vs plan {estimate / 2**30:.1f} GiB ({peak / estimate:.2f}x)",
                seconds=sft_s,
                rounds=sft[name],
                rl_rounds=rl.get(name),
                mfu=mfu[label],
                peak_gib=peak / 2**30,
                plan_gib=estimate / 2**30,
                device=torch.cuda.get_device_name(),
            )

    # The SFT step of plain and all fused, and the RL step of all fused: it ran at half the SFT step's
    # MFU on two H100s (13.1% of 10N against 26.6% of 6N), with the same kernels.
    profiles = [(n, "SFT", big.sft_step) for n in names if n in ("plain", "all fused")]
    profiles += [(n, "RL", big.train_step) for n in names if n == "all fused"]
    for name, kind, step in profiles if profile else []:
        label = name + suffix

        @check(f"profile {kind}: {label}")
        def _(name=name, kind=kind, step=step, label=label):  # bound here: this iteration's variant
            backend.kernels = Kernels(**VARIANTS[name], compile=True)
            step(rl_batch)  # warm
            table = kernel_table(lambda: step(rl_batch))
            if rank0():
                print(f"\n[gpu_check] top CUDA kernels of one {kind} step ({label}):\n{table}", flush=True)
                out = os.environ.get("OUT")
                if out:
                    slug = label.replace(" + ", "_").replace(" ", "_")
                    Path(out, f"profile_{kind.lower()}_{slug}.md").write_text(table + "\n")
            row(
                f"profile {kind}: {label}",
                True,
                "top 25 kernels and the idle gaps printed above" + (" and in $OUT" if os.environ.get("OUT") else ""),
            )

    big = None  # frees the model (the checks above read big through their closures)
    free()


def kernel_table(step, top: int = 25) -> str:
    """torch.profiler over one call of `step`: the `top` CUDA kernels by GPU time, as a markdown
    table, how the step's GPU time splits into GEMMs, attention, communication and the rest, and
    where the GPU sat idle (trace_gaps: by phase, the longest gaps and the host's ops then)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    # Ranges such as `Optimizer.step#AdamW.step` show up with device time too: they span kernels that
    # are listed on their own, so counting them would count those kernels twice.
    kernels = [
        e
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and not getattr(e, "is_user_annotation", False)
        and "#" not in e.key
    ]
    time_of = lambda e: getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
    kernels.sort(key=time_of, reverse=True)
    busy = sum(time_of(e) for e in kernels)  # µs
    lines = [
        f"GPU busy {busy / 1e3:.1f} ms of {wall * 1e3:.1f} ms wall (profiled; the profiler slows the host)",
        "",
        "| # | kernel | calls | total ms | % of GPU time | avg µs |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for i, e in enumerate(kernels[:top], 1):
        name = e.key if len(e.key) <= 90 else e.key[:87] + "..."
        lines.append(
            f"| {i} | `{name}` | {e.count} | {time_of(e) / 1e3:.2f} | {time_of(e) / busy:.1%} | "
            f"{time_of(e) / e.count:.0f} |"
        )
    groups: dict[str, float] = {}
    for e in kernels:
        key = e.key.lower()
        # Compiled (triton) kernels first: their names list the ops they fused (`..._to_copy_cat_...`),
        # which would otherwise read as copies.
        kind = (
            "GEMM"
            if any(k in key for k in ("gemm", "cutlass", "xmma", "nvjet", "cublas"))
            else "attention"
            if any(k in key for k in ("flash", "fmha", "attention", "sdpa"))
            else "communication"
            if "nccl" in key
            else "compiled (triton)"
            if key.startswith("triton_")
            else "optimizer (fused AdamW)"
            if "multi_tensor_apply" in key
            else "copies"
            if any(k in key for k in ("memcpy", "memset", "copy_kernel", "catarraybatched"))
            else "elementwise / reductions"
        )
        groups[kind] = groups.get(kind, 0.0) + time_of(e)
    lines += ["", "| kind | ms | % of GPU time |", "| --- | --- | --- |"]
    lines += [f"| {k} | {v / 1e3:.1f} | {v / busy:.1%} |" for k, v in sorted(groups.items(), key=lambda kv: -kv[1])]
    # Where the GPU sat idle, by the step's `kiln.*` phases, and what the host was doing then.
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "trace.json")
        prof.export_chrome_trace(str(path))
        lines += ["", trace_gaps.report(trace_gaps.Trace.read(path))]
    return "\n".join(lines)
