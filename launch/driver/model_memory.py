"""The model's sizes and the memory each role needs per GPU: what the placement plan
(launch/driver/plan.py) checks a config against. `model_shape` reads the sizes; `memory_estimate` and
`megatron_learner_memory` turn them into GiB per GPU.

Memory model (GiB = 2^30 bytes; an estimate to catch configs that cannot fit, not a promise):
* parameters: counted from the model section (random init, tied embeddings) or from
  `model.path/config.json` (biases of qwen2, the q/k norms of qwen3, untied heads where stated);
* learner, megatron (bf16 mixed precision, fp32 grad buffers, distributed optimizer), per GPU of the
  pipeline stage that needs most (`megatron_learner_memory`): the stage's parameters P / TP — L/PP
  decoder layers, plus the embedding on the first stage and the final norm and output layer on the
  last (a tied embedding has a copy there when PP > 1) — × (2 weights + 4 grads + 12/DP fp32 master
  weights and Adam moments); activations of `learner.micro_batch_tokens` tokens per micro-batch,
  per token and layer 8·h bytes that TP does not split (norm and linear inputs) plus
  (16·h + s·ffn) / TP (s = 10, or 6 with the fused SwiGLU), see MEGATRON_ACTIVATIONS; 1F1B keeps
  PP micro-batches of L/PP layers in flight on the first stage and one on the last, so PP does not
  shrink the first stage's share; and on the last stage the logits: 10·V bytes per token / TP on
  the plain fp32 path (bf16 logits, the fp32 softmax the cross entropy keeps, its fp32 gradient), 2
  with the chunked logprobs (bf16 logits whose storage takes the gradient) plus one chunk's fp32
  rows. torch learner: P × 4 × b (weights, grads, two AdamW moments, all in the model dtype of b
  bytes) and 56·h·L·b/2 bytes of activations per token (measured, see ACTIVATION_BYTES), plus 8·V
  bytes of fp32 logits and their gradient per token;
* engine, per GPU of an engine with tp GPUs: params·b / tp + KV cache
  2·L·ceil(kv_heads/tp)·head_dim·b × max_batch × max_seq_len; a launched SGLang server may use only
  `rollout.sglang.mem_fraction` of its GPU;
* verifier: a fixed reserve per execution worker (CUDA context + task tensors), see
  VERIFIER_GIB_PER_WORKER;
* colocated GPUs need max(learner, engine) since the engine releases its memory during learner
  steps; every other resident adds up.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from configs import KilnConfig, LearnerConfig, ModelConfig

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# A KernelBench candidate's execution worker: ~0.5 GiB CUDA context plus its inputs, outputs and
# the reference's; level-3 tasks stay well below this.
VERIFIER_GIB_PER_WORKER = 2.0
# Activation bytes per token, hidden unit and layer at 2-byte activations, without recompute, of the
# torch learner: the HF transformers model (sdpa attention, unfused MLP and norms), measured on an
# H100 on 2026-11-22 at 56.1-56.2 for the single_gpu and four_gpu preset models (ffn = 3·hidden);
# tests/launch/driver/test_plan.py::test_torch_learner_memory_matches_the_estimate (gpu) re-measures it.
ACTIVATION_BYTES = {"torch": 56}
# The megatron learner's activations per token and decoder layer, in bytes: replicated·h + (split·h +
# swiglu·ffn) / TP. Counted on CPU with saved-tensor hooks over megatron's local layer spec with
# Kiln's SDPA attention (Qwen3 shape: q = h, kv = h/2; bf16): 44·h + 10·ffn, of which 28·h are the
# fp32 copies that torch's composite CPU RMSNorm keeps and CUDA's fused RMSNorm does not (it keeps
# its bf16 input: + 8·h), so 24·h + 10·ffn on the GPU; the fused SwiGLU keeps only its input and
# output (6·ffn). `launch.bench.gpu_megatron` prints this estimate next to max_memory_allocated.
MEGATRON_ACTIVATIONS = {"replicated": 8, "split": 16, "swiglu": 10, "swiglu_fused": 6}
# Logits bytes per token and vocabulary entry (/ TP) on the last pipeline stage, by logprob path.
MEGATRON_LOGITS = {"plain": 10, "chunked": 2}


class PlanError(ValueError):
    """The config cannot be placed on the given GPUs; the message says what to change."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes that decide memory and parallelism."""

    params: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    source: str  # "model section" or the config.json it was read from


@dataclass(frozen=True)
class MemoryEstimate:
    """GiB per GPU of each role, with the parts that make it up."""

    learner_parts: dict[str, float]
    engine_parts: dict[str, float]
    engine_budget_fraction: float  # share of the GPU an engine may use (SGLang's mem fraction)
    verifier_gib: float

    @property
    def learner_gib(self) -> float:
        return sum(self.learner_parts.values())

    @property
    def engine_gib(self) -> float:
        return sum(self.engine_parts.values())


# ------------------------------------------------------------------------------------ the model


