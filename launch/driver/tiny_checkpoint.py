"""A tiny chat model in the real HF format, built locally: what the demo and the tests train.

Real users point `model.path` at a local HF checkpoint: a config, safetensors weights, a BPE tokenizer
with a chat template, a generation config. Kiln's own road must be that road, so the demo and the
end-to-end tests use a checkpoint with every one of those parts, only tiny and built here (no hub):

* tokenizer: byte-level BPE trained on the shipped tasks and solutions (so kernel code tokenises into
  a few thousand ids, as with a real code model), with chat specials `<|im_start|>`, `<|im_end|>`,
  `<|endoftext|>`, `<think>`, `</think>`;
* chat template: Qwen-style turns (`<|im_start|>role\\n...<|im_end|>\\n`) with thinking support:
  `enable_thinking=False` closes an empty think block in the generation prompt, and an assistant
  message's `reasoning` is rendered inside `<think>...</think>`;
* config and weights: a Qwen3-architecture model of the requested sizes, seeded random init, saved
  as safetensors;
* generation_config.json: the end-of-text id only. The end of a chat turn (`<|im_end|>`) is known from
  the template alone, as with many real checkpoints, so an engine that stops only at the config's
  eos ids runs past the end of its turn.

The build is deterministic for its inputs and cached by their hash: `tiny_chat_checkpoint(root, ...)`
returns `root/tiny-chat-<hash>/`, building it once (into a temporary directory renamed into place).
A config names it `model.path: kiln:tiny-chat` (`make demo` does); `resolve_model_path` turns that into
the directory under `<logging.root>/models/`, built on the first run and reused by later ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from configs import KilnConfig

BUILDER_VERSION = 1
BUILTIN_PATH = "kiln:tiny-chat"  # the model.path value that names this checkpoint
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
END_OF_TEXT, END_OF_TURN = "<|endoftext|>", "<|im_end|>"
TASKS_ROOT = Path(__file__).resolve().parents[2] / "tasks"

# Written for Kiln; the turn markup follows the Qwen chat format so real Qwen checkpoints and this one
# render alike. `reasoning` on an assistant message is its thinking text.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' and message.reasoning is defined and message.reasoning %}"
    "{{- '<think>\\n' + message.reasoning + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


@dataclass(frozen=True)
class TinyChatSpec:
    """What a tiny chat checkpoint is built from; every field enters the cache key."""

    vocab_size: int = 4096  # BPE merges stop here (specials and the 256 byte symbols included)
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    max_seq_len: int = 8192
    seed: int = 0


def resolve_model_path(cfg: KilnConfig) -> KilnConfig:
    """`cfg` with `model.path: kiln:tiny-chat` replaced by the checkpoint's directory (built on first
    use under <logging.root>/models/, seeded by model.seed); any other config unchanged."""
    if cfg.model.path != BUILTIN_PATH:
        return cfg
    path = tiny_chat_checkpoint(Path(cfg.logging.root).resolve() / "models", TinyChatSpec(seed=cfg.model.seed))
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(path)))


def corpus_files(root: Path = TASKS_ROOT) -> list[Path]:
    """The tokenizer's training text: every task reference and shipped solution, in a fixed order."""
    return sorted(p for p in root.rglob("*.py") if "solutions" in p.parts or p.parent.name.startswith("level"))


def cache_key(spec: TinyChatSpec, files: list[Path]) -> str:
    h = hashlib.sha256(json.dumps({"builder": BUILDER_VERSION, **asdict(spec)}, sort_keys=True).encode())
    for path in files:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def tiny_chat_checkpoint(root: str | Path, spec: TinyChatSpec = TinyChatSpec()) -> Path:
    """`root/tiny-chat-<key>/`, built on first use; safe when several processes ask at once."""
    files = corpus_files()
    final = Path(root) / f"tiny-chat-{cache_key(spec, files)}"
    if (final / "config.json").exists():
        return final
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        build(tmp, spec, files)
        os.replace(tmp, final)
    except OSError:  # another process renamed its build into place first: use that one
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / "config.json").exists():
            raise
    return final


def build(out: Path, spec: TinyChatSpec, files: list[Path]) -> None:
    """Write the tokenizer, config, weights and generation config into `out`."""
    tokenizer = train_tokenizer(files, spec.vocab_size)
    tokenizer.save_pretrained(str(out))
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    eos = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_seq_len,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    from transformers.utils import logging as hf_logging

    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf_logging.disable_progress_bar()  # a build is one line in a log, not a progress bar
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(
        eos_token_id=[eos], pad_token_id=eos, do_sample=True, temperature=1.0, top_p=1.0, top_k=0
    ).save_pretrained(str(out))
    for path in out.iterdir():  # readable by whoever serves it, like any shared checkpoint
        path.chmod(0o644)


def train_tokenizer(files: list[Path], vocab_size: int):
    """A byte-level BPE tokenizer trained on `files`, wrapped as a transformers fast tokenizer with
    the chat template; deterministic for the same files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((p.read_text() for p in files), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=END_OF_TEXT, pad_token=END_OF_TEXT, additional_special_tokens=SPECIALS[1:]
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
