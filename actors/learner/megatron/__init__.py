"""The megatron-core learner backend (DESIGN.md §7), GPU only.

  hf_mapping  HF <-> megatron weight names/layouts and TP sharding (pure torch; no megatron import)
  attention   SDPA core attention for packed sequences (replaces megatron's unfused local attention)
  model       GPTModel from an HF config; weight load/gather; packed forward; vocab-parallel logprobs, entropy
  parallel    torch.distributed + megatron TP x DP groups
  backend     MegatronBackend (LearnerBackend): forward_backward on megatron's schedule, optimizer
              step, weights, checkpoints (the RL and SFT steps are actors.learner.algorithm's)
  gpu_check   the GPU acceptance table (`torchrun --nproc-per-node 2 -m actors.learner.megatron.gpu_check`)

Importing this package imports nothing from megatron; its modules other than hf_mapping do.
"""
