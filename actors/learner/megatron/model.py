"""A megatron-core `GPTModel` built from an HF config, and the tensors that go in and out of it.

Owns: the TransformerConfig for Qwen3/Qwen2/Llama (RMSNorm, SwiGLU, GQA, Qwen3's q/k norm, Qwen2's
qkv bias; no other biases, no dropout), the local layer spec with `SDPAAttention` as core attention
(which also applies RoPE, so the GPTModel has position_embedding_type "none"; Transformer Engine is
not required), one pipeline stage's part of the model, copying HF weights into this rank's TP shards
of its stage, gathering full tensors back from the TP group and every pipeline stage, the
packed-sequence forward, and vocab-parallel token logprobs and entropies at a temperature (`Kernels`
chooses between the plain fp32 path and the chunked, compiled one of `logprobs`). Megatron is
imported here and in the other modules of this package only.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

from actors.learner.megatron import grad_accumulation
from actors.learner.megatron import hf_mapping as hm
from actors.learner.megatron import logprobs as chunked
from actors.learner.megatron.attention import PackedSequences, RotaryTables, SDPAAttention

PARAM_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def rope_theta(hf_config) -> float:
    """The RoPE base; other RoPE variants (llama3, yarn, ...) are refused: megatron's local rotary
    embedding would silently compute different positions."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported by the megatron backend (only 'default')")
    theta = getattr(hf_config, "rope_theta", None) or params.get("rope_theta")
    if theta is None:
        raise ValueError("the HF config names no rope_theta")
    return float(theta)


@dataclass
class Kernels:
    """Which kernels the model runs; each switch can change between steps (gpu_check times both sides
    of each in one process). `learner.megatron` in the config sets them."""

    fused_logprobs: bool = (
        True  # chunked logprobs/entropies by compiled kernels (`logprobs`), else fp32 over all logits
    )
    logprob_chunk_rows: int = 2048  # rows per chunk of the chunked path
    fused_swiglu: bool = True  # megatron's compiled SwiGLU (fwd and bwd) instead of silu and mul apart
    fused_rope: bool = True  # RoPE of q and k by one compiled kernel each (attention.py)
    # weight-gradient GEMMs accumulate into the fp32 main grads (grad_accumulation.py; the backend: CUDA only)
    fused_grad_accumulation: bool = True
    # the optimizer's grad norm and clip by torch multi-tensor kernels, no sync per tensor (grad_clip.py)
    fused_grad_clip: bool = True
    compile: bool = True  # the fused paths use torch.compile (False on CPU: the same chunked math, eager)


def transformer_config(
    hf_config, shape: hm.ModelShape, *, tensor_parallel: int, dtype: str, pipeline_parallel: int = 1
) -> TransformerConfig:
    params_dtype = PARAM_DTYPES[dtype]
    config = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        # The loss is already divided by the global kept-token count: DDP must sum, not average.
        calculate_per_token_loss=True,
        # Weights always come from an HF state dict, but megatron tags TP-sharded weights
        # (`tensor_model_parallel`) only while initialising them; untagged, the grad norm (and so the
        # clip) would count every sharded weight on TP rank 0 alone, as if it were replicated.
        perform_initialization=True,
        bias_activation_fusion=False,  # the SwiGLU switch (Kernels.fused_swiglu), set per forward
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    # Micro-batches are packed rows of different lengths: the pipeline sends each activation's shape
    # first. Set after construction: __post_init__ refuses it together with the default MoE token
    # dispatcher, which a dense model never uses.
    config.variable_seq_lengths = pipeline_parallel > 1
    return config


