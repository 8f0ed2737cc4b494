"""Shared fixtures (tiny random checkpoints saved once per test session) and the `gpu`
marker's skip on machines without CUDA. Shared helpers live in helpers.py."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

# Without a GPU, Triton kernels run in its interpreter. This must be set before anything
# imports triton (transformers does, through torch._dynamo), or triton's own helpers are
# compiled-only. torch itself does not import triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from tiny_models import make_tiny_model
from tiny_tokenizer import save_tiny_tokenizer


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` need CUDA: without it they are skipped, with the reason shown."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="marked gpu: needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """`tiny_model_dir(kind)` -> folder with config, safetensors and a tokenizer."""
    made: dict[str, str] = {}

    def make(kind: str) -> str:
        if kind not in made:
            path = make_tiny_model(kind, tmp_path_factory.mktemp(kind))
            save_tiny_tokenizer(path)
            made[kind] = path
        return made[kind]

    return make
