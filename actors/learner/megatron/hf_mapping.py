"""HF (Qwen2/Qwen3/Llama) <-> megatron-core GPTModel weights, megatron tensor-parallel sharding and
pipeline stages.

Pure torch, no megatron import: it runs and is tested on CPU. Four layers of one contract:

* `ModelShape` — the sizes both sides agree on (taken from an HF config).
* `Stage` / `stage_names` — which parameters a pipeline stage holds: megatron numbers each stage's
  decoder layers from 0, so a stage's names map to the whole model's names (`decoder.layers.{first
  + i}`); every function below speaks whole-model names.
* `to_megatron` / `to_hf` — one megatron parameter <-> the HF tensors it is made of, as full (unsharded)
  tensors. Megatron fuses q/k/v into `linear_qkv` in per-KV-group order [group g: its q heads, k_g, v_g]
  (what `SelfAttention.get_query_key_value_tensors` splits), and gate/up into `linear_fc1` as
  [gate; up] (what the SwiGLU `glu` chunks). Vocabulary rows are padded to `padded_vocab_size`.
* `shard` / `gather` — a full megatron tensor <-> its TP shards: column-parallel along dim 0 (qkv as
  contiguous chunks, which keep whole KV groups, or the slices megatron reassembles when there are
  fewer groups than ranks), fc1 with gate and up split separately so rank r holds [gate_r; up_r],
  row-parallel along dim 1, vocab-parallel rows for embeddings and output layer, norms replicated.

Everything is bit-exact: conversions only reshape, concatenate and slice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

Named = tuple[str, torch.Tensor]

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama")
VOCAB_PAD_MULTIPLE = 64  # rows per TP rank are padded to a multiple of this (aligned GEMMs)


@dataclass(frozen=True)
class ModelShape:
    """The dense decoder sizes the HF and megatron layouts share."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head's q and k
    qkv_bias: bool  # Qwen2: biases on q/k/v (no other linear has one)
    padded_vocab_size: int

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads {self.num_kv_heads} must divide num_heads {self.num_heads}")
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError("padded_vocab_size is below vocab_size")

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, config, tensor_parallel: int = 1) -> ModelShape:
        """Sizes from a transformers config; the vocabulary is padded so every TP rank gets an equal,
        aligned slice."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
        if getattr(config, "attention_bias", False) and model_type != "qwen2":
            raise ValueError(f"{model_type} with attention_bias=True (bias on o_proj too) is not supported")
        if getattr(config, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        if getattr(config, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qk_norm=model_type == "qwen3",
            qkv_bias=model_type == "qwen2",
            padded_vocab_size=padded_vocab_size(config.vocab_size, tensor_parallel),
        )


def padded_vocab_size(vocab_size: int, tensor_parallel: int) -> int:
    step = VOCAB_PAD_MULTIPLE * tensor_parallel
    return math.ceil(vocab_size / step) * step


# ------------------------------------------------------------------------------ names


def _layer(i: int) -> str:
    return f"decoder.layers.{i}."


def _layer_suffixes(shape: ModelShape) -> list[str]:
    """The parameters of one decoder layer, after its "decoder.layers.{i}." prefix, in megatron's order."""
    names = ["input_layernorm.weight", "self_attention.linear_qkv.weight"]
    if shape.qkv_bias:
        names.append("self_attention.linear_qkv.bias")
    if shape.qk_norm:
        names += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    return names + [
        "self_attention.linear_proj.weight",
        "pre_mlp_layernorm.weight",
        "mlp.linear_fc1.weight",
        "mlp.linear_fc2.weight",
    ]


@dataclass(frozen=True)
class Stage:
    """What one pipeline stage of `size` holds: decoder layers [first_layer, first_layer + num_layers)
    (megatron splits them evenly and names them from 0 on every stage), the embedding on the first
    stage, the final norm and the output layer on the last. With tied embeddings and more than one
    stage the last stage holds its own copy of the embedding as `output_layer.weight` (megatron keeps
    the copies equal by summing their gradients); with one stage the output layer reuses the embedding."""

    rank: int
    size: int
    first_layer: int
    num_layers: int

    @property
    def pre_process(self) -> bool:
        return self.rank == 0

    @property
    def post_process(self) -> bool:
        return self.rank == self.size - 1

    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)


def stage(shape: ModelShape, pipeline_parallel: int = 1, pp_rank: int = 0) -> Stage:
    """Pipeline stage `pp_rank` of `pipeline_parallel` (ValueError when the layers do not split evenly)."""
    if not 0 <= pp_rank < pipeline_parallel:
        raise ValueError(f"pipeline rank {pp_rank} is outside a pipeline of {pipeline_parallel}")
    if shape.num_layers % pipeline_parallel:
        raise ValueError(f"pipeline_parallel={pipeline_parallel} does not divide num_layers {shape.num_layers}")
    per_stage = shape.num_layers // pipeline_parallel
    return Stage(rank=pp_rank, size=pipeline_parallel, first_layer=pp_rank * per_stage, num_layers=per_stage)


