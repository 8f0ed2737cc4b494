"""Counting prompts in the served model's tokens: a local tokenizer, or the server's own.

`vllm bench serve` needs the tokenizer on the client's disk; here `--tokenizer` is optional
and the server's /tokenize and /detokenize (Cadence and vLLM both serve them) stand in.
"""

from __future__ import annotations

from typing import Protocol

import httpx


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
    """The served model's tokenizer, over the server's /tokenize and /detokenize."""

    def __init__(self, base_url: str, model: str, headers: dict[str, str], timeout: float = 60.0) -> None:
        self.client = httpx.Client(base_url=base_url, headers=headers, timeout=timeout)
        self.model = model

    def encode(self, text: str) -> list[int]:
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        response = self.client.post("/tokenize", json=body)
        if response.status_code == 404:
            raise RuntimeError("the server has no /tokenize endpoint: give --tokenizer PATH")
        response.raise_for_status()
        return [int(t) for t in response.json()["tokens"]]

    def decode(self, ids: list[int]) -> str:
        response = self.client.post("/detokenize", json={"model": self.model, "tokens": ids})
        response.raise_for_status()
        return str(response.json()["prompt"])

    def close(self) -> None:
        self.client.close()
