"""A minimal tokenizer interface: HF tokenizers for real models, a byte tokenizer for tiny random ones."""
from __future__ import annotations

from typing import Protocol, Sequence


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes shifted by 3 (0 = pad, 1 = bos, 2 = eos). Deterministic and dependency-free."""

    offset = 3
    vocab_size = 256 + offset
    eos_token_id = 2

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        # ids beyond the byte range (a random model's larger vocabulary) have no text: skip them
        data = bytes(i - self.offset for i in ids if self.offset <= i < self.vocab_size)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """Adapter over a transformers tokenizer (no special tokens added: prompts are raw text windows)."""

    def __init__(self, tok):
        self._tok = tok
        self.vocab_size = len(tok)
        self.eos_token_id = tok.eos_token_id
        # the special tokens the tokenizer itself puts in front of a text (Gemma: its BOS; SmolLM2: none)
        bare, full = tok.encode("x", add_special_tokens=False), tok.encode("x")
        self.prefix_ids = list(full[: full.index(bare[0])]) if bare and bare[0] in full else []

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)
