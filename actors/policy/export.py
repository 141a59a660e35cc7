"""What makes a learner's HF export servable: the tokenizer files with the chat template, and a
generation config with the rollout's sampling settings, next to the weights and config.json that a
learner backend writes (`LearnerBackend.export_hf`).

`export_servable(path, write_weights, model, generation)` writes a whole export: the backend's
weights and config into a staging directory, then `finish_export`, then renames it into place.
`finish_export(directory, model, generation)` adds the tokenizer and generation config and makes
every file readable by whoever
serves it (mode 0644, directories 0755): `AutoTokenizer` and `AutoModelForCausalLM` then load the
directory, and `GenerationConfig` samples as training did and stops where a rollout stopped (the
union of the checkpoint's eos ids and the chat template's end of turn). The tokenizer comes from
`model.path` (or `model.tokenizer`), saved through transformers so whichever files it was loaded
from (a hub id included) become local ones. A model with Kiln's built-in byte tokenizer has no
tokenizer files to write; its generation config still names its stop id.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from actors.policy.tokenizer import HFTokenizer, load_tokenizer
from configs import ModelConfig, RolloutConfig


@dataclass(frozen=True)
class GenerationSettings:
    """The rollout's sampling settings, written into an export's generation_config.json."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 512

    @classmethod
    def from_rollout(cls, rollout: RolloutConfig) -> GenerationSettings:
        return cls(
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            max_new_tokens=rollout.max_new_tokens,
        )


def export_servable(
    path: str | Path, write_weights: Callable[[Path], None], model: ModelConfig, generation: GenerationSettings
) -> Path:
    """`write_weights(staging)` (a backend's `export_hf`, which creates the directory), then the tokenizer
    and generation config, then the rename to `path`; an earlier export at `path` is replaced."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # an export is a log line, not a progress bar in an actor's output
    path = Path(path)
    staging = path.with_name(f".{path.name}.export-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        write_weights(staging)
        finish_export(staging, model, generation)
        if path.exists():
            shutil.rmtree(path)
        os.rename(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path


def finish_export(directory: str | Path, model: ModelConfig, generation: GenerationSettings) -> None:
    """Write the tokenizer and generation config into an export that holds weights and config.json."""
    from transformers import GenerationConfig

    directory = Path(directory)
    tokenizer = load_tokenizer(model)
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.tok.save_pretrained(str(directory))
    source = Path(model.path) if model.path else None
    config = (
        GenerationConfig.from_pretrained(str(source), local_files_only=True)
        if source is not None and (source / "generation_config.json").is_file()
        else GenerationConfig()
    )
    stops = tokenizer.stop_ids
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None and isinstance(tokenizer, HFTokenizer):
        pad = tokenizer.tok.pad_token_id
    config.update(
        do_sample=True,
        temperature=generation.temperature,
        top_p=generation.top_p,
        top_k=generation.top_k,
        max_new_tokens=generation.max_new_tokens,
        eos_token_id=stops if len(stops) != 1 else stops[0],
        pad_token_id=pad if pad is not None else stops[0],
    )
    config.save_pretrained(str(directory))
    make_readable(directory)


def make_readable(directory: Path) -> None:
    """Files 0644 and directories 0755 under `directory` (staging and safetensors may write 0600)."""
    os.chmod(directory, 0o755)
    for root, dirs, files in os.walk(directory):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