def layer_spec(shape: hm.ModelShape):
    spec = get_gpt_layer_local_spec(qk_layernorm=shape.qk_norm, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SDPAAttention
    return spec


def build_gpt(
    hf_config,
    shape: hm.ModelShape,
    *,
    tensor_parallel: int,
    dtype: str,
    max_seq_len: int,
    stage: hm.Stage | None = None,
    on_cpu: bool = False,
) -> GPTModel:
    """This pipeline stage's part (all of it by default) of an uninitialised GPTModel on the current CUDA
    device, or on the CPU for tests (parallel state must be set up)."""
    if dtype not in PARAM_DTYPES:
        raise ValueError(f"the megatron backend trains in {sorted(PARAM_DTYPES)}, not {dtype!r}")
    hm.check_tp(shape, tensor_parallel)
    stage = stage or hm.stage(shape)
    config = transformer_config(
        hf_config, shape, tensor_parallel=tensor_parallel, dtype=dtype, pipeline_parallel=stage.size
    )
    config.use_cpu_initialization = on_cpu
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(shape),
        vocab_size=shape.padded_vocab_size,
        max_sequence_length=max_seq_len,
        pre_process=stage.pre_process,
        post_process=stage.post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tied_embeddings,
        position_embedding_type="none",  # RoPE happens in SDPAAttention (see attention.py)
    )
    # The local spec's norms are torch.nn.RMSNorm, created in float32 whatever params_dtype says
    # (Megatron-LM's Float16Module casts the same way); mixed dtypes would break the next matmul.
    # torch's RMSNorm is also created on the default device: move it to where megatron's layers live (the
    # DDP wrapper re-homes the trained model's parameters, but a frozen reference model has no wrapper).
    device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
    model = model.to(device=device, dtype=config.params_dtype)
    model.kiln_stage = stage
    return model


def swiglu_functions() -> tuple:
    """megatron's SwiGLU forward and backward as plain functions (megatron compiles them with its
    `jit_fuser`; `fused_swiglu` runs those): for timing them under other compile settings
    (launch/bench/learner_kernels.py)."""
    from megatron.core.fusions import fused_bias_swiglu

    plain = lambda fn: getattr(fn, "_torchdynamo_orig_callable", fn)
    return plain(fused_bias_swiglu.swiglu), plain(fused_bias_swiglu.swiglu_back)


def use_kernels(model: GPTModel, kernels: Kernels) -> None:
    """Apply the switches megatron reads from the model's config and layers at every forward."""
    model.config.bias_activation_fusion = kernels.fused_swiglu and kernels.compile
    grad_accumulation.switch(model, kernels.fused_grad_accumulation)


# ------------------------------------------------------------------------------ weights


def local_parameters(model: GPTModel, shape: hm.ModelShape) -> dict[str, torch.nn.Parameter]:
    """This rank's parameters by their whole-model megatron name, checked against the mapping's names
    for its pipeline stage (a parameter the mapping does not know would silently never reach the
    engines)."""
    params = dict(model.named_parameters())
    expected = hm.stage_names(shape, model.kiln_stage)
    if set(params) != {local for local, _ in expected}:
        names = {local for local, _ in expected}
        extra, missing = sorted(set(params) - names)[:4], sorted(names - set(params))[:4]
        raise RuntimeError(f"GPTModel parameters differ from the mapping: extra {extra}, missing {missing}")
    return {whole: params[local] for local, whole in expected}


@torch.no_grad()
def load_hf_weights(model: GPTModel, hf: Mapping[str, torch.Tensor], shape: hm.ModelShape) -> None:
    """Copy this TP rank's shard of every HF tensor its pipeline stage holds into `model`."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    for name, param in local_parameters(model, shape).items():
        local = hm.shard(name, hm.to_megatron(name, hf, shape), tp)[rank]
        if local.shape != param.shape:
            raise ValueError(f"{name}: HF shard shape {tuple(local.shape)} != model {tuple(param.shape)}")
        param.copy_(local.to(device=param.device, dtype=param.dtype))


def _tp_gathered(name: str, param: torch.Tensor) -> torch.Tensor:
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1 or hm.parallel_kind(name) == "replicated":
        return param.detach()
    shards = [torch.empty_like(param) for _ in range(tp)]
    torch.distributed.all_gather(
        shards, param.detach().contiguous(), group=parallel_state.get_tensor_model_parallel_group()
    )
    return hm.gather(name, shards)


@torch.no_grad()
def full_megatron_tensors(model: GPTModel, shape: hm.ModelShape) -> Iterator[tuple[str, torch.Tensor]]:
    """(whole-model megatron name, full tensor) of every parameter of every pipeline stage, stage by
    stage: TP shards all-gathered within the stage that holds them, then broadcast from that stage
    to the others of the pipeline group, so every rank gets every tensor. Every rank must consume
    this iterator in step (each tensor is a collective)."""
    here = model.kiln_stage
    mine = local_parameters(model, shape)
    group = parallel_state.get_pipeline_model_parallel_group() if here.size > 1 else None
    ranks = torch.distributed.get_process_group_ranks(group) if group is not None else []
    dtype = model.config.params_dtype
    device = next(iter(mine.values())).device
    for pp_rank in range(here.size):
        for _, name in hm.stage_names(shape, hm.stage(shape, here.size, pp_rank)):
            if pp_rank == here.rank:
                full = _tp_gathered(name, mine[name])
            else:
                full = torch.empty(hm.full_shape(name, shape), dtype=dtype, device=device)
            if group is not None:
                full = full.contiguous()
                torch.distributed.broadcast(full, src=ranks[pp_rank], group=group)
            yield name, full


def hf_tensors(model: GPTModel, shape: hm.ModelShape) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors of the whole model in megatron's parameter order (collective, like
    `full_megatron_tensors`); a later stage's copy of a tied embedding is left out."""
    for name, full in full_megatron_tensors(model, shape):
        if not hm.is_tied_copy(name, shape):
            yield from hm.to_hf(name, full, shape)


# ------------------------------------------------------------------------------ forward


def rotary_tables(hf_config, shape: hm.ModelShape) -> RotaryTables:
    return RotaryTables(rope_theta(hf_config), shape.head_dim)


def packed_forward(
    model,
    tokens: torch.Tensor,
    position_ids: torch.Tensor,
    boundaries: list[int],
    rope: RotaryTables,
    *,
    fused_rope: bool = False,
) -> torch.Tensor:
    """The model's output for one packed row of whole sequences: on the last pipeline stage the logits
    [1, t, padded_vocab / tp] (this rank's vocab slice), on the others the hidden states [t, 1, h]
    that go to the next stage (a stage after the first takes its input from the schedule, not from
    `tokens`). `boundaries` are the token offsets [0, ..., t] of the row's sequences (empty ones are
    dropped) and `position_ids` restart at 0 in each."""
    bounds = [b for i, b in enumerate(boundaries) if i == 0 or b != boundaries[i - 1]]
    packed = PackedSequences.build(bounds, position_ids, rope, fused_rope=fused_rope)
    return model(input_ids=tokens[None], position_ids=position_ids[None], attention_mask=None, packed_seq_params=packed)


def vocab_slice(local_columns: int, vocab_size: int) -> chunked.VocabSlice:
    """This TP rank's columns of the logits: which are real vocabulary ids, and the group to reduce over."""
    start = parallel_state.get_tensor_model_parallel_rank() * local_columns
    return chunked.VocabSlice(
        start=start,
        valid=max(0, min(local_columns, vocab_size - start)),
        group=parallel_state.get_tensor_model_parallel_group(),
    )


def vocab_parallel_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, vocab_size: int, kernels: Kernels | None = None
) -> torch.Tensor:
    """float32 log softmax(logits / T)[target] from this rank's vocab slice of the logits [t, V/tp],
    over the HF model's vocabulary (padding columns are left out). Fused: `logprobs.token_logprobs`
    (the backward writes into the logits' storage: nothing else may backpropagate through them).
    Plain: an fp32 copy of all logits through megatron's vocab-parallel cross entropy (−log p)."""
    kernels = kernels or Kernels(fused_logprobs=False)
    if kernels.fused_logprobs:
        return chunked.token_logprobs(
            logits,
            targets,
            temperature,
            vocab_slice(logits.shape[-1], vocab_size),
            chunk_rows=kernels.logprob_chunk_rows,
            compiled=kernels.compile,
            overwrite=True,
        )
    local = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * local
    scaled = logits.float() / temperature
    if start + local > vocab_size:
        pad = torch.arange(start, start + local, device=logits.device) >= vocab_size
        scaled = scaled.masked_fill(pad, float("-inf"))
    nll = tensor_parallel.vocab_parallel_cross_entropy(scaled[:, None, :], targets[:, None])
    return -nll[:, 0]


@torch.no_grad()
def vocab_parallel_entropy(
    logits: torch.Tensor, temperature: float, vocab_size: int, kernels: Kernels | None = None
) -> torch.Tensor:
    """float32 entropy of softmax(logits / T) over the HF model's vocabulary [t], from this rank's vocab
    slice of the logits [t, V/tp]: a metric, so no gradient. Row chunks bound the float32 temporaries
    (compiled kernels when `kernels.fused_logprobs`); every TP rank has the same t, so they make the
    same all-reduces."""
    kernels = kernels or Kernels(fused_logprobs=False)
    return chunked.token_entropy(
        logits,
        temperature,
        vocab_slice(logits.shape[-1], vocab_size),
        chunk_rows=kernels.logprob_chunk_rows,
        compiled=kernels.fused_logprobs and kernels.compile,
    )
