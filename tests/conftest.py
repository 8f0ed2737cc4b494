"""Shared fixtures (tiny random checkpoints saved once per test session) and the `gpu`
marker's skip on machines without CUDA. Shared helpers live in tests/support/."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

# Without a GPU, Triton kernels run in its interpreter. This must be set before anything
# imports triton (transformers does, through torch._dynamo), or triton's own helpers are
# compiled-only. torch itself does not import triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The Python processes tests start (servers as `python -m cadence.server.cli`, snippets as
# `python -c`, scripts by path) would put their working folder or the script's folder first
# on sys.path, where a folder could hide an installed package of the same name (transformers
# imports the PyPI package `kernels`). With a safe path they import only what is installed,
# as `cadence serve` does; a script that imports tests.support says so itself
# (SyntheticServerProcess).
os.environ["PYTHONSAFEPATH"] = "1"

import pytest

from tests.support.tiny_models import make_tiny_model
from tests.support.tiny_tokenizer import save_tiny_tokenizer


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


@pytest.fixture
def rowwise_interpreter_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the Triton interpreter, make `tl.dot` multiply each row of a tile on its own.

    The interpreter's dot is numpy's matmul, and OpenBLAS's Haswell kernels sum a row in
    an order that depends on the row's position in the matrix: the same row gives other
    bits one row lower. A GPU's MMA has no such dependence, and batch-invariance tests
    assert what the kernels' tiling does on a GPU, so they run with this model of it. On
    CUDA (no interpreter) this does nothing.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        rows = [
            original(
                self,
                interpreter.TensorHandle(a.data[..., i : i + 1, :], a.dtype),
                b,
                interpreter.TensorHandle(d.data[..., i : i + 1, :], d.dtype),
                input_precision,
                max_num_imprecise_acc,
            ).data
            for i in range(a.data.shape[-2])
        ]
        return interpreter.TensorHandle(np.concatenate(rows, axis=-2), d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
