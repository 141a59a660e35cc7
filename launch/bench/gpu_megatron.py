"""GPU acceptance check of the megatron backend: prints one table, writes JSON to $OUT when set.

    torchrun --nproc-per-node 2 -m launch.bench.gpu_megatron [--quick] [--profile]   # all checks
    python -m launch.bench.gpu_megatron [--quick] [--profile]                        # 1 GPU: TP/PP/DP rows SKIP

Rows: HF -> megatron -> HF round trip through the live model (bit-exact), export_hf reloads in
transformers (bit-exact), TP=1 logits/logprobs vs the HF model (bf16), a training step (finite loss,
weights move, MirrorPop drops the drifted sequence), checkpoint save/load restores the weights,
TP=2 vs TP=1 logits/logprobs, one train step under (TP=1, DP=2) vs (TP=2, DP=1) from the same weights
(same loss, grad norm and updated weights), PP=2 vs PP=1: the weights gathered from both stages
(bit-exact), logprobs through the pipeline, one RL step (same loss and grad norm within bf16
rounding), and the memory of a ~1.1B model's PP=2 step on each stage against the placement plan's
estimate (within 15%). Throughput of a ~1.1B Qwen3-style model at 8192 tokens per GPU per step, for
each kernel switch of `learner.megatron` on its own and all together, with peak memory against the
plan's estimate: MFU = 6·N·tokens / (seconds · 989e12) for the SFT step; the RL step also runs the
no-grad π_prox pass before its updates and the no-grad drift pass after them, so it is counted 10·N.
`--profile` adds torch.profiler's top 25 CUDA kernels of one SFT step with every switch off and
with every switch on (tables printed and written to $OUT). Each row runs in its own try/except.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from actors.learner.algorithm import Trainer
from actors.learner.megatron.backend import MegatronBackend
from actors.learner.megatron.model import Kernels, packed_forward
from actors.learner.megatron.parallel import init_distributed
from actors.policy.model import build_model
from configs import AlgoConfig, LearnerConfig, ModelConfig
from configs.schema import MegatronKernelsConfig
from protocols import TrainBatch

H100_BF16_FLOPS = 989e12
T = 0.8
SMALL = ModelConfig(
    arch="qwen3",
    vocab_size=1000,
    hidden_size=256,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    intermediate_size=512,
    max_seq_len=2048,
    dtype="bfloat16",
    seed=3,
)
LARGE = ModelConfig(
    arch="qwen3",
    vocab_size=151936,
    hidden_size=2048,
    num_layers=16,
    num_heads=16,
    num_kv_heads=8,
    intermediate_size=6144,
    max_seq_len=8192,
    dtype="bfloat16",
    seed=0,
)
ROWS: list[dict] = []


def rank0() -> bool:
    return dist.get_rank() == 0


def row(name: str, ok: bool | None, detail: str, **values) -> None:
    status = "SKIP" if ok is None else ("PASS" if ok else "FAIL")
    ROWS.append({"check": name, "status": status, "detail": detail, **values})
    if rank0():
        print(f"[gpu_check] {status:4s} {name}: {detail}", flush=True)


def check(name: str):
    """Run the decorated check at once; an exception becomes a FAIL row and the next check runs."""

    def run(fn):
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - one failure must not hide the other rows
            row(name, False, f"{type(err).__name__}: {err}".splitlines()[0][:300])
            if rank0():
                traceback.print_exc()
        gc.collect()
        torch.cuda.empty_cache()
        return fn

    return run


def make_batch(cfg: ModelConfig, lengths: list[int], seed: int) -> TrainBatch:
    rng = np.random.default_rng(seed)
    n = sum(lengths)
    mask = np.concatenate([np.arange(length) >= length // 5 for length in lengths])
    return TrainBatch(
        version=0,
        episode_ids=[f"s{i}" for i in range(len(lengths))],
        tokens=rng.integers(0, cfg.vocab_size, n).astype(np.int64),
        cu_seqlens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        loss_mask=mask,
        behaviour_logprobs=np.zeros(n, np.float32),
        advantages=rng.standard_normal(len(lengths)).astype(np.float32),
        versions=np.where(mask, 0, -1).astype(np.int64),
    )


def with_behaviour(batch: TrainBatch, logprobs: np.ndarray, drifted: int | None, seed: int) -> TrainBatch:
    """μ = the given logprobs + small noise; sequence `drifted` gets noise far beyond MirrorPop's δ."""
    rng = np.random.default_rng(seed)
    noise = rng.normal(0, 0.02, logprobs.shape)
    if drifted is not None:
        a, b = batch.cu_seqlens[drifted], batch.cu_seqlens[drifted + 1]
        noise[a:b] += 2.0
    mu = np.where(batch.loss_mask, logprobs + noise, 0).astype(np.float32)
    return dataclasses.replace(batch, behaviour_logprobs=mu)


