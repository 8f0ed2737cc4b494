"""The default model's answers are decided by the model, the options and the CPU's
instruction set: never by timings, nor by what else ran when it first started.

Each start is a process of its own, with an empty HOME as a new user's first start is
(it converts the GGUF and plans its CPU kernels from nothing), or, capped to AVX2, with
the quiet start's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cadence.kernels.cpu.half_linear import BF16DOT, available
from cadence.tools.avx2_only import AVX2_ONLY_ENV
from tests.support.helpers import needs_smollm2

pytestmark = [needs_smollm2, pytest.mark.slow]

SCRIPT = str(Path(__file__).parents[1] / "support" / "default_model_answers.py")
QUESTION = "What is the capital of France?"


def _first_start(home: Path, **env: str) -> dict[str, Any]:
    """``default_model_answers.py`` in a fresh process whose HOME is ``home`` (an empty one
    makes it a first start)."""
    home.mkdir(exist_ok=True)
    run = subprocess.run(
        [sys.executable, SCRIPT],
        env={**os.environ, "HOME": str(home), **env},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result: dict[str, Any] = json.loads(run.stdout)
    return result


def _busy_cores(count: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


@pytest.fixture(scope="module")
def homes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder for the module's HOMEs: the capped start reuses the quiet start's
    conversion (a second conversion would test nothing new)."""
    return tmp_path_factory.mktemp("homes")


def test_two_first_starts_one_on_busy_cores_give_the_same_answers(homes: Path) -> None:
    """The plain capital-of-France question answers Paris, and a first start while both
    cores are taken by other work plans the same kernels and gives the same tokens."""
    quiet = _first_start(homes / "quiet")
    hogs = _busy_cores(os.cpu_count() or 2)
    try:
        busy = _first_start(homes / "busy")
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert "Paris" in quiet["answers"][QUESTION]["text"]
    assert busy["kernels"] == quiet["kernels"]
    assert busy["answers"] == quiet["answers"]
    # The rule here: bf16dot for the Q4_1 blocks and the int8 head where the CPU has
    # AVX512-BF16, else fp16.
    assert quiet["kernels"] == {"bf16dot" if available(BF16DOT) else "fp16": 121}


def test_a_cpu_with_avx2_only_answers_as_the_dense_model_does(homes: Path) -> None:
    """Without AVX-512 the default runs fp16 weights in fp32 arithmetic (the dense model's
    answers), not llama.cpp's 8-bit activations, and so answers the plain question with Paris."""
    capped = _first_start(homes / "quiet", **AVX2_ONLY_ENV)
    assert capped["kernels"] == {"fp16": 121}
    assert "Paris" in capped["answers"][QUESTION]["text"]
