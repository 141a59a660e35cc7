"""The megatron-core learner backend (DESIGN.md §7), GPU only.

  hf_mapping  HF <-> megatron weight names/layouts and TP sharding (pure torch; no megatron import)
  attention   SDPA core attention for packed sequences (replaces megatron's unfused local attention)
  model       GPTModel from an HF config; weight load/gather; packed forward; vocab-parallel logprobs, entropy
  parallel    torch.distributed + megatron TP x DP groups
  backend     MegatronBackend (LearnerBackend): forward_backward on megatron's schedule, optimizer
              step, weights, checkpoints (the RL and SFT steps are actors.learner.algorithm's)

The GPU acceptance table lives with the tools:
`torchrun --nproc-per-node 2 -m launch.bench.gpu_megatron`.

Importing this package imports nothing from megatron; its modules other than hf_mapping do.
"""