def stage_names(shape: ModelShape, where: Stage) -> list[tuple[str, str]]:
    """(name on the stage, name in the whole model) of every megatron parameter the stage holds, in
    megatron's order. Every mapping function below takes whole-model names."""
    out = []
    if where.pre_process:
        out.append(("embedding.word_embeddings.weight",) * 2)
    for local, layer in enumerate(where.layers()):
        out += [(_layer(local) + suffix, _layer(layer) + suffix) for suffix in _layer_suffixes(shape)]
    if where.post_process:
        out.append(("decoder.final_layernorm.weight",) * 2)
        if not shape.tied_embeddings or not where.pre_process:
            out.append(("output_layer.weight",) * 2)
    return out


def megatron_names(shape: ModelShape) -> list[str]:
    """Every megatron parameter name of the model on one stage, in a fixed order (embedding, layers, head)."""
    return [name for name, _ in stage_names(shape, stage(shape))]


def is_tied_copy(mg_name: str, shape: ModelShape) -> bool:
    """A later stage's copy of the tied embedding: its values are the embedding's, exported once."""
    return mg_name == "output_layer.weight" and shape.tied_embeddings


def full_shape(mg_name: str, shape: ModelShape) -> tuple[int, ...]:
    """The shape of the full (TP-gathered) megatron tensor `mg_name`: what a stage that does not hold
    it receives from the stage that does."""
    h, d, ffn = shape.hidden_size, shape.head_dim, shape.intermediate_size
    if mg_name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return (shape.padded_vocab_size, h)
    if mg_name == "decoder.final_layernorm.weight":
        return (h,)
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * d
    shapes = {
        "input_layernorm.weight": (h,),
        "pre_mlp_layernorm.weight": (h,),
        "self_attention.linear_qkv.weight": (qkv, h),
        "self_attention.linear_qkv.bias": (qkv,),
        "self_attention.q_layernorm.weight": (d,),
        "self_attention.k_layernorm.weight": (d,),
        "self_attention.linear_proj.weight": (h, shape.num_heads * d),
        "mlp.linear_fc1.weight": (2 * ffn, h),
        "mlp.linear_fc2.weight": (h, ffn),
    }
    _, rest = _split_layer_name(mg_name)
    if rest not in shapes:
        raise KeyError(f"unknown megatron parameter {mg_name!r}")
    return shapes[rest]


# HF name (after the "model.layers.{i}." prefix) of each megatron parameter that maps one to one.
_LAYER_ONE_TO_ONE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_TOP_ONE_TO_ONE = {"decoder.final_layernorm.weight": "model.norm.weight"}


def _split_layer_name(mg_name: str) -> tuple[int, str]:
    parts = mg_name.split(".", 3)  # decoder, layers, i, rest
    if len(parts) != 4 or parts[:2] != ["decoder", "layers"] or not parts[2].isdigit():
        raise KeyError(f"unknown megatron parameter {mg_name!r}")
    return int(parts[2]), parts[3]


