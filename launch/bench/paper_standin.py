"""The paper-shaped stand-in: configs/musacoder_27b.yaml's model, cut to the layers that fit four GPUs.

    python -m launch.bench.paper_standin --plan                 # any machine: the layers, the estimate
    torchrun --nproc-per-node 4 -m launch.bench.paper_standin   # one RL step on four GPUs, then memory

The full preset (27.2B parameters) needs 24 GPUs: its learner alone is TP=8 × PP=2, and bf16 weights
with fp32 gradients, master weights and Adam moments come to about 490 GB before activations.
`kiln train --config configs/musacoder_27b.yaml --dry-run` prints that plan. The stand-in is what
four GPUs can start of it:
- it keeps the preset's width, heads and KV heads, MLP width, vocabulary, sequence length,
  micro-batch tokens and learner kernels;
- it runs at TP=2 × PP=2. The preset's TP=8 needs eight GPUs; TP=2 × PP=2 keeps both kinds of
  parallelism the preset uses, the tensor-parallel all-reduces and the 1F1B pipeline;
- it has as many decoder layers as the placement plan's estimate fits. The stage that needs most
  (`megatron_stage_memory`) must stay within FIT of one GPU's memory (`--gpu-gib`; default the
  preset's `cluster.gpu_memory_gb`). The layer count is a multiple of PP.

The run makes one RL step (`Trainer.train_step`: the π_prox pass, MirrorPop, the update, the drift
pass) on a synthetic batch of 2·PP sequences of `learner.micro_batch_tokens` tokens each, in one update
(`ppo_minibatches=1`), so that the 1F1B pipeline is full and the first stage holds PP micro-batches'
activations, as the plan counts them. That first step creates the optimizer's state. The second step's peak memory per stage (`max_memory_allocated`)
is then checked against the plan's estimate for that stage, within TOLERANCE, as launch.bench.
gpu_megatron does for a 1.1B model. The result is printed as one table; JSON goes to $OUT when it is
set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

from configs import KilnConfig, LearnerConfig, ModelConfig, load_config
from launch.driver.model_memory import GIB, megatron_stage_memory, model_shape

PRESET = Path(__file__).resolve().parents[2] / "configs" / "musacoder_27b.yaml"
TENSOR_PARALLEL, PIPELINE_PARALLEL = 2, 2
# The share of a GPU the plan's estimate may fill. The rest is for what the estimate leaves out: the
# CUDA context, NCCL's buffers, the allocator's fragmentation, and the estimate's own error, which
# the check below allows up to 15%.
FIT = 0.85
TOLERANCE = 0.15


@dataclasses.dataclass(frozen=True)
class Standin:
    model: ModelConfig
    learner: LearnerConfig
    gpu_gib: float
    stages_gib: tuple[float, ...]  # the plan's estimate per pipeline stage, first to last


def standin(preset: KilnConfig, gpu_gib: float) -> Standin:
    """The preset's model with the most layers (a multiple of PP) whose every stage fits FIT · gpu_gib."""
    learner = dataclasses.replace(preset.learner, tensor_parallel=TENSOR_PARALLEL, pipeline_parallel=PIPELINE_PARALLEL)
    best = None
    for layers in range(PIPELINE_PARALLEL, preset.model.num_layers + 1, PIPELINE_PARALLEL):
        model = dataclasses.replace(preset.model, num_layers=layers)
        stages = tuple(sum(s.values()) / GIB for s in _stages(model, learner))
        if max(stages) > FIT * gpu_gib:
            break
        best = Standin(model, learner, gpu_gib, stages)
    if best is None:
        raise SystemExit(f"paper_standin: not even {PIPELINE_PARALLEL} layers fit {FIT:.0%} of {gpu_gib} GiB")
    return best


def _stages(model: ModelConfig, learner: LearnerConfig) -> list[dict[str, float]]:
    return megatron_stage_memory(
        model_shape(model), learner, tp=learner.tensor_parallel, pp=learner.pipeline_parallel, dp=1
    )


def describe(s: Standin) -> str:
    shape = model_shape(s.model)
    m = s.model
    return (
        f"stand-in: {m.num_layers} layers of {m.hidden_size} ({m.num_heads}/{m.num_kv_heads} heads, MLP "
        f"{m.intermediate_size}, vocabulary {m.vocab_size}), {shape.params / 1e9:.2f}B parameters, "
        f"TP={s.learner.tensor_parallel} x PP={s.learner.pipeline_parallel} on "
        f"{s.learner.tensor_parallel * s.learner.pipeline_parallel} GPUs; plan per stage "
        + ", ".join(f"{g:.1f}" for g in s.stages_gib)
        + f" GiB of {s.gpu_gib:g} (fit {FIT:.0%})"
    )


