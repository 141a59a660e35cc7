"""The megatron learner's compiled kernels against their memory bound, under each way of compiling them.
Which dims torch.compile treats as symbolic changes the code it generates.

    python -m launch.bench.learner_kernels [--tokens 8192] [--chunk-rows 2048] [--vocab 151936]
        [--padded-vocab 152064] [--ffn 6144] [--heads 16] [--kv-heads 8] [--head-dim 128]
        [--modes eager dynamic automatic static] [--calls 20] [--device cuda]

The defaults are the shapes of launch.bench.gpu_megatron's 1.12B model, one micro-batch of 8,192 tokens.
On two H100s its SFT step profile showed these kernels at 3-6x their memory time: the compiled
SwiGLU backward at 1,029 µs a call, and the chunked logprobs' two at 1,184 and 1,049 µs. Both ran
with every dim symbolic: logprobs.py and attention.py compiled with `dynamic=True` then, and that
check process had compiled megatron's SwiGLU for a smaller model first. This bench's first run (two
H200s, 2026-11-28) settled it: logprobs.py and attention.py now compile with the default
(`automatic`), and the backward writes the grad in place.

Kernels:
- **logprob stats, entropy stats, logprob grad**: actors/learner/megatron/logprobs.py on one chunk of
  rows over the real vocabulary. The chunk is a strided view of the padded slice, as the backend
  passes it. The grad runs alone; as the backward ran it before (the kernel's result copied into
  the logits' storage afterwards: `grad, then copy`); and as it runs now, written into that storage
  by the compiled function itself (`grad in place`, logprobs.chunk_grad_).
- **SwiGLU forward and backward**: megatron's functions (model.swiglu_functions) over [tokens, 2·ffn].
- **RoPE** of q and of k (attention.apply_rotary).

Modes:
- `eager`: torch ops one by one.
- `dynamic`: torch.compile(dynamic=True), every dim symbolic. logprobs.py and attention.py shipped
  this until 2026-11-28.
- `automatic`: torch.compile() called on two row counts. Only the dim that changed (the rows) is
  symbolic. This is what logprobs.py and attention.py ship, and what a process that trains one
  model gets from megatron's jit_fuser.
- `static`: torch.compile(dynamic=False).

Each row gives:
- µs per call: the median of `--calls`, CUDA events;
- the bytes the kernel must move at least (its inputs read once, its outputs written once);
- the bandwidth those bytes imply, and its share of the device's copy bandwidth, measured in the same run;
- the largest difference from eager's result.
dynamo's caches are reset before every (kernel, mode). Prints one table; writes JSON to
$OUT/learner_kernels.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

MODES = ("eager", "dynamic", "automatic", "static")


@dataclass(frozen=True)
class Shape:
    tokens: int = 8192  # a micro-batch
    chunk_rows: int = 2048  # learner.megatron.logprob_chunk_rows
    vocab: int = 151936  # the real vocabulary
    padded_vocab: int = 152064  # this rank's slice of the logits, padding included
    ffn: int = 6144
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128


@dataclass(frozen=True)
class Case:
    name: str
    kernel: Callable  # what gets compiled
    make: Callable[[int], tuple]  # row count -> the kernel's arguments (fresh tensors)
    rows: int  # the timed row count
    bytes: int  # at least moved per call
    after: Callable | None = None  # (kernel result, args) -> the call's result: work outside the kernel


def cases(shape: Shape, device: torch.device, kernels: dict[str, Callable]) -> list[Case]:
    """The kernels at `shape`; `kernels` holds the functions (names as in `kernel_functions`)."""
    bf16, f32 = torch.bfloat16, torch.float32
    valid, padded = shape.vocab, shape.padded_vocab

    def chunk(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.randn(rows, padded, device=device, dtype=bf16) * 3
        return logits, logits[:, :valid]  # the storage, and the kernel's strided view of it

    def stats_args(rows):
        _, x = chunk(rows)
        return x, torch.tensor(1.0, device=device), torch.randint(0, valid, (rows,), device=device)

    def grad_args(rows):
        logits, x = chunk(rows)
        lse = torch.logsumexp(x.float(), -1)
        g = torch.randn(rows, device=device, dtype=f32)
        return x, torch.tensor(1.0, device=device), torch.randint(0, valid, (rows,), device=device), lse, g, logits

    def swiglu_args(rows):
        return (torch.randn(rows, 2 * shape.ffn, device=device, dtype=bf16),)

    def swiglu_back_args(rows):
        y = torch.randn(rows, 2 * shape.ffn, device=device, dtype=bf16)
        return torch.randn(rows, shape.ffn, device=device, dtype=bf16), y

    def rope_args(heads):
        def make(rows):
            cos = torch.randn(rows, 1, shape.head_dim, device=device, dtype=f32)
            x = torch.randn(rows, heads, shape.head_dim, device=device, dtype=bf16)
            return x, cos, torch.randn_like(cos)

        return make

    grad, grad_in_place = kernels["grad"], kernels["grad_in_place"]
    r, t, d = shape.chunk_rows, shape.tokens, shape.head_dim
    row_bytes = r * valid * 2
    return [
        Case("logprob stats", kernels["stats"], stats_args, r, row_bytes),
        Case("entropy stats", kernels["entropy_stats"], lambda rows: stats_args(rows)[:2], r, row_bytes),
        Case("logprob grad alone", lambda x, i, tg, lse, g, _out: grad(x, i, tg, lse, g), grad_args, r, 2 * row_bytes),
        Case(
            "logprob grad, then copy",  # as the backward runs: `out[rows, :valid] = grad(...)`
            lambda x, i, tg, lse, g, _out: grad(x, i, tg, lse, g),
            grad_args,
            r,
            2 * row_bytes,
            after=lambda result, args: args[-1][:, :valid].copy_(result),
        ),
        Case("logprob grad in place", grad_in_place, grad_args, r, 2 * row_bytes),
        Case("SwiGLU forward", kernels["swiglu"], swiglu_args, t, t * 3 * shape.ffn * 2),
        Case("SwiGLU backward", kernels["swiglu_back"], swiglu_back_args, t, t * 5 * shape.ffn * 2),
        Case("RoPE q", kernels["rope"], rope_args(shape.heads), t, 2 * t * shape.heads * d * 2 + 2 * t * d * 4),
        Case("RoPE k", kernels["rope"], rope_args(shape.kv_heads), t, 2 * t * shape.kv_heads * d * 2 + 2 * t * d * 4),
    ]


def kernel_functions() -> dict[str, Callable]:
    """The shipped kernels as plain functions (megatron's SwiGLU and the RoPE need megatron-core)."""
    from actors.learner.megatron import logprobs
    from actors.learner.megatron.attention import apply_rotary
    from actors.learner.megatron.model import swiglu_functions

    swiglu, swiglu_back = swiglu_functions()

    def grad_in_place(x, inv_t, target, lse, g, out):
        """The grad written into the logits' storage by the compiled function itself, as the backward
        calls it."""
        logprobs.chunk_grad_(x, inv_t, target, lse, g)

    return {
        "stats": logprobs.chunk_stats,
        "entropy_stats": logprobs.chunk_entropy_stats,
        "grad": logprobs.chunk_grad,
        "grad_in_place": grad_in_place,
        "swiglu": swiglu,
        "swiglu_back": swiglu_back,
        "rope": apply_rotary,
    }


def compiled(case: Case, mode: str) -> Callable:
    """`case.kernel` under `mode`, warmed (compiled) at the timed row count."""
    torch._dynamo.reset()
    if mode == "eager":
        return case.kernel
    if mode == "automatic":
        fn = torch.compile(case.kernel)
        fn(*case.make(case.rows - 1))  # a first shape; the second call makes the rows symbolic
        return fn
    return torch.compile(case.kernel, dynamic={"dynamic": True, "static": False}[mode])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(call: Callable[[], object], calls: int, device: torch.device) -> float:
    """Median seconds of one call, after three untimed ones."""
    for _ in range(3):
        call()
    times = []
    for _ in range(calls):
        _sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def _flat(result) -> list[torch.Tensor]:
    if result is None:
        return []
    if isinstance(result, torch.Tensor):
        return [result.float()]
    return [t.float() for t in result]


def measure(shape: Shape, device: torch.device, modes: list[str], calls: int, kernels: dict) -> list[dict]:
    """One row per (kernel, mode): time, bytes, bandwidth and difference from eager."""
    from launch.bench.engine_yardsticks import copy_bandwidth

    copy_bps = copy_bandwidth(device)
    rows = []
    for case in cases(shape, device, kernels):
        reference = None
        for mode in ["eager", *[m for m in modes if m != "eager"]]:
            fn = compiled(case, mode)
            torch.manual_seed(0)  # the same inputs for every mode (the in-place kernels overwrite theirs)
            args = case.make(case.rows)

            def call(fn=fn, args=args, after=case.after):
                out = fn(*args)
                return after(out, args) if after is not None else out

            # In-place kernels return nothing: their result is the logits' storage (the last argument).
            result = _flat(call()) or [args[-1][:, : shape.vocab].float()]
            if mode == "eager":
                reference = result
            if mode not in modes:
                continue
            seconds = time_call(call, calls, device)
            diff = max((float((a - b).abs().max()) for a, b in zip(result, reference, strict=True)), default=0.0)
            rows.append(
                {
                    "kernel": case.name,
                    "mode": mode,
                    "us": seconds * 1e6,
                    "bytes": case.bytes,
                    "gb_per_s": case.bytes / seconds / 1e9,
                    "share_of_copy": case.bytes / seconds / copy_bps,
                    "max_diff_vs_eager": diff,
                }
            )
    rows.append({"kernel": "copy bandwidth", "mode": "-", "gb_per_s": copy_bps / 1e9})
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| kernel | mode | µs | MB moved | GB/s | of copy bandwidth | max \\|Δ\\| vs eager |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "us" not in r:
            lines.append(f"| {r['kernel']} | | | | {r['gb_per_s']:,.0f} | | |")
            continue
        lines.append(
            f"| {r['kernel']} | {r['mode']} | {r['us']:,.1f} | {r['bytes'] / 1e6:,.1f} | {r['gb_per_s']:,.0f} | "
            f"{r['share_of_copy']:.0%} | {r['max_diff_vs_eager']:.3g} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = Shape()
    for name in Shape.__dataclass_fields__:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    shape = Shape(**{name: getattr(args, name) for name in Shape.__dataclass_fields__})
    if min(vars(args)[n] for n in Shape.__dataclass_fields__) < 2 or shape.vocab > shape.padded_vocab:
        p.error("every size must be >= 2 and --vocab at most --padded-vocab")
    if args.calls < 1:
        p.error("--calls must be >= 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("no CUDA device here (use --device cpu for a smoke run)")
    device = torch.device(args.device)
    rows = measure(shape, device, args.modes, args.calls, kernel_functions())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"learner kernels on {name}, {shape}\n{table(rows)}")
    out = os.environ.get("OUT")
    if out:
        Path(out, "learner_kernels.json").write_text(json.dumps({"device": name, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
