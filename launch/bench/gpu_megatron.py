"""GPU acceptance check of the megatron backend: prints one table, writes JSON to $OUT when set.

    torchrun --nproc-per-node 2 -m launch.bench.gpu_megatron [--quick] [--profile]   # all checks
    python -m launch.bench.gpu_megatron [--quick] [--profile]                        # 1 GPU: TP/PP/DP rows SKIP

Rows: HF -> megatron -> HF round trip through the live model (bit-exact), export_hf reloads in
transformers (bit-exact), TP=1 logits/logprobs vs the HF model (bf16), a training step (finite loss,
weights move, MirrorPop drops the drifted sequence), overlap_grad_reduce against the reduction after
backward (the same step, then a one-sequence batch that leaves a DP replica idle), checkpoint
save/load restores the weights, TP=2 vs TP=1 logits/logprobs, one train step under (TP=1, DP=2) vs
(TP=2, DP=1) from the same weights (same loss, grad norm and updated weights), PP=2 vs PP=1: the
weights gathered from both stages (bit-exact), logprobs through the pipeline, one RL step (same loss
and grad norm within bf16 rounding), and the memory of a ~1.1B model's PP=2 step on each stage
against the placement plan's estimate (within 15%). Throughput of a ~1.1B Qwen3-style model at 8192
tokens per GPU per step, for each kernel switch of `learner.megatron` on its own and all together
(and with DP > 1, all together on a model built with overlap_grad_reduce), with peak memory against
the plan's estimate: MFU = 6·N·tokens / (seconds · 989e12) for the SFT step; the RL step also runs
the no-grad π_prox pass before its updates and the no-grad drift pass after them, so it is counted
10·N. `--profile` adds torch.profiler's top 25 CUDA kernels of one SFT step with every switch off
and with every switch on, and where the GPU sat idle by the step's phases (trace_gaps.py; tables
printed and written to $OUT). Each row runs in its own try/except.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import math
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from actors.learner.algorithm import Trainer
from actors.learner.megatron.backend import MegatronBackend
from actors.learner.megatron.model import packed_forward
from actors.learner.megatron.parallel import init_distributed
from actors.policy.model import build_model
from configs import AlgoConfig, LearnerConfig, ModelConfig
from launch.bench.gpu_megatron_throughput import SEQUENCES_PER_GPU, throughput
from launch.bench.megatron_rows import (
    LARGE,
    ROWS,
    SMALL,
    T,
    check,
    free,
    make_batch,
    max_diff,
    plan_estimate,
    rank0,
    row,
    weights,
    with_behaviour,
)
from protocols import TrainBatch


def shared_tmpdir() -> Path:
    name = [tempfile.mkdtemp(prefix="kiln-megatron-") if rank0() else None]
    dist.broadcast_object_list(name, src=0)
    return Path(name[0])


def megatron_logits(backend: MegatronBackend, batch: TrainBatch) -> torch.Tensor:
    """Full-vocabulary logits [N, V] (TP slices all-gathered), float32, one packed row."""
    tokens = torch.as_tensor(batch.tokens, device=backend.device)
    cu = batch.cu_seqlens
    pos = torch.as_tensor(np.concatenate([np.arange(b - a) for a, b in itertools.pairwise(cu)]), device=backend.device)
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
        for a, b in zip(batch.cu_seqlens, batch.cu_seqlens[1:], strict=False):
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
    for a, b in zip(batch.cu_seqlens, batch.cu_seqlens[1:], strict=False):
        if b - a > 1:
            out[a + 1 : b] = lp[a : b - 1].gather(1, tokens[a + 1 : b, None])[:, 0]
    return out.cpu()


def diff_stats(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a.float() - b.float()).abs()
    return float(d.max()), float(d.mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 timed rounds instead of 8")
    parser.add_argument("--profile", action="store_true", help="top 25 CUDA kernels of an SFT step, before/after")
    parser.add_argument(
        "--sequences-per-gpu",
        type=int,
        default=SEQUENCES_PER_GPU,
        help=f"2048-token sequences per GPU in the throughput rows' step (default {SEQUENCES_PER_GPU}: the MFU target's 8192 tokens)",
    )
    args = parser.parse_args()
    device = init_distributed("cuda")
    world = dist.get_world_size()
    started = time.perf_counter()
    learner = LearnerConfig(backend="megatron", lr=1e-3, micro_batch_tokens=1024, grad_clip=1.0)
    algo = AlgoConfig()
    batch = make_batch(SMALL, [300, 517, 128, 700, 64, 911, 400], seed=1)
    state: dict = {}

    def small_backend(tp: int, pp: int = 1, overlap: bool = False) -> Trainer:
        megatron = dataclasses.replace(learner.megatron, overlap_grad_reduce=overlap)
        return Trainer(
            MegatronBackend(
                SMALL,
                dataclasses.replace(learner, tensor_parallel=tp, pipeline_parallel=pp, megatron=megatron),
                device=device,
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

    if world >= 2:
        overlap_row(small_backend, b1, state)
    else:
        row("overlap_grad_reduce vs not", None, "needs 2 GPUs (DP = 2)")

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

    b1 = None  # frees the model; the checks above read b1 through their closures, so it stays bound
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

        b2 = None  # frees the model (the checks above read b2 through their closures)
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
    throughput(
        learner,
        algo,
        device,
        world,
        rounds=4 if args.quick else 8,
        profile=args.profile,
        sequences=args.sequences_per_gpu,
    )

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


# -------------------------------------------------------------------- overlapped gradient reduction


def overlap_row(small_backend, b1: Trainer, state: dict) -> None:
    """learner.megatron.overlap_grad_reduce against the reduction after backward (b1): the same step
    from the same weights, then a one-sequence batch, where one DP replica has no share and runs its
    zero-loss micro-batch so that its bucket reductions pair with the others'."""

    @check("overlap_grad_reduce vs not")
    def _():
        overlapped = small_backend(1, overlap=True)
        if not overlapped.backend.overlap_grad_reduce:
            raise RuntimeError("the backend did not turn overlap_grad_reduce on")
        first = overlapped.train_step(state["batch"])
        ref = state["step_tp1"]
        w_first = max_diff(weights(overlapped), state["weights_tp1"])
        one = make_batch(SMALL, [600], seed=11)
        one = with_behaviour(one, b1.logprobs(one, T).numpy(), drifted=None, seed=12)
        a, b = b1.train_step(one), overlapped.train_step(one)
        w_one = max_diff(weights(b1), weights(overlapped))
        # Each bucket's sum over two ranks is the one the single reduction makes, so the gradients agree;
        # only the grad norm's summation order differs (the optimizer shards per bucket).
        close = lambda x, y, rel: abs(x - y) <= rel * abs(y) + 1e-6
        ok = (
            close(first.loss, ref.loss, 1e-3)
            and close(first.grad_norm, ref.grad_norm, 1e-3)
            and w_first <= 1e-3
            and close(b.loss, a.loss, 1e-3)
            and close(b.grad_norm, a.grad_norm, 1e-3)
            and w_one <= 1e-3
        )
        row(
            "overlap_grad_reduce vs not",
            ok,
            f"step: loss {first.loss:.6g} vs {ref.loss:.6g}, gn {first.grad_norm:.6g} vs {ref.grad_norm:.6g}, "
            f"max|Δw| {w_first:.3g}; one-sequence batch (a replica idle): loss {b.loss:.6g} vs {a.loss:.6g}, "
            f"gn {b.grad_norm:.6g} vs {a.grad_norm:.6g}, max|Δw| {w_one:.3g}",
            weight_diff=max(w_first, w_one),
        )


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

    b = None  # frees the model (the checks above read b through their closures)
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


if __name__ == "__main__":
    main()
