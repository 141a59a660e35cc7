"""A preset's Megatron learner alone, on its own parallel layout: the learner's ranks without the
engines and verifiers of its run, one RL step, then each rank's memory against the plan.

    python -m launch.bench.learner_layout configs/eight_gpu.yaml --plan       # any machine: the layout, the estimate
    torchrun --nproc-per-node 4 -m launch.bench.learner_layout configs/eight_gpu.yaml [a.b=c ...]

The torchrun processes are the learner's ranks: `cluster.learner_gpus` of them, as TP ×
PP × DP with DP = learner_gpus ÷ (TP · PP), the layout `kiln train` gives the learner. So a layout
can be checked on a host with as many GPUs as the learner alone needs: configs/eight_gpu.yaml's
TP = 2 × DP = 2 learner on four GPUs, before its eight-GPU run. The step, the batch (2·PP
micro-batches of `learner.micro_batch_tokens` per DP replica, in one update) and the table are
those of the paper-shaped stand-in (launch/bench/paper_standin.py). Prints one table; JSON goes to
$OUT/learner_layout.json when $OUT is set. Exit status 0 when the steps are finite and every rank's
peak is within 15% of its stage's estimate, 1 when not, 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from configs import ConfigError, KilnConfig, load_config
from launch.bench.paper_standin import Standin, one_update, report, run
from launch.driver.model_memory import GIB, megatron_stage_memory, model_shape


def layout_of(cfg: KilnConfig) -> Standin | str:
    """The preset's learner as it will run, with its plan per pipeline stage; or a one-line error."""
    learner, cluster = cfg.learner, cfg.cluster
    if learner.backend != "megatron":
        return f"learner.backend is {learner.backend!r}: the layout check is for the megatron learner"
    tp, pp = learner.tensor_parallel, learner.pipeline_parallel
    if cluster.learner_gpus < 1 or cluster.learner_gpus % (tp * pp):
        return f"cluster.learner_gpus={cluster.learner_gpus} is not a multiple of TP·PP = {tp * pp}"
    if not cluster.gpu_memory_gb:
        return "cluster.gpu_memory_gb is not set: the plan needs one GPU's memory"
    dp = cluster.learner_gpus // (tp * pp)
    stages = megatron_stage_memory(model_shape(cfg.model), learner, tp=tp, pp=pp, dp=dp)
    return Standin(cfg.model, learner, cluster.gpu_memory_gb, tuple(sum(s.values()) / GIB for s in stages))


def describe(s: Standin) -> str:
    m, learner = s.model, s.learner
    tp, pp = learner.tensor_parallel, learner.pipeline_parallel
    return (
        f"learner: {m.num_layers} layers of {m.hidden_size} ({m.num_heads}/{m.num_kv_heads} heads, MLP "
        f"{m.intermediate_size}, vocabulary {m.vocab_size}), {model_shape(m).params / 1e9:.2f}B parameters, "
        f"TP={tp} x PP={pp}; plan per stage " + ", ".join(f"{g:.1f}" for g in s.stages_gib) + f" GiB of {s.gpu_gib:g}"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.bench.learner_layout", description=__doc__.split("\n")[0])
    p.add_argument("config", help="the preset (YAML)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    p.add_argument("--plan", action="store_true", help="print the layout and the plan's estimate; start nothing")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"learner_layout: {err}", file=sys.stderr)
        return 2
    s = layout_of(cfg)
    if isinstance(s, str):
        print(f"learner_layout: {s}", file=sys.stderr)
        return 2
    dp = cfg.cluster.learner_gpus // (s.learner.tensor_parallel * s.learner.pipeline_parallel)
    if args.plan:
        print(f"{describe(s)}; DP={dp}, {cfg.cluster.learner_gpus} GPUs")
        return 0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != cfg.cluster.learner_gpus:
        print(
            f"learner_layout: {world} process(es), but the learner has {cfg.cluster.learner_gpus} ranks: "
            f"torchrun --nproc-per-node {cfg.cluster.learner_gpus}",
            file=sys.stderr,
        )
        return 2
    result = run(s, cfg.rollout.temperature, one_update(cfg.algo))
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return 0
    ok = report(f"{describe(s)}; DP={dp}", result)
    out = os.environ.get("OUT")
    if out:
        Path(out, "learner_layout.json").write_text(json.dumps({"layout": describe(s), "dp": dp, **result}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