def hf_sources(mg_name: str, shape: ModelShape) -> list[str]:
    """The HF names that megatron parameter `mg_name` is built from."""
    if mg_name == "embedding.word_embeddings.weight":
        return ["model.embed_tokens.weight"]
    if mg_name == "output_layer.weight":  # tied: a later pipeline stage's copy of the embedding
        return ["model.embed_tokens.weight" if shape.tied_embeddings else "lm_head.weight"]
    if mg_name in _TOP_ONE_TO_ONE:
        return [_TOP_ONE_TO_ONE[mg_name]]
    i, rest = _split_layer_name(mg_name)
    p = f"model.layers.{i}."
    if rest in _LAYER_ONE_TO_ONE:
        return [p + _LAYER_ONE_TO_ONE[rest]]
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        return [p + f"self_attn.{x}_proj.{kind}" for x in "qkv"]
    if rest == "mlp.linear_fc1.weight":
        return [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
    raise KeyError(f"unknown megatron parameter {mg_name!r}")


# ------------------------------------------------------------------------------ conversion


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    g, hn = shape.num_kv_heads, shape.head_dim
    tail = q.shape[1:]  # (hidden,) for weights, () for biases
    q = q.reshape(g, shape.heads_per_group * hn, *tail)
    k = k.reshape(g, hn, *tail)
    v = v.reshape(g, hn, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def _unfuse_qkv(qkv: torch.Tensor, shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, hn = shape.num_kv_heads, shape.head_dim
    tail = qkv.shape[1:]
    grouped = qkv.reshape(g, (shape.heads_per_group + 2) * hn, *tail)
    q, k, v = torch.split(grouped, [shape.heads_per_group * hn, hn, hn], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _pad_vocab(t: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    if t.shape[0] != shape.vocab_size:
        raise ValueError(f"vocabulary tensor has {t.shape[0]} rows, expected {shape.vocab_size}")
    pad = shape.padded_vocab_size - shape.vocab_size
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def to_megatron(mg_name: str, hf: Mapping[str, torch.Tensor], shape: ModelShape) -> torch.Tensor:
    """The full megatron tensor `mg_name` built from HF tensors `hf` (a dict or any name lookup)."""
    sources = [hf[n] for n in hf_sources(mg_name, shape)]
    if mg_name == "embedding.word_embeddings.weight" or mg_name == "output_layer.weight":
        return _pad_vocab(sources[0], shape)
    if mg_name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        return _fuse_qkv(*sources, shape)
    if mg_name.endswith("linear_fc1.weight"):
        return torch.cat(sources, dim=0)
    return sources[0]


def to_hf(mg_name: str, tensor: torch.Tensor, shape: ModelShape) -> list[Named]:
    """The HF tensors (name, full tensor) that the full megatron tensor `mg_name` holds."""
    names = hf_sources(mg_name, shape)
    if mg_name == "embedding.word_embeddings.weight" or mg_name == "output_layer.weight":
        return [(names[0], tensor[: shape.vocab_size])]
    if mg_name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        return list(zip(names, _unfuse_qkv(tensor, shape), strict=True))
    if mg_name.endswith("linear_fc1.weight"):
        return list(zip(names, torch.chunk(tensor, 2, dim=0), strict=True))
    return [(names[0], tensor)]


def hf_to_megatron(hf: Mapping[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """A whole HF state dict as full megatron tensors. HF tensors that no megatron parameter uses
    (other than a tied lm_head and rotary buffers) are an error: they would be silently dropped."""
    out = {name: to_megatron(name, hf, shape) for name in megatron_names(shape)}
    used = {s for name in out for s in hf_sources(name, shape)}
    ignorable = {"lm_head.weight"} if shape.tied_embeddings else set()
    unused = [n for n in hf if n not in used and n not in ignorable and not n.endswith("rotary_emb.inv_freq")]
    if unused:
        raise ValueError(f"HF tensors with no megatron counterpart: {unused[:5]}")
    return out


def megatron_to_hf(mg: Mapping[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """Full megatron tensors as an HF state dict, in megatron's parameter order."""
    extra = set(mg) - set(megatron_names(shape))
    if extra:
        raise ValueError(f"megatron tensors the mapping does not know: {sorted(extra)[:5]}")
    return dict(pair for name in megatron_names(shape) for pair in to_hf(name, mg[name], shape))


# ------------------------------------------------------------------------------ TP sharding


def parallel_kind(mg_name: str) -> str:
    """How megatron splits parameter `mg_name` over TP ranks: column, swiglu, row, vocab or replicated."""
    if mg_name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return "vocab"
    if mg_name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        return "column"
    if mg_name.endswith("linear_fc1.weight"):
        return "swiglu"
    if mg_name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "row"
    return "replicated"


def _even_chunks(t: torch.Tensor, parts: int, dim: int, what: str) -> list[torch.Tensor]:
    if t.shape[dim] % parts:
        raise ValueError(f"{what}: dim {dim} of size {t.shape[dim]} does not split over {parts} TP ranks")
    return list(torch.chunk(t, parts, dim=dim))


def shard(mg_name: str, full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """The `tp` shards of full megatron tensor `mg_name`, rank order (views where possible)."""
    kind = parallel_kind(mg_name)
    if kind in ("column", "vocab"):
        return _even_chunks(full, tp, 0, mg_name)
    if kind == "row":
        return _even_chunks(full, tp, 1, mg_name)
    if kind == "swiglu":
        gate, up = torch.chunk(full, 2, dim=0)
        gates, ups = _even_chunks(gate, tp, 0, mg_name), _even_chunks(up, tp, 0, mg_name)
        return [torch.cat([g, u], dim=0) for g, u in zip(gates, ups, strict=True)]
    return [full] * tp


def gather(mg_name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full megatron tensor from its TP shards (rank order); inverse of `shard`."""
    kind = parallel_kind(mg_name)
    if kind in ("column", "vocab"):
        return torch.cat(shards, dim=0)
    if kind == "row":
        return torch.cat(shards, dim=1)
    if kind == "swiglu":
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    first = shards[0]
    for s in shards[1:]:
        if not torch.equal(s, first):
            raise ValueError(f"{mg_name}: replicated shards differ across TP ranks")
    return first


def check_tp(shape: ModelShape, tp: int) -> None:
    """Raise ValueError when megatron cannot split this model over `tp` ranks."""
    qkv_rows = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    problems = []
    if shape.num_heads % tp:
        problems.append(f"num_heads {shape.num_heads}")
    if shape.num_kv_heads % tp and tp % shape.num_kv_heads:
        problems.append(f"num_kv_heads {shape.num_kv_heads} (neither divides the other)")
    if qkv_rows % tp:
        problems.append(f"qkv rows {qkv_rows}")
    if shape.intermediate_size % tp:
        problems.append(f"intermediate_size {shape.intermediate_size}")
    if shape.padded_vocab_size % tp:
        problems.append(f"padded vocab {shape.padded_vocab_size}")
    if problems:
        raise ValueError(f"tensor_parallel={tp} does not divide: " + ", ".join(problems))


# ------------------------------------------------------------------------------ export


def buckets(named: Iterable[Named], bucket_bytes: int) -> Iterator[list[Named]]:
    """Group (name, tensor) pairs, in order, into lists of at most `bucket_bytes` (a single larger
    tensor gets a bucket of its own)."""
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be positive")
    bucket: list[Named] = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket
