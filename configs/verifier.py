"""The `verifier` section's schema: the kernel verifier (or a plug-in reward actor), its reward
hierarchy, legality policy and the benchmark-only modelled latency. Part of `configs.schema.KilnConfig`;
declared like every section there."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from configs.fields import F


@dataclass
class RewardConfig:
    lam: float = F(0.5, "λ: weight of the speedup bonus in s = 1 + λ·min(max(ν-1, 0), ν_max)", ge=0.0)
    nu_max: float = F(2.0, "ν_max: cap on the speedup bonus term", ge=0.0)
    baseline: str = F("eager", "Speedup ν is measured against this baseline", choices=["eager", "compile"])


@dataclass
class LegalityConfig:
    allow_vendor_libs: bool = F(
        True, "Allow cuBLAS/cuDNN/CUTLASS called natively from C++/CUDA (reported in diagnostics)"
    )
    review_speedup: float = F(20.0, "Speedups above this are flagged for human review", gt=1.0)


@dataclass
class ModelledLatencyConfig:
    median_s: float = F(
        0.0,
        "Benchmarks only (kiln bench): a modelled GPU-side verification time added to every verification as a sleep, after the real one (extract, compile, run); 0 = off",
        ge=0.0,
    )
    sigma: float = F(
        1.0,
        "Shape of the modelled time: log-normal with this σ of its logarithm, so the tail is long (σ = 1: p90 3.6×, p99 10× the median); 0 = always the median",
        ge=0.0,
    )
    max_s: float = F(60.0, "Cap on one modelled time", gt=0.0)
    seed: int = F(0, "Seed of the modelled times (each verifier actor adds its rank)", ge=0)


@dataclass
class VerifierConfig:
    backend: str = F(
        "cpu",
        "Kernel backend: 'cuda' (production) or 'cpu' (C++ kernels; CI and the embedded default)",
        choices=["cuda", "cpu"],
    )
    reward_actor: str | None = F(
        None, "Dotted path of a reward-actor class that replaces the kernel verifier; null = the verifier"
    )
    reward_actor_args: dict[str, Any] = F(
        {}, "Keyword arguments of the reward actor's constructor: cls(cfg: VerifierConfig, **reward_actor_args)"
    )
    num_actors: int = F(1, "Verifier actors (one per GPU for cuda)", ge=1)
    remote: str = F(
        "",
        "URL of a verifier service (`kiln serve`) that verifies the run's attempts instead of verifier actors of its own (none start); its token from the KILN_SERVE_TOKEN environment variable, its backend must be verifier.backend",
    )
    compile_workers: int = F(
        0,
        "Parallel compile processes per verifier actor; 0 = the node's cores (those the verifier's process may use) divided by the verifier actors of the run, at least 1 (verifiers spread over several nodes: set it per node's cores ÷ verifiers there)",
        ge=0,
    )
    run_workers: int = F(
        0,
        "Sandboxed execution workers per verifier actor, dealt round-robin over its GPUs and each pinned to its GPU (that GPU's device lease, references and baselines); 0 = sized on cuda: the actor's share of the node's cores at 2 a worker, at most 8 a GPU and no more than the GPU's free memory holds at 2 GiB a sandbox (a run's timing is exclusive on its GPU, and its trials reserve their own memory); 1 on cpu (a cpu sandbox's timing shares the host's cores with the compiles)",
        ge=0,
    )
    trials: int = F(
        4,
        "Randomized correctness trials per candidate (fresh seeds; at least one other shape where the task allows)",
        ge=1,
    )
    run_timeout_s: float = F(
        60.0,
        "Sandbox seconds of one candidate execution (correctness + timing; trusted work in between does not count), "
        "plus the time to move the task's data at 1 GiB/s for tasks of large inputs (limits.py)",
        gt=0.0,
    )
    compile_timeout_s: float = F(300.0, "Wall-clock limit of one compile", gt=0.0)
    memory_limit_mb: int = F(
        8192,
        "Floor of a sandbox's host memory limit (RSS watchdog over its process tree; not RLIMIT_AS, which breaks CUDA): "
        "each task gets max(this, its process base + copies of one trial's inputs and outputs) plus its I/O arena, "
        "never more than 90% of the machine's memory (actors/verifier/limits.py); the limit used is in every verdict's "
        "diagnostics.sandbox.limits. Also the compile jails' memory limit",
        ge=256,
    )
    cache_dir: str | None = F(
        None, "Compile and verdict cache directory; null = $KILN_CACHE_DIR/verifier, else ~/.cache/kiln/verifier"
    )
    warmup: int = F(
        3,
        "Untimed warm-up trips before timing (on fresh inputs, as timed calls are); they choose the calls per trip",
        ge=0,
    )
    repeats: int = F(
        5,
        "Timed trip pairs (at least 3): a trip is K calls (K chosen so a trip lasts a few ms), each timed as "
        "KernelBench times one (L2 flush, CUDA events or the monotonic clock, an idle device), bounded by the "
        "verifier's own clock around the trip and the same trip without the forward; the mean per-call time pays, "
        "the median is recorded",
        ge=1,
    )
    profile_kernels: int = F(
        5,
        "After a pass below profile_below, run its calls once more under torch's profiler and quote the N costliest kernels (cuda; on cpu: torch operators) in its feedback, for a performance turn; feedback only, never reward; 0 = off",
        ge=0,
    )
    profile_below: float | None = F(
        1.1,
        "Profile only passes with a speedup over eager below this (eval.fast_threshold's default: the passes that get a performance turn); null = every pass",
        gt=0.0,
    )
    compile_baseline: str = F(
        "auto",
        "Also time torch.compile(reference) for speedup_compile: 'auto' = on cuda only (inductor's C++ build costs ~10-30 s per task on cpu), 'always', 'never'; always measured when reward.baseline is 'compile'",
        choices=["auto", "always", "never"],
    )
    sandbox_references: bool = F(
        False,
        "Run every task's reference (its module, inputs, forward and baselines) in a jailed process of its own, as a reference a client of `kiln serve` sent always runs; false = the operator's own task set runs in the verifier's process (faster). For operators who do not trust their task set, and for the timing fidelity benchmark (docs/verifier.md, threat model)",
    )
    reference_timeout_s: float = F(
        60.0,
        "Seconds a jailed reference may take to answer one request (load, build, draw, forward), plus the time to move the task's data at 1 GiB/s; past it its process is killed and the request is the reference's failure (infra, never the candidate's). Its baselines get as long as the baseline process does (10 min)",
        gt=0.0,
    )
    atol: float | None = F(
        None,
        "Absolute tolerance of the correctness check, in units of the reference output's scale (its root mean square); "
        "null = the task's KILN_TOLERANCE, else by dtype (fp32 1e-3, fp16 1e-2, bf16 2e-2)",
        ge=0.0,
    )
    rtol: float | None = F(
        None, "Relative tolerance of the correctness check; null = the task's KILN_TOLERANCE, else by dtype", ge=0.0
    )
    max_concurrent_requests: int = F(
        8,
        "Verification requests one verifier actor works on at once (compiles overlap executions); further requests queue",
        ge=1,
    )
    reward_timeout_s: float | None = F(
        None,
        "Seconds a verifier actor waits for its reward actor's verify() on one request before answering 'infra'; null = compile_timeout_s + run_timeout_s + 120",
        gt=0.0,
    )
    reward: RewardConfig = F(RewardConfig(), "MooreEval reward hierarchy")
    legality: LegalityConfig = F(LegalityConfig(), "Anti-fallback / anti-cheat policy")
    modelled_latency: ModelledLatencyConfig = F(
        ModelledLatencyConfig(),
        "Benchmark-only: a long-tailed sleep standing in for GPU-side verification on a CPU machine (kiln bench); off by default",
    )
