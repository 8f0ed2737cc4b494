"""Counting prompts in the served model's tokens: a local tokenizer, or the server's own.

`vllm bench serve` needs the tokenizer on the client's disk; here `--tokenizer` is optional
and the server's /tokenize and /detokenize (Cadence and vLLM both serve them) stand in.
"""

from __future__ import annotations

from typing import Protocol

from cadence.client import Client, NotFoundError


class TokenCounter(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class LocalTokenizer:
    """A tokenizer folder (or hub-style name already cached) loaded with transformers."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids))


class ServerTokenizer:
    """The served model's tokenizer, over the server's /tokenize and /detokenize (through
    `cadence.client`, so its retries and errors apply)."""

    def __init__(self, base_url: str, model: str, api_key: str | None, timeout: float = 60.0) -> None:
        self.client = Client(base_url, api_key=api_key, timeout=timeout)
        self.model = model

    def encode(self, text: str) -> list[int]:
        try:
            return self.client.tokenize(text, model=self.model, add_special_tokens=False).tokens
        except NotFoundError:
            raise RuntimeError("the server has no /tokenize endpoint: give --tokenizer PATH") from None

    def decode(self, ids: list[int]) -> str:
        return self.client.detokenize(ids, model=self.model).prompt
