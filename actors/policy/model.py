"""Build the HF transformers causal LM that the embedded engine serves (and tests score against).

From a local checkpoint directory (`model.path`) or, when there is none, from the `model` section's
size fields with a seeded random init: tiny models for CPU tests, a ~0.3B Qwen3 for the GPU
benchmark. Never touches the hub: the machines have no internet. The learner's backends build the
same model, so learner and engines start from identical weights.
"""

from __future__ import annotations

import inspect
import logging

import torch

from configs import ModelConfig

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_config(cfg: ModelConfig):
    """The transformers config for a random-init model of `cfg.arch` with `cfg`'s sizes."""
    from transformers import AutoConfig

    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"num_kv_heads {cfg.num_kv_heads} must divide num_heads {cfg.num_heads}")
    return AutoConfig.for_model(
        cfg.arch,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=True,
    )


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", attention: str = "sdpa") -> torch.nn.Module:
    """The model in eval mode on `device`, in `cfg.dtype`, with `attention` as its transformers
    `attn_implementation` ("sdpa", or a name registered by actors/rollout/attention.py)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    dtype = DTYPES[cfg.dtype]
    if cfg.path:
        unresolved(cfg.path)
        hf_logging.disable_progress_bar()  # every engine restart and weight reload would print one
        model = AutoModelForCausalLM.from_pretrained(
            cfg.path, dtype=dtype, attn_implementation=attention, local_files_only=not cfg.allow_download
        )
    else:
        # Initialised where it will live: a 1.1B model's init takes ~16 s on one CPU core (a Ray actor's
        # thread budget) and well under a second on a GPU. The seeded values depend on the device type:
        # the learner and the engines build on the same type, and engines load the learner's weights
        # once it has published any.
        torch.manual_seed(cfg.seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_config(cfg), dtype=dtype, attn_implementation=attention)
    return model.to(device).eval()


def register_attention(name: str, attention, mask=None, *, user: str) -> str:
    """Register an attention function (and its mask builder; None: the one "sdpa" uses) with transformers
    under `name` (idempotent); returns the name to pass as `attention` to `build_model`, or "sdpa" (logged,
    naming the `user` that falls back) where this transformers has no registry."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as err:
        log.warning("transformers has no attention registry (%s): %s with HF's sdpa", err, user)
        return "sdpa"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask or sdpa_mask)
    return name


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword a model's forward takes its KV cache under: `cache` in the transformers releases
    that renamed it (5.2x; `past_key_values` is deprecated there and removed in 5.40), else
    `past_key_values`. A cache passed under a name the forward no longer knows would be dropped
    silently, and the model would decode without its context."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def unresolved(path: str) -> None:
    """Refuse a `kiln:` model.path that nobody resolved: the driver turns `kiln:tiny-chat` into the
    directory it builds (launch.driver.tiny_checkpoint.resolve_model_path) before any model is built."""
    if path.startswith("kiln:"):
        raise ValueError(
            f"model.path={path} names a checkpoint that `kiln train` builds; resolve it first "
            "(launch.driver.tiny_checkpoint.resolve_model_path)"
        )
