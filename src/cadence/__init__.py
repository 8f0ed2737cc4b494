"""Cadence: an LLM inference server on PyTorch and Triton.

The public names load lazily, so importing a light subpackage such as
`cadence.scheduler` (pure Python) does not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "LLM": "cadence.engine.llm",
    "SamplingParams": "cadence.engine.sampling_params",
    "RequestOutput": "cadence.engine.outputs",
    "CompletionOutput": "cadence.engine.outputs",
    "Logprob": "cadence.engine.outputs",
}

__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'cadence' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)
