"""The megatron-core learner backend (docs/training.md), GPU only.

  hf_mapping  HF <-> megatron weight names/layouts, TP sharding, pipeline stages (pure torch; no megatron import)
  attention   SDPA core attention for packed sequences (replaces megatron's unfused local attention)
  logprobs    chunked vocab-parallel token logprobs and entropies (pure torch; compiled kernels optional)
  grad_accumulation  weight-gradient GEMMs that add into megatron's fp32 main grads (Apex's hook, in torch)
  grad_clip   the optimizer's grad norm and clip by torch multi-tensor kernels (Apex's hooks, in torch)
  model       one stage's GPTModel from an HF config; weight load/gather; packed forward; kernel switches
  parallel    torch.distributed + megatron TP x DP x PP groups
  backend     MegatronBackend (LearnerBackend): forward_backward on megatron's schedule, optimizer
              step, weights, checkpoints (the RL and SFT steps are actors.learner.algorithm's)

The GPU acceptance table lives with the tools:
`torchrun --nproc-per-node 2 -m launch.bench.gpu_megatron`.

Importing this package imports nothing from megatron; its modules other than hf_mapping and logprobs do.
"""
