"""Tokenizers for rollout prompts: a built-in byte-level one for tiny models and the embedded default,
and an HF tokenizer (with its chat template when it has one) from a local directory for real models.
No hub downloads anywhere: the machines have no internet.
"""

from __future__ import annotations

from configs import ModelConfig


class ByteTokenizer:
    """Token i < 256 is byte i; then BOS, EOS, PAD. 259 ids, matching `model.vocab_size`'s default."""

    vocab_size = 259
    bos_token_id, eos_token_id, pad_token_id = 256, 257, 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    def prompt_ids(self, text: str) -> list[int]:
        return [self.bos_token_id, *self.encode(text)]


class HFTokenizer:
    """A local HF tokenizer; prompts go through its chat template when it has one."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.eos_token_id = self.tok.eos_token_id
        self.vocab_size = len(self.tok)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def prompt_ids(self, text: str) -> list[int]:
        if self.tok.chat_template:
            return list(self.tok.apply_chat_template([{"role": "user", "content": text}],
                                                     add_generation_prompt=True, tokenize=True))
        return self.tok.encode(text)


def load_tokenizer(cfg: ModelConfig) -> ByteTokenizer | HFTokenizer:
    if cfg.path:
        return HFTokenizer(cfg.path)
    if cfg.tokenizer == "bytes":
        if cfg.vocab_size < ByteTokenizer.vocab_size:
            raise ValueError(f"the byte tokenizer needs model.vocab_size >= 259, got {cfg.vocab_size}")
        return ByteTokenizer()
    return HFTokenizer(cfg.tokenizer)