def weights(backend: Trainer | MegatronBackend) -> dict[str, torch.Tensor]:
    return {n: t.detach().float().cpu() for n, t in backend.named_weights()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def shared_tmpdir() -> Path:
    name = [tempfile.mkdtemp(prefix="kiln-megatron-") if rank0() else None]
    dist.broadcast_object_list(name, src=0)
    return Path(name[0])


def megatron_logits(backend: MegatronBackend, batch: TrainBatch) -> torch.Tensor:
    """Full-vocabulary logits [N, V] (TP slices all-gathered), float32, one packed row."""
    tokens = torch.as_tensor(batch.tokens, device=backend.device)
    cu = batch.cu_seqlens
    pos = torch.as_tensor(np.concatenate([np.arange(b - a) for a, b in zip(cu, cu[1:])]), device=backend.device)
    backend.model.eval()
    with torch.no_grad():
        local = packed_forward(backend.model, tokens, pos, [int(x) for x in cu], backend.rope)[0].float()
    tp = backend.layout.tp
    if tp > 1:
        from megatron.core import parallel_state

        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        local = torch.cat(parts, dim=-1)
    return local[:, : backend.shape.vocab_size]


def initial_weights(device) -> dict[str, torch.Tensor]:
    """SMALL's seeded init as the backend saw it: built on the backend's device (the values depend on
    the device type), then brought to the CPU."""
    return {n: t.cpu() for n, t in build_model(SMALL, device).state_dict().items()}


def hf_logits(cfg: ModelConfig, batch: TrainBatch, device) -> torch.Tensor:
    model = build_model(cfg, device)
    out = []
    with torch.no_grad():
        for a, b in zip(batch.cu_seqlens, batch.cu_seqlens[1:]):
            ids = torch.as_tensor(batch.tokens[a:b], device=device)[None]
            out.append(model(input_ids=ids, use_cache=False).logits[0].float())
    del model
    return torch.cat(out)


def token_logprobs(logits: torch.Tensor, batch: TrainBatch, temperature: float) -> torch.Tensor:
    """Token-aligned log softmax(logits / T) of each next token, 0 at sequence starts (the backend's
    `logprobs` convention), from full logits [N, V]."""
    lp = torch.log_softmax(logits / temperature, dim=-1)
    tokens = torch.as_tensor(batch.tokens, device=logits.device)
    out = torch.zeros(len(tokens), device=logits.device)
    for a, b in zip(batch.cu_seqlens, batch.cu_seqlens[1:]):
        if b - a > 1:
            out[a + 1 : b] = lp[a : b - 1].gather(1, tokens[a + 1 : b, None])[:, 0]
    return out.cpu()


def diff_stats(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a.float() - b.float()).abs()
    return float(d.max()), float(d.mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timed steps")
    parser.add_argument("--profile", action="store_true", help="top 25 CUDA kernels of an SFT step, before/after")
    args = parser.parse_args()
    device = init_distributed("cuda")
    world = dist.get_world_size()
    started = time.perf_counter()
    learner = LearnerConfig(backend="megatron", lr=1e-3, micro_batch_tokens=1024, grad_clip=1.0)
    algo = AlgoConfig()
    batch = make_batch(SMALL, [300, 517, 128, 700, 64, 911, 400], seed=1)
    state: dict = {}

    def small_backend(tp: int, pp: int = 1) -> Trainer:
        return Trainer(
            MegatronBackend(
                SMALL, dataclasses.replace(learner, tensor_parallel=tp, pipeline_parallel=pp), device=device
            ),
            algo,
            temperature=T,
        )

    # ---------------------------------------------------------------- TP = 1 (DP = world)
    b1 = None

    @check("build TP=1")
    def _():
        nonlocal b1
        b1 = small_backend(1)
        row("build TP=1", True, f"dp={b1.backend.layout.dp} padded_vocab={b1.backend.shape.padded_vocab_size}")

    @check("HF->Megatron->HF round trip")
    def _():
        ref = initial_weights(device)
        got = weights(b1) if b1 else {}
        expected = [n for n in ref if not (n == "lm_head.weight" and b1.backend.shape.tied_embeddings)]
        exact = set(got) == set(expected) and all(torch.equal(got[n], ref[n].float()) for n in expected)
        row("HF->Megatron->HF round trip", exact, f"{len(got)} tensors, bit-exact={exact}")

    @check("TP=1 vs HF logits")
    def _():
        mg = megatron_logits(b1.backend, batch)
        hf = hf_logits(SMALL, batch, device)
        lmax, lmean = diff_stats(mg, hf)
        lp_mg = b1.logprobs(batch, T)
        pmax, pmean = diff_stats(lp_mg, token_logprobs(hf, batch, T))
        state["lp_tp1"], state["logits_tp1"] = lp_mg, mg.cpu()
        ok = lmean < 2e-2 and pmean < 2e-2
        row(
            "TP=1 vs HF logits",
            ok,
            f"logits max {lmax:.3g} mean {lmean:.3g}; logprobs(T={T}) max {pmax:.3g} mean {pmean:.3g} (bf16)",
            logits_max=lmax,
            logits_mean=lmean,
            logprobs_max=pmax,
            logprobs_mean=pmean,
        )

    @check("export_hf reloads in transformers")
    def _():
        from transformers import AutoModelForCausalLM

        path = shared_tmpdir() / "export"
        b1.export_hf(path)
        exact = True
        if rank0():
            reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).state_dict()
            ref = initial_weights(device)
            exact = set(reloaded) == set(ref) and all(torch.equal(reloaded[n], ref[n]) for n in ref)
        row("export_hf reloads in transformers", exact, f"bit-exact={exact}")

    @check("train step TP=1")
    def _():
        state["batch"] = train_batch = with_behaviour(batch, state["lp_tp1"].numpy(), drifted=2, seed=5)
        before = weights(b1)
        result = b1.train_step(train_batch)
        after = weights(b1)
        moved = max_diff(before, after)
        state["step_tp1"], state["weights_tp1"] = result, after
        ok = (
            math.isfinite(result.loss)
            and moved > 0
            and result.trained_tokens > 0
            and result.metrics["kept_fraction"] < 1
        )
        row(
            "train step TP=1",
            ok,
            f"loss {result.loss:.4g} grad_norm {result.grad_norm:.4g} "
            f"kept {result.metrics['kept_fraction']:.2f} trained_tokens {result.trained_tokens} "
            f"max|Δw| {moved:.3g} {result.seconds:.2f}s",
            loss=result.loss,
            grad_norm=result.grad_norm,
        )

    @check("checkpoint save/load")
    def _():
        path = shared_tmpdir() / "ckpt"
        saved = weights(b1)
        b1.save_checkpoint(path)
        # Behaviour logprobs from the current weights: the earlier step's updates moved the policy
        # past MirrorPop's δ for the original batch, which would then train nothing.
        b1.train_step(with_behaviour(state["batch"], b1.logprobs(state["batch"], T).numpy(), drifted=None, seed=6))
        changed = max_diff(saved, weights(b1))
        b1.load_checkpoint(path)
        restored = max_diff(saved, weights(b1))
        again = b1.train_step(state["batch"])  # same step from the restored optimizer state
        ok = changed > 0 and restored == 0 and math.isfinite(again.loss)
        row("checkpoint save/load", ok, f"moved {changed:.3g} after save, restored diff {restored:.3g}")

    del b1
    gc.collect()
    torch.cuda.empty_cache()

    # ---------------------------------------------------------------- TP = 2
    if world >= 2 and world % 2 == 0:
        b2 = None

        @check("TP=2 vs TP=1 logits")
        def _():
            nonlocal b2
            b2 = small_backend(2)
            mg = megatron_logits(b2.backend, batch).cpu()
            lmax, lmean = diff_stats(mg, state["logits_tp1"])
            pmax, pmean = diff_stats(b2.logprobs(batch, T), state["lp_tp1"])
            row(
                "TP=2 vs TP=1 logits",
                lmean < 1e-2 and pmean < 1e-2,
                f"logits max {lmax:.3g} mean {lmean:.3g}; logprobs max {pmax:.3g} mean {pmean:.3g}",
                logits_max=lmax,
                logits_mean=lmean,
                logprobs_max=pmax,
                logprobs_mean=pmean,
            )

        @check("train step DP vs TP layout")
        def _():
            result = b2.train_step(state["batch"])
            ref = state["step_tp1"]
            wdiff = max_diff(weights(b2), state["weights_tp1"])
            rel = abs(result.loss - ref.loss) / max(abs(ref.loss), 1e-6)
            # bf16 layouts differ by rounding only; the first Adam step moves each weight by ~lr·sign(g),
            # so a few near-zero gradients of opposite sign give weight differences up to ~2·lr.
            ok = (
                abs(result.loss - ref.loss) <= 2e-2 * abs(ref.loss) + 1e-3
                and abs(result.grad_norm - ref.grad_norm) <= 5e-2 * ref.grad_norm
                and result.trained_tokens == ref.trained_tokens
            )
            row(
                "train step DP vs TP layout",
                ok,
                f"(tp1,dp{world}) loss {ref.loss:.5g} gn {ref.grad_norm:.4g} vs (tp2,dp{world // 2}) loss "
                f"{result.loss:.5g} gn {result.grad_norm:.4g}; max|Δw| between layouts {wdiff:.3g}",
                loss_rel_diff=rel,
                weight_diff=wdiff,
            )

        del b2
        gc.collect()
        torch.cuda.empty_cache()
    else:
        row("TP=2 vs TP=1 logits", None, "needs 2 GPUs (torchrun --nproc-per-node 2)")
        row("train step DP vs TP layout", None, "needs 2 GPUs")

    # ---------------------------------------------------------------- PP = 2
    if world >= 2 and world % 2 == 0:
        pipeline_rows(small_backend, batch, state, world)
    else:
        for name in (
            "PP=2 weights from both stages",
            "PP=2 vs PP=1 logprobs",
            "RL step PP=2 vs PP=1",
            "PP=2 memory vs plan",
        ):
            row(name, None, "needs 2 GPUs (torchrun --nproc-per-node 2)")

    # ---------------------------------------------------------------- throughput
    throughput(learner, algo, device, world, steps=2 if args.quick else 4, profile=args.profile)

    if rank0():
        print(f"\n{'check':36s} {'status':6s} detail")
        for r in ROWS:
            print(f"{r['check']:36s} {r['status']:6s} {r['detail']}")
        print(f"total {time.perf_counter() - started:.0f}s on {world} x {torch.cuda.get_device_name()}")
        out = os.environ.get("OUT")
        if out:
            Path(out, "megatron_gpu_check.json").write_text(json.dumps(ROWS, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# -------------------------------------------------------------------- pipeline parallelism (2 GPUs)


def pipeline_rows(small_backend, batch: TrainBatch, state: dict, world: int) -> None:
    """PP=2 (TP=1; DP = world / 2) against the (TP=1, DP=world) rows above: the same initial weights,
    logprobs and RL step; then the memory of a ~1.1B PP=2 step against the plan."""
    b = None

    @check("PP=2 weights from both stages")
    def _():
        nonlocal b
        b = small_backend(1, pp=2)
        ref = initial_weights(b.backend.device)
        got = weights(b)
        expected = [n for n in ref if not (n == "lm_head.weight" and b.backend.shape.tied_embeddings)]
        exact = set(got) == set(expected) and all(torch.equal(got[n], ref[n].float()) for n in expected)
        row(
            "PP=2 weights from both stages",
            exact,
            f"stage {b.backend.layout.pp_rank} of 2 yields {len(got)} tensors, bit-exact={exact}",
        )

    @check("PP=2 vs PP=1 logprobs")
    def _():
        pmax, pmean = diff_stats(b.logprobs(batch, T), state["lp_tp1"])
        row(
            "PP=2 vs PP=1 logprobs",
            pmean < 1e-2,
            f"logprobs max {pmax:.3g} mean {pmean:.3g} (bf16)",
            logprobs_max=pmax,
            logprobs_mean=pmean,
        )

    @check("RL step PP=2 vs PP=1")
    def _():
        result = b.train_step(state["batch"])
        ref = state["step_tp1"]
        wdiff = max_diff(weights(b), state["weights_tp1"])
        ok = (
            abs(result.loss - ref.loss) <= 2e-2 * abs(ref.loss) + 1e-3
            and abs(result.grad_norm - ref.grad_norm) <= 5e-2 * ref.grad_norm
            and result.trained_tokens == ref.trained_tokens
        )
        row(
            "RL step PP=2 vs PP=1",
            ok,
            f"(pp1,dp{world}) loss {ref.loss:.5g} gn {ref.grad_norm:.4g} vs (pp2,dp{world // 2}) loss {result.loss:.5g} "
            f"gn {result.grad_norm:.4g}; max|Δw| {wdiff:.3g}",
            loss=result.loss,
            grad_norm=result.grad_norm,
            weight_diff=wdiff,
        )

    del b
    free()

    @check("PP=2 memory vs plan")
    def _():
        learner = LearnerConfig(backend="megatron", lr=0.0, micro_batch_tokens=8192, pipeline_parallel=2)
        big = Trainer(
            MegatronBackend(LARGE, learner, device=torch.device("cuda", torch.cuda.current_device())),
            AlgoConfig(),
            temperature=1.0,
        )
        layout = big.backend.layout
        sequences = make_batch(LARGE, [2048] * (16 * layout.dp), seed=9)  # 4 micro-batches per DP replica
        big.sft_step(sequences)  # the optimizer's state exists from here on
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        result = big.sft_step(sequences)
        peak = torch.cuda.max_memory_allocated()
        estimate = plan_estimate(learner, tp=1, pp=2, dp=layout.dp, stage=layout.pp_rank)
        ratio = peak / estimate
        peaks = [None] * world
        dist.all_gather_object(peaks, (layout.pp_rank, peak / 2**30, estimate / 2**30, ratio))
        ok = all(abs(r - 1) <= 0.15 for *_, r in peaks) and math.isfinite(result.loss)
        row(
            "PP=2 memory vs plan",
            ok,
            "; ".join(
                f"stage {s}: peak {p:.1f} GiB vs plan {e:.1f} GiB ({r:.2f}x)"
                for s, p, e, r in sorted(peaks)[:: world // 2]
            ),
            stages=peaks,
        )
        del big
        free()


def plan_estimate(learner: LearnerConfig, *, tp: int, pp: int, dp: int, stage: int) -> float:
    """The placement plan's bytes for this pipeline stage of the LARGE model under `learner`."""
    from launch.driver.model_memory import megatron_stage_memory, model_shape

    stages = megatron_stage_memory(model_shape(LARGE), learner, tp=tp, pp=pp, dp=dp)
    return sum((stages[0] if stage == 0 else stages[-1]).values())


# -------------------------------------------------------------------- throughput and kernels


VARIANTS = {  # learner.megatron switches: every one off, each alone, all on
    "plain": dict(fused_logprobs=False, fused_swiglu=False, fused_rope=False),
    "fused_logprobs": dict(fused_logprobs=True, fused_swiglu=False, fused_rope=False),
    "fused_swiglu": dict(fused_logprobs=False, fused_swiglu=True, fused_rope=False),
    "fused_rope": dict(fused_logprobs=False, fused_swiglu=False, fused_rope=True),
    "all fused": dict(fused_logprobs=True, fused_swiglu=True, fused_rope=True),
}


def throughput(learner: LearnerConfig, algo: AlgoConfig, device, world: int, *, steps: int, profile: bool) -> None:
    big, n_params = None, 0
    per_gpu = 8192

    @check("throughput ~1B")
    def _():
        nonlocal big, n_params
        # lr = 0: the same arithmetic, but the weights stay put, so μ stays on-policy and MirrorPop keeps
        # every sequence in every timed RL step (a moving policy would make it drop them all).
        big = Trainer(
            MegatronBackend(LARGE, dataclasses.replace(learner, micro_batch_tokens=per_gpu, lr=0.0), device=device),
            algo,
            temperature=1.0,
        )
        n_params = sum(t.numel() for _, t in big.named_weights())
        row(
            "throughput ~1B",
            True,
            f"N={n_params / 1e9:.2f}B, {per_gpu} tok/GPU/step (4 x 2048), "
            f"dp={big.backend.layout.dp}, TP=1; MFU = 6·N·tokens/(s·989e12)",
            params=n_params,
        )

    if big is None:
        return
    backend = big.backend
    dp = backend.layout.dp
    tokens_batch = make_batch(LARGE, [2048] * (4 * dp), seed=7)
    rl_batch = with_behaviour(tokens_batch, big.logprobs(tokens_batch, 1.0).numpy(), drifted=None, seed=8)

    def timed(fn) -> float:
        fn(rl_batch)  # warm-up (and the compiled kernels' first compilation)
        fn(rl_batch)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            fn(rl_batch)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / steps

    mfu = {}
    for name, switches in VARIANTS.items():

        @check(f"SFT step: {name}")
        def _():
            backend.kernels = Kernels(**switches, compile=True)
            torch.cuda.reset_peak_memory_stats()
            sft_s = timed(big.sft_step)
            peak = torch.cuda.max_memory_allocated()
            estimate = plan_estimate(
                dataclasses.replace(learner, micro_batch_tokens=per_gpu, megatron=MegatronKernelsConfig(**switches)),
                tp=1,
                pp=1,
                dp=dp,
                stage=0,
            )
            mfu[name] = 6 * n_params * per_gpu / (sft_s * H100_BF16_FLOPS)
            extra = ""
            if name in ("plain", "all fused"):
                rl_s = timed(big.train_step)
                kept = big.train_step(rl_batch).metrics["kept_fraction"]
                if kept < 1.0:
                    raise RuntimeError(f"MirrorPop kept only {kept:.2f} of the timed RL batch: not a full step")
                extra = f"; RL step {rl_s:.3f}s MFU(10N) {10 * n_params * per_gpu / (rl_s * H100_BF16_FLOPS):.1%}"
            row(
                f"SFT step: {name}",
                True,
                f"{sft_s:.3f}s {per_gpu / sft_s:,.0f} tok/s/GPU MFU {mfu[name]:.1%}{extra}; peak {peak / 2**30:.1f} GiB "
                f"vs plan {estimate / 2**30:.1f} GiB ({peak / estimate:.2f}x)",
                seconds=sft_s,
                mfu=mfu[name],
                peak_gib=peak / 2**30,
                plan_gib=estimate / 2**30,
                device=torch.cuda.get_device_name(),
            )

    if "plain" in mfu and "all fused" in mfu:
        row(
            "MFU target (>= 40%)",
            mfu["all fused"] >= 0.40,
            f"SFT step {mfu['plain']:.1%} -> {mfu['all fused']:.1%} with every switch on (dp={dp})",
        )
    if profile:
        for name in ("plain", "all fused"):

            @check(f"profile: {name}")
            def _():
                backend.kernels = Kernels(**VARIANTS[name], compile=True)
                big.sft_step(rl_batch)  # warm
                table = kernel_table(lambda: big.sft_step(rl_batch))
                if rank0():
                    print(f"\n[gpu_check] top CUDA kernels of one SFT step ({name}):\n{table}", flush=True)
                    out = os.environ.get("OUT")
                    if out:
                        Path(out, f"profile_sft_{name.replace(' ', '_')}.md").write_text(table + "\n")
                row(
                    f"profile: {name}",
                    True,
                    "top 25 kernels printed above" + (" and in $OUT" if os.environ.get("OUT") else ""),
                )

    del big
    free()


def kernel_table(step, top: int = 25) -> str:
    """torch.profiler over one call of `step`: the `top` CUDA kernels by GPU time, as a markdown
    table, and how the step's GPU time splits into GEMMs, attention, communication and the rest."""
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
    time_of = lambda e: getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)  # noqa: E731
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
    return "\n".join(lines)


if __name__ == "__main__":
    main()
