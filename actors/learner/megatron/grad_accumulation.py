"""Weight gradients accumulated straight into megatron's fp32 main grads (`fused_grad_accumulation`).

Without it each linear layer's backward writes its weight gradient in bf16, and megatron DDP's
backward hook then adds it into the weight's fp32 `main_grad`: one more kernel per weight and
micro-batch, which reads the bf16 gradient and reads and writes the fp32 buffer (in the 1.12B model's
SFT step on an H200, 130 adds and 4.2 ms), and the gradient is rounded to bf16 before it is summed.

With it the weight-gradient GEMM itself computes main_grad += grad_outputᵀ · input with an fp32
output (`torch.addmm(..., out_dtype=torch.float32)`, CUDA only). Megatron does this through Apex's
`fused_weight_gradient_mlp_cuda` extension, which cannot be installed on Kiln's GPU hosts. `install()`
hands megatron this module's torch implementation of that extension's two functions; `switch()`
sets the flag each linear layer passes to its autograd function at every forward, so a switch
takes effect at the next step. A weight whose gradient went into main_grad is marked
(`grad_added_to_main_grad`), DDP's hook skips its add for it, and `zero_grad_buffer` clears the mark.

The backend turns it on for CUDA only: megatron's fused branch allocates its placeholder gradient on
the current CUDA device (the CPU tests send that allocation to the CPU).
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import layers
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad [out, in] += grad_outputᵀ [out, t] · total_input [t, in], summed and written in fp32
    (Apex's signature)."""
    if total_input.dtype == main_grad.dtype:
        main_grad.addmm_(grad_output.t(), total_input)
    elif main_grad.is_cuda:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=torch.float32, out=main_grad)
    else:  # the CPU has no mixed-dtype GEMM: the same product of the upcast inputs
        main_grad.addmm_(grad_output.t().float(), total_input.float())


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """The same into a main grad of the inputs' own dtype (megatron's DDP with grad_reduce_in_fp32 off)."""
    main_grad.addmm_(grad_output.t(), total_input)


class _Extension:
    """What megatron calls in place of Apex's extension module."""

    wgrad_gemm_accum_fp32 = staticmethod(wgrad_gemm_accum_fp32)
    wgrad_gemm_accum_fp16 = staticmethod(wgrad_gemm_accum_fp16)


def install() -> None:
    """Give megatron's linear layers the torch implementation, unless Apex's own extension loaded."""
    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = _Extension
        layers._grad_accum_fusion_available = True


def switch(model: torch.nn.Module, on: bool) -> int:
    """Set every tensor-parallel linear layer of `model` to accumulate into main_grad (`on`) or to
    leave the add to DDP's hook; returns how many layers it set. Only a model whose parameters have
    main grads (wrapped by megatron's DDP) can: a bare model (a frozen reference, a test's) is left
    to autograd's own weight gradients."""
    on = on and any(hasattr(p, "main_grad") for p in model.parameters())
    if on:
        install()
    count = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.gradient_accumulation_fusion = on
            count += 1
    return count
