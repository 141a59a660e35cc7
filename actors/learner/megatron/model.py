"""A megatron-core `GPTModel` built from an HF config, and the tensors that go in and out of it.

Owns: the TransformerConfig for Qwen3/Qwen2/Llama (RMSNorm, SwiGLU, GQA, Qwen3's q/k norm, Qwen2's
qkv bias; no other biases, no dropout), the local layer spec with `SDPAAttention` as core attention
(which also applies RoPE, so the GPTModel has position_embedding_type "none"; Transformer Engine is
not required), copying HF weights into this rank's TP shards, gathering full tensors back from the
TP group, the packed-sequence forward, and vocab-parallel token logprobs and entropies at a
temperature. Megatron is imported here and in the other modules of this package only.
"""

from __future__ import annotations

from typing import Iterator, Mapping

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

from actors.learner.losses import ENTROPY_ROWS
from actors.learner.megatron import hf_mapping as hm
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


def transformer_config(hf_config, shape: hm.ModelShape, *, tensor_parallel: int, dtype: str) -> TransformerConfig:
    params_dtype = PARAM_DTYPES[dtype]
    return TransformerConfig(
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
        pipeline_model_parallel_size=1,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        # The loss is already divided by the global kept-token count: DDP must sum, not average.
        calculate_per_token_loss=True,
        # Weights always come from an HF state dict, but megatron tags TP-sharded weights
        # (`tensor_model_parallel`) only while initialising them; untagged, the grad norm (and so the
        # clip) would count every sharded weight on TP rank 0 alone, as if it were replicated.
        perform_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )


def layer_spec(shape: hm.ModelShape):
    spec = get_gpt_layer_local_spec(qk_layernorm=shape.qk_norm, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SDPAAttention
    return spec


def build_gpt(hf_config, shape: hm.ModelShape, *, tensor_parallel: int, dtype: str, max_seq_len: int,
              on_cpu: bool = False) -> GPTModel:
    """An uninitialised GPTModel on the current CUDA device, or on the CPU for tests (parallel state
    must be set up)."""
    if dtype not in PARAM_DTYPES:
        raise ValueError(f"the megatron backend trains in {sorted(PARAM_DTYPES)}, not {dtype!r}")
    hm.check_tp(shape, tensor_parallel)
    config = transformer_config(hf_config, shape, tensor_parallel=tensor_parallel, dtype=dtype)
    config.use_cpu_initialization = on_cpu
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(shape),
        vocab_size=shape.padded_vocab_size,
        max_sequence_length=max_seq_len,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tied_embeddings,
        position_embedding_type="none",  # RoPE happens in SDPAAttention (see attention.py)
    )
    # The local spec's norms are torch.nn.RMSNorm, created in float32 whatever params_dtype says
    # (Megatron-LM's Float16Module casts the same way); mixed dtypes would break the next matmul.
    # torch's RMSNorm is also created on the default device: move it to where megatron's layers live (the
    # DDP wrapper re-homes the trained model's parameters, but a frozen reference model has no wrapper).
    device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
    return model.to(device=device, dtype=config.params_dtype)


# ------------------------------------------------------------------------------ weights


def local_parameters(model: GPTModel, shape: hm.ModelShape) -> dict[str, torch.nn.Parameter]:
    """This rank's parameters by megatron name, checked against the mapping's names (a parameter the
    mapping does not know would silently never reach the engines)."""
    params = dict(model.named_parameters())
    expected = hm.megatron_names(shape)
    if set(params) != set(expected):
        extra, missing = sorted(set(params) - set(expected))[:4], sorted(set(expected) - set(params))[:4]
        raise RuntimeError(f"GPTModel parameters differ from the mapping: extra {extra}, missing {missing}")
    return {name: params[name] for name in expected}


