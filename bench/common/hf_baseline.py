"""The baseline: transformers' `generate` on the whole workload as one static batch."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from common.machine import Contention
from common.workloads import Workload


@dataclass
class HFResult:
    seconds: float
    generated_tokens: int  # rows x max_new_tokens, what the static batch actually produced
    useful_tokens: int  # what the prompts asked for
    token_ids: list[list[int]]  # each row cut to its own max_tokens
    other_cores: float = 0.0

    @property
    def tok_per_s(self) -> float:
        return self.useful_tokens / self.seconds


def hf_load(path: str, dtype: str) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.eval()
    return model


def hf_generate(model: PreTrainedModel, prompts: list[list[int]], max_new_tokens: int) -> torch.Tensor:
    """All prompts in one static batch, left-padded with 0, no early stop."""
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            # Every row runs to the longest request, as a static batch must; ignore_eos for Cadence matches this.
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[:, width:]


def run_hf(model: PreTrainedModel, work: Workload) -> HFResult:
    max_new = max(work.max_tokens)
    with Contention() as c:
        start = time.perf_counter()
        new = hf_generate(model, work.prompts, max_new)
        seconds = time.perf_counter() - start
    rows = [new[i, :m].tolist() for i, m in enumerate(work.max_tokens)]
    return HFResult(seconds, new.numel(), work.useful_tokens, rows, c.other_cores)
