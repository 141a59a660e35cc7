"""The megatron-core learner backend (DESIGN.md §7), GPU only.

  hf_mapping  HF <-> megatron weight names/layouts and TP sharding (pure torch; no megatron import)
  attention   SDPA core attention for packed sequences (replaces megatron's unfused local attention)
  model       GPTModel from an HF config; weight load/gather; packed forward; vocab-parallel logprobs
  parallel    torch.distributed + megatron TP x DP groups; micro-batch split over DP ranks
  backend     MegatronBackend (LearnerBackend): train/SFT steps, logprobs, weights, checkpoints

The GPU acceptance table lives with the tools:
`torchrun --nproc-per-node 2 -m launch.bench.gpu_megatron`.

Importing this package imports nothing from megatron; its modules other than hf_mapping do.
"""