@torch.no_grad()
def load_hf_weights(model: GPTModel, hf: Mapping[str, torch.Tensor], shape: hm.ModelShape) -> None:
    """Copy this TP rank's shard of every HF tensor into `model`."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    for name, param in local_parameters(model, shape).items():
        local = hm.shard(name, hm.to_megatron(name, hf, shape), tp)[rank]
        if local.shape != param.shape:
            raise ValueError(f"{name}: HF shard shape {tuple(local.shape)} != model {tuple(param.shape)}")
        param.copy_(local.to(device=param.device, dtype=param.dtype))


@torch.no_grad()
def full_megatron_tensors(model: GPTModel, shape: hm.ModelShape) -> Iterator[tuple[str, torch.Tensor]]:
    """(megatron name, full tensor) for every parameter, TP shards all-gathered. Every rank of the TP
    group must consume this iterator in step (each tensor is a collective)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    for name, param in local_parameters(model, shape).items():
        if tp == 1 or hm.parallel_kind(name) == "replicated":
            yield name, param.detach()
            continue
        shards = [torch.empty_like(param) for _ in range(tp)]
        torch.distributed.all_gather(shards, param.detach().contiguous(), group=group)
        yield name, hm.gather(name, shards)


def hf_tensors(model: GPTModel, shape: hm.ModelShape) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors in megatron's parameter order (collective, like `full_megatron_tensors`)."""
    for name, full in full_megatron_tensors(model, shape):
        yield from hm.to_hf(name, full, shape)


# ------------------------------------------------------------------------------ forward


def rotary_tables(hf_config, shape: hm.ModelShape) -> RotaryTables:
    return RotaryTables(rope_theta(hf_config), shape.head_dim)


def packed_forward(model, tokens: torch.Tensor, position_ids: torch.Tensor, boundaries: list[int],
                   rope: RotaryTables) -> torch.Tensor:
    """Logits [t, padded_vocab / tp] (this rank's vocab slice) of one packed row of whole sequences;
    `boundaries` are the token offsets [0, ..., t] of its sequences (empty ones are dropped) and
    `position_ids` restart at 0 in each."""
    bounds = [b for i, b in enumerate(boundaries) if i == 0 or b != boundaries[i - 1]]
    packed = PackedSequences.build(bounds, position_ids, rope)
    logits = model(input_ids=tokens[None], position_ids=position_ids[None], attention_mask=None,
                   packed_seq_params=packed)
    return logits[0]


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                            vocab_size: int) -> torch.Tensor:
    """float32 log softmax(logits / T)[target] from this rank's vocab slice of the logits [t, V/tp]:
    megatron's vocab-parallel cross entropy is −log p. Padding rows of the vocabulary (ids >= the
    HF vocab size) are masked to −inf so the distribution is the HF model's."""
    local = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * local
    scaled = logits.float() / temperature
    if start + local > vocab_size:
        pad = torch.arange(start, start + local, device=logits.device) >= vocab_size
        scaled = scaled.masked_fill(pad, float("-inf"))
    nll = tensor_parallel.vocab_parallel_cross_entropy(scaled[:, None, :], targets[:, None])
    return -nll[:, 0]


@torch.no_grad()
def vocab_parallel_entropy(logits: torch.Tensor, temperature: float, vocab_size: int) -> torch.Tensor:
    """float32 entropy of softmax(logits / T) over the full vocabulary [t], from this rank's vocab slice
    of the logits [t, V/tp]. A metric, so no gradient; padding rows of the vocabulary are left out, as
    in `vocab_parallel_logprobs`. Row chunks of ENTROPY_ROWS bound the float32 temporaries; every TP
    rank has the same t, so they make the same all-reduces: per chunk, the max, Σ e^z and Σ e^z·z.
    With z = logits / T - max: H = log Σ e^z - Σ e^z·z / Σ e^z."""
    local = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * local
    group = parallel_state.get_tensor_model_parallel_group()
    real = torch.arange(start, start + local, device=logits.device) < vocab_size
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for row in range(0, logits.shape[0], ENTROPY_ROWS):
        scaled = (logits[row:row + ENTROPY_ROWS].float() / temperature).masked_fill(~real, float("-inf"))
        top = scaled.max(dim=-1).values
        torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=group)
        z = (scaled - top[:, None]).masked_fill(~real, 0.0)
        e = torch.exp(z).masked_fill(~real, 0.0)
        sums = torch.stack([e.sum(-1), (e * z).sum(-1)])
        torch.distributed.all_reduce(sums, group=group)
        out[row:row + ENTROPY_ROWS] = torch.log(sums[0]) - sums[1] / sums[0]
    return out