def model_shape(m: ModelConfig) -> ModelShape:
    """Sizes from `m.path/config.json` when the checkpoint is present here, else the model section."""
    config_json = Path(m.path) / "config.json" if m.path else None
    if config_json is not None and config_json.is_file():
        try:
            hf = json.loads(config_json.read_text())
            hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
            return _count(
                arch=str(hf.get("model_type", m.arch)),
                hidden=hidden,
                layers=int(hf["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                intermediate=int(hf["intermediate_size"]),
                vocab=int(hf["vocab_size"]),
                tied=bool(hf.get("tie_word_embeddings", False)),
                source=str(config_json),
            )
        except (ValueError, KeyError, TypeError) as err:
            raise PlanError(f"cannot read the model sizes from {config_json}: {err!r}") from None
    return _count(
        arch=m.arch,
        hidden=m.hidden_size,
        layers=m.num_layers,
        heads=m.num_heads,
        kv_heads=m.num_kv_heads,
        head_dim=m.hidden_size // m.num_heads,
        intermediate=m.intermediate_size,
        vocab=m.vocab_size,
        tied=True,
        source="model section",
    )


def _count(*, arch, hidden, layers, heads, kv_heads, head_dim, intermediate, vocab, tied, source) -> ModelShape:
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = hidden * q + 2 * hidden * kv + q * hidden
    if arch == "qwen2":
        attention += q + 2 * kv  # q/k/v biases
    if arch == "qwen3":
        attention += 2 * head_dim  # q_norm, k_norm
    per_layer = attention + 3 * hidden * intermediate + 2 * hidden  # + gate/up/down MLP, two norms
    params = layers * per_layer + vocab * hidden * (1 if tied else 2) + hidden
    return ModelShape(
        params=params,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=intermediate,
        vocab=vocab,
        tied_embeddings=tied,
        source=source,
    )


# ------------------------------------------------------------------------------------ memory


def memory_estimate(cfg: KilnConfig, s: ModelShape, tp: int, pp: int, dp: int, engine_gpus: int) -> MemoryEstimate:
    b = DTYPE_BYTES[cfg.model.dtype]
    if cfg.learner.backend == "megatron":
        learner = megatron_learner_memory(s, cfg.learner, tp=tp, pp=pp, dp=dp)
    else:
        tokens, shard = cfg.learner.micro_batch_tokens, s.params / (tp * pp)
        learner = {
            "weights": shard * b,
            "grads": shard * b,
            "optimizer": shard * 2 * b,
            "activations": tokens * ACTIVATION_BYTES["torch"] * s.hidden * s.layers * b / 2 / tp,
            "logits": tokens * s.vocab * 8 / tp,
        }
    etp = max(engine_gpus, 1)
    kv = 2 * s.layers * math.ceil(s.kv_heads / etp) * s.head_dim * b * cfg.rollout.max_batch * cfg.model.max_seq_len
    engine = {"weights": s.params * b / etp, "kv_cache": kv}
    launched_sglang = cfg.rollout.engine == "sglang" and not cfg.rollout.sglang.urls
    # The plan gives a cuda verifier actor one GPU, so all its sandbox workers are there (0 = one per GPU).
    verifier = VERIFIER_GIB_PER_WORKER * (cfg.verifier.run_workers or 1) if cfg.verifier.backend != "cpu" else 0.0
    return MemoryEstimate(
        learner_parts={k: v / GIB for k, v in learner.items()},
        engine_parts={k: v / GIB for k, v in engine.items()},
        engine_budget_fraction=cfg.rollout.sglang.mem_fraction if launched_sglang else 1.0,
        verifier_gib=verifier,
    )


def megatron_learner_memory(s: ModelShape, learner: LearnerConfig, *, tp: int, pp: int, dp: int) -> dict[str, float]:
    """Bytes per GPU of the megatron learner on its most loaded pipeline stage (the module docstring
    states the model), by part: weights, grads, optimizer, activations, logits."""
    return max(megatron_stage_memory(s, learner, tp=tp, pp=pp, dp=dp), key=lambda parts: sum(parts.values()))


def megatron_stage_memory(
    s: ModelShape, learner: LearnerConfig, *, tp: int, pp: int, dp: int
) -> list[dict[str, float]]:
    """`megatron_learner_memory`'s parts for each pipeline stage in order (first, then last)."""
    tokens, kernels = learner.micro_batch_tokens, learner.megatron
    embedding = s.vocab * s.hidden
    per_layer = (s.params - embedding * (1 if s.tied_embeddings else 2) - s.hidden) / s.layers
    layers = s.layers / pp
    a = MEGATRON_ACTIVATIONS
    act_per_layer = tokens * (
        a["replicated"] * s.hidden
        + (a["split"] * s.hidden + (a["swiglu_fused"] if kernels.fused_swiglu else a["swiglu"]) * s.intermediate) / tp
    )
    if kernels.fused_logprobs:
        logits = (
            tokens * s.vocab * MEGATRON_LOGITS["chunked"] / tp
            + min(tokens, kernels.logprob_chunk_rows) * s.vocab * 4 / tp
        )
    else:
        logits = tokens * s.vocab * MEGATRON_LOGITS["plain"] / tp

    def stage(first: bool, last: bool) -> dict[str, float]:
        params = layers * per_layer + (embedding if first else 0) + (s.hidden if last else 0)
        if last and (not s.tied_embeddings or not first):
            params += embedding  # the output layer (or, tied with PP > 1, the last stage's copy of the embedding)
        in_flight = pp if first else 1  # 1F1B: stage k keeps PP - k micro-batches' activations
        shard = params / tp
        return {
            "weights": shard * 2,
            "grads": shard * 4,
            "optimizer": shard * 12 / dp,
            "activations": in_flight * layers * act_per_layer,
            "logits": logits if last else 0.0,
        }

    return [stage(True, pp == 1)] + ([stage(False, True)] if pp > 1 else [])