def one_update(algo):
    """The preset's algorithm with one update per batch: the batch's 2·PP micro-batches then fill the
    1F1B pipeline, so the first stage holds PP micro-batches' activations at its peak, as the plan
    counts them. With the preset's four mini-batches each update took one micro-batch; on four H100s
    the first stage then peaked at 0.83 of the plan (2026-11-28), a pipeline never filled."""
    return dataclasses.replace(algo, ppo_minibatches=1, ppo_epochs=1)


def sequence_lengths(s: Standin, micro_batches: int) -> list[int]:
    """The synthetic batch: `micro_batches` full micro-batches of sequences no longer than the model
    takes (eight_gpu.yaml's 16,384-token micro-batch holds two of its 8,192-token sequences)."""
    length = min(s.learner.micro_batch_tokens, s.model.max_seq_len)
    return [length] * (s.learner.micro_batch_tokens // length * micro_batches)


def run(s: Standin, temperature: float, algo) -> dict:
    """One RL step to create the optimizer's state, a second measured; each rank's peak vs its stage's
    estimate. Needs torchrun with TP·PP·DP processes, one GPU each; every DP replica gets 2·PP full
    micro-batches."""
    import torch
    import torch.distributed as dist

    from actors.learner.algorithm import Trainer
    from actors.learner.megatron.backend import MegatronBackend
    from actors.learner.megatron.parallel import init_distributed
    from launch.bench.megatron_rows import make_batch, with_behaviour

    device = init_distributed("cuda")
    built = time.perf_counter()
    trainer = Trainer(MegatronBackend(s.model, s.learner, device=device), algo, temperature=temperature)
    built = time.perf_counter() - built
    layout = trainer.backend.layout
    batch = make_batch(s.model, sequence_lengths(s, 2 * layout.pp * layout.dp), seed=0)
    batch = with_behaviour(batch, trainer.logprobs(batch, temperature).numpy(), drifted=None, seed=1)
    first = trainer.train_step(batch)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    second = trainer.train_step(batch)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / GIB
    estimate = s.stages_gib[0 if layout.pp_rank == 0 else -1]
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, (layout.pp_rank, layout.tp_rank, peak, estimate))
    return {
        "build_s": built,
        "steps": [_step(first), _step(second)],
        "ranks": [{"stage": r[0], "tp_rank": r[1], "peak_gib": r[2], "plan_gib": r[3]} for r in ranks],
    }


def _step(result) -> dict:
    return {"loss": result.loss, "grad_norm": result.grad_norm, "seconds": result.seconds, "tokens": result.tokens}


def report(description: str, result: dict) -> bool:
    """Prints the table under `description`; True when every step is finite and every rank's peak is
    within TOLERANCE."""
    ok = all(math.isfinite(step["loss"]) and math.isfinite(step["grad_norm"]) for step in result["steps"])
    print(description)
    print(f"built in {result['build_s']:.1f} s")
    for i, step in enumerate(result["steps"], 1):
        print(f"RL step {i}: loss {step['loss']:.5g}, grad norm {step['grad_norm']:.4g}, {step['seconds']:.2f} s")
    print("stage  TP rank  peak GiB  plan GiB  ratio  within")
    for r in sorted(result["ranks"], key=lambda r: (r["stage"], r["tp_rank"])):
        ratio = r["peak_gib"] / r["plan_gib"]
        within = abs(ratio - 1) <= TOLERANCE
        ok = ok and within
        print(f"{r['stage']:>5}  {r['tp_rank']:>7}  {r['peak_gib']:8.1f}  {r['plan_gib']:8.1f}  {ratio:5.2f}  {within}")
    print("PASS" if ok else "FAIL")
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", action="store_true", help="print the stand-in and the plan's estimate; start nothing")
    p.add_argument(
        "--gpu-gib", type=float, help="one GPU's memory in GiB (default: the preset's cluster.gpu_memory_gb)"
    )
    args = p.parse_args(argv)
    preset = load_config(PRESET)
    gpu_gib = args.gpu_gib or preset.cluster.gpu_memory_gb
    if not gpu_gib or gpu_gib <= 0:
        print("paper_standin: --gpu-gib must be a positive number of GiB", file=sys.stderr)
        return 2
    s = standin(preset, gpu_gib)
    if args.plan:
        print(describe(s))
        return 0
    result = run(s, preset.rollout.temperature, one_update(preset.algo))
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return 0
    ok = report(describe(s), result)
    out = os.environ.get("OUT")
    if out:
        Path(out, "paper_standin.json").write_text(json.dumps({"standin": describe(s), **result}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
