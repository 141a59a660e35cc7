"""The optimizer's gradient norm and clip as torch multi-tensor kernels (`fused_grad_clip`).

Megatron computes the global gradient norm and scales the gradients through Apex's (or TE's)
multi-tensor kernels. Neither can be installed on Kiln's GPU hosts, and megatron's own fallback
(`megatron.core.utils.local_multi_tensor_l2_norm` and `local_multi_tensor_scale`) works tensor by
tensor:
- the norm of each of the ~90 fp32 gradient shards is its own kernel, and all of them go to the host
  one by one (`torch.tensor` of a list of device scalars): ~90 device-to-host syncs per optimizer
  step. At each one the GPU's queue runs dry, and the GPU waits while the host launches the next
  work;
- the clip is a multiply into a new tensor and a copy back, two kernels per gradient.

This module's `l2norm` and `scale` honour the same contracts with `torch._foreach_norm` and
`torch._foreach_mul_`/`_foreach_copy_`. That is a few kernels for all the tensors, and no host sync:
megatron still reads the norm once, after its all-reduce. `switch(on)` swaps them into megatron's
optimizer modules (it calls them through module globals at every step), or puts megatron's own back.
"""

from __future__ import annotations

import torch
from megatron.core.optimizer import clip_grads
from megatron.core.optimizer import optimizer as megatron_optimizer

# What megatron chose at import (Apex's, TE's, or its per-tensor fallback), restored by switch(False).
_MEGATRON = {
    (clip_grads, "l2_norm_impl"): clip_grads.l2_norm_impl,
    (clip_grads, "multi_tensor_scale_impl"): clip_grads.multi_tensor_scale_impl,
    (megatron_optimizer, "multi_tensor_scale_impl"): megatron_optimizer.multi_tensor_scale_impl,
}


def l2norm(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]], per_tensor: bool, *args
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`amp_C.multi_tensor_l2norm`'s contract: the L2 norm of all of `tensor_lists[0]` together, as a
    one-element float32 tensor on their device, and each tensor's norm when `per_tensor`."""
    norms = torch.stack([n.float() for n in torch._foreach_norm(tensor_lists[0])])
    return torch.linalg.vector_norm(norms).reshape(1), norms if per_tensor else None


def scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]], factor: float) -> None:
    """`amp_C.multi_tensor_scale`'s contract: tensor_lists[1][i] = tensor_lists[0][i] * factor."""
    sources, targets = tensor_lists
    if not sources:
        return
    if all(s is t for s, t in zip(sources, targets, strict=True)):
        torch._foreach_mul_(targets, factor)  # the clip: in place
    elif factor == 1.0:
        torch._foreach_copy_(targets, sources)
    else:
        torch._foreach_copy_(targets, torch._foreach_mul(sources, factor))


_OURS = {
    (clip_grads, "l2_norm_impl"): l2norm,
    (clip_grads, "multi_tensor_scale_impl"): scale,
    (megatron_optimizer, "multi_tensor_scale_impl"): scale,
}


def switch(on: bool) -> None:
    """Make megatron's optimizer use this module's kernels (`on`) or what it chose itself."""
    for (module, name), impl in (_OURS if on else _MEGATRON).items():
        setattr(module, name, impl)
