"""Prompts to send: random, ShareGPT, prefix-repetition and custom JSONL, as `vllm bench serve` names them.

Every prompt is text (so one dataset serves completions and chat alike) and its length is
counted in the served model's tokens. Random text is made of pronounceable nonsense words
cut to the exact token count, so no two prompts share a prefix unless asked to.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cadence.loadgen.tokenizer import TokenCounter

_ONSETS = ("b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z", "st", "tr", "ch")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou")


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens, counted without special tokens
    output_len: int  # max_tokens to ask for


@dataclass(frozen=True)
class DatasetOptions:
    name: str  # random | sharegpt | prefix-repetition | custom
    num_prompts: int
    seed: int = 0
    path: str | None = None
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    sharegpt_output_len: int | None = None
    prefix_repetition_prefix_len: int = 256
    prefix_repetition_suffix_len: int = 256
    prefix_repetition_num_prefixes: int = 10
    prefix_repetition_output_len: int = 128
    custom_output_len: int = 256
    max_model_len: int | None = None  # drop dataset entries that would not fit


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(rng.randint(1, 3)))


def random_text(tokenizer: TokenCounter, rng: random.Random, length: int) -> tuple[str, int]:
    """Nonsense text of `length` tokens (give or take a merge where it was cut), and its true count."""
    if length <= 0:
        return "", 0
    words: list[str] = []
    ids: list[int] = []
    while len(ids) < length:
        words.extend(_word(rng) for _ in range(max(4, length - len(ids))))
        ids = tokenizer.encode(" ".join(words))
    text = tokenizer.decode(ids[:length])
    return text, len(tokenizer.encode(text))


def _lengths(rng: random.Random, mean: int, ratio: float, count: int) -> list[int]:
    """Uniform in [mean * (1 - ratio), mean * (1 + ratio)], at least 1."""
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(count)]


def random_dataset(tokenizer: TokenCounter, options: DatasetOptions) -> list[SampleRequest]:
    if not 0.0 <= options.random_range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    rng = random.Random(options.seed)
    prefix, prefix_len = random_text(tokenizer, rng, options.random_prefix_len)
    inputs = _lengths(rng, options.random_input_len, options.random_range_ratio, options.num_prompts)
    outputs = _lengths(rng, options.random_output_len, options.random_range_ratio, options.num_prompts)
    samples = []
    for input_len, output_len in zip(inputs, outputs):
        text, count = random_text(tokenizer, rng, input_len)
        # A space between: glued on, the prefix's last word would merge with each prompt's
        # first, and the prompts would share one token less than the asked prefix.
        prompt = f"{prefix} {text}" if prefix else text
        total = len(tokenizer.encode(prompt)) if prefix else count
        samples.append(SampleRequest(prompt, total, output_len))
    return samples


def prefix_repetition_dataset(tokenizer: TokenCounter, options: DatasetOptions) -> list[SampleRequest]:
    """`num_prefixes` shared prefixes, each followed by fresh suffixes: a prefix-cache workload."""
    if options.prefix_repetition_num_prefixes < 1:
        raise ValueError("--prefix-repetition-num-prefixes must be at least 1")
    rng = random.Random(options.seed)
    prefixes = [
        random_text(tokenizer, rng, options.prefix_repetition_prefix_len)[0]
        for _ in range(options.prefix_repetition_num_prefixes)
    ]
    samples = []
    for i in range(options.num_prompts):
        suffix, _ = random_text(tokenizer, rng, options.prefix_repetition_suffix_len)
        prompt = prefixes[i % len(prefixes)] + " " + suffix
        samples.append(SampleRequest(prompt, len(tokenizer.encode(prompt)), options.prefix_repetition_output_len))
    rng.shuffle(samples)
    return samples


def _read_records(path: str) -> list[Any]:
    """A JSON list, or JSON Lines."""
    text = Path(path).read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        data = json.loads(stripped)
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list")
        return data
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _first_exchange(entry: dict[str, Any]) -> tuple[str, str] | None:
    """The first user turn and the reply after it, in ShareGPT's or OpenAI's message format."""
    turns = entry.get("conversations") or entry.get("messages") or []
    for turn, reply in zip(turns, turns[1:]):
        speaker = turn.get("from") or turn.get("role")
        if speaker in ("human", "user"):
            return str(turn.get("value") or turn.get("content") or ""), str(
                reply.get("value") or reply.get("content") or ""
            )
    return None


def _fits(options: DatasetOptions, prompt_len: int, output_len: int) -> bool:
    return options.max_model_len is None or prompt_len + output_len <= options.max_model_len


def sharegpt_dataset(tokenizer: TokenCounter, options: DatasetOptions) -> list[SampleRequest]:
    """The first exchange of randomly chosen conversations; the reply's length sets max_tokens."""
    if options.path is None:
        raise ValueError("--dataset-name sharegpt needs --dataset-path")
    entries = _read_records(options.path)
    random.Random(options.seed).shuffle(entries)
    samples = []
    for entry in entries:
        exchange = _first_exchange(entry)
        if exchange is None:
            continue
        prompt, reply = exchange
        prompt_len = len(tokenizer.encode(prompt))
        output_len = options.sharegpt_output_len or len(tokenizer.encode(reply))
        # As vLLM filters: too short to time, or too long to serve. A fixed output length is
        # the user's to choose, so (as in vLLM) it is not held to the minimum.
        short_reply = options.sharegpt_output_len is None and output_len < 4
        if prompt_len < 4 or short_reply or not _fits(options, prompt_len, output_len):
            continue
        samples.append(SampleRequest(prompt, prompt_len, output_len))
        if len(samples) == options.num_prompts:
            break
    return _enough(samples, options)


def custom_dataset(tokenizer: TokenCounter, options: DatasetOptions) -> list[SampleRequest]:
    """JSON Lines of {"prompt": ..., optional "output_tokens": N}; the file's order, repeated if short."""
    if options.path is None:
        raise ValueError("--dataset-name custom needs --dataset-path")
    entries = _read_records(options.path)
    if not entries:
        raise ValueError(f"{options.path} holds no prompts")
    samples = []
    for entry in _cycle(entries, options.num_prompts):
        if "prompt" not in entry:
            raise ValueError(f'{options.path}: every line needs a "prompt"')
        prompt = str(entry["prompt"])
        output_len = int(entry.get("output_tokens") or options.custom_output_len)
        samples.append(SampleRequest(prompt, len(tokenizer.encode(prompt)), output_len))
    return samples


def _cycle(entries: list[Any], count: int) -> Iterator[Any]:
    for i in range(count):
        yield entries[i % len(entries)]


def _enough(samples: list[SampleRequest], options: DatasetOptions) -> list[SampleRequest]:
    if len(samples) < options.num_prompts:
        raise ValueError(
            f"{options.path} gave {len(samples)} usable prompts, fewer than --num-prompts {options.num_prompts}"
        )
    return samples


BUILDERS = {
    "random": random_dataset,
    "sharegpt": sharegpt_dataset,
    "prefix-repetition": prefix_repetition_dataset,
    "custom": custom_dataset,
}


def build_dataset(tokenizer: TokenCounter, options: DatasetOptions) -> list[SampleRequest]:
    if options.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    return BUILDERS[options.name](tokenizer, options)
