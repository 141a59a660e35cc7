"""The tiny real-format chat checkpoint: it loads with transformers' Auto classes like any user's
checkpoint, its template renders a repair dialogue with thinking, and its build is deterministic."""

from __future__ import annotations

import json
from pathlib import Path

from launch.driver.tiny_checkpoint import END_OF_TURN, TinyChatSpec, cache_key, corpus_files

SOLUTION = "tasks/solutions/cpu/level1/01_relu.py"


def test_loads_with_auto_classes_and_tokenises_kernel_code_compactly(tiny_chat_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(tiny_chat_model, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model, local_files_only=True)
    assert model.config.model_type == "qwen3" and model.config.vocab_size == len(tok)
    code = Path(SOLUTION).read_text()
    ids = tok.encode(code)
    assert tok.decode(ids) == code and len(ids) < len(code.encode()) / 2  # BPE, not bytes
    # generation_config names end-of-text only; the end of a turn is known from the template alone.
    eos = GenerationConfig.from_pretrained(tiny_chat_model).eos_token_id
    assert eos == [tok.convert_tokens_to_ids("<|endoftext|>")]
    assert tok.convert_tokens_to_ids(END_OF_TURN) not in eos
    assert all((p.stat().st_mode & 0o044) == 0o044 for p in tiny_chat_model.iterdir())


def test_template_renders_a_repair_dialogue_with_thinking(tiny_chat_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_model, local_files_only=True)
    dialogue = [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "task"},
        {"role": "assistant", "content": "attempt 1", "reasoning": "let me think"},
        {"role": "user", "content": "feedback 1"},
    ]
    text = tok.apply_chat_template(dialogue, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert text == (
        "<|im_start|>system\nrules<|im_end|>\n<|im_start|>user\ntask<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nlet me think\n</think>\n\nattempt 1<|im_end|>\n"
        "<|im_start|>user\nfeedback 1<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    ids = tok.apply_chat_template(
        dialogue, add_generation_prompt=True, tokenize=True, return_dict=False, enable_thinking=False
    )
    assert all(isinstance(i, int) for i in ids) and tok.decode(ids) == text


def test_build_is_cached_by_its_inputs(tiny_chat_model):
    spec = TinyChatSpec(hidden_size=64, num_layers=2, intermediate_size=128, max_seq_len=8192)  # as conftest builds it
    assert tiny_chat_model.name == f"tiny-chat-{cache_key(spec, corpus_files())}"
    assert cache_key(TinyChatSpec(seed=1), corpus_files()) != cache_key(TinyChatSpec(), corpus_files())
    assert json.loads((tiny_chat_model / "config.json").read_text())["hidden_size"] == 64
