"""GPTQ (tools/gptq.py, gptq_model.py) and ``cadence quantize``.

GPTQ's claim is a smaller layer *output* error than round-to-nearest for the same int4
grid, on inputs like its calibration data. The synthetic check uses correlated inputs
with a few large features, the structure real activations have; measured there, GPTQ's
relative output error is 0.47-0.48x RTN's on the calibration rows and 0.51-0.52x on fresh
rows (bounds: 0.7x and 0.8x). End to end, a tiny model's GPTQ
checkpoint must load through the ordinary GPTQ loader into exactly the codes and scales
GPTQ chose.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from cadence import LLM
from cadence.engine.loader import iterate_weights, load_model
from cadence.engine.models.llama import LlamaForCausalLM
from cadence.engine.quantization.linear import Int4Method
from cadence.engine.quantization.linear_layer import LinearLayer
from cadence.kernels.formats.quant_formats import Int4Weight, dequantize_int4, quantize_int4
from cadence.tools import gptq_model
from cadence.tools.gptq import HessianAccumulator, gptq_quantize
from tests.support.helpers import gen
from tests.support.quant_eval import TINY_PROMPTS, greedy_tokens


def correlated_inputs(rows: int, mix: torch.Tensor, seed: int) -> torch.Tensor:
    """Rows mixed by ``mix`` (shared structure) plus noise, with eight large features."""
    g = gen(seed)
    k = mix.shape[0]
    x = torch.randn(rows, k, generator=g) @ mix + 0.1 * torch.randn(rows, k, generator=g)
    x[:, :8] *= 20
    return x


def output_error(x: torch.Tensor, w: torch.Tensor, q: Int4Weight) -> float:
    y = x @ w.t()
    return float((y - x @ dequantize_int4(q, torch.float32).t()).norm() / y.norm())


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, 128])
def test_gptq_halves_the_output_error_of_rounding(symmetric: bool, group: int) -> None:
    k, n = 256, 96
    w = torch.randn(n, k, generator=gen(1)) * 0.02
    mix = torch.randn(k, k, generator=gen(2)) / k**0.5
    calibration = correlated_inputs(2048, mix, seed=3)
    acc = HessianAccumulator(k)
    acc.add(calibration)
    q = gptq_quantize(w, acc.hessian, group, symmetric)
    assert q.qweight.shape == (k // 8, n) and q.scales.shape == (k // group, n)
    assert (q.zeros is None) == symmetric
    rtn = quantize_int4(w, group, symmetric, scale_dtype=torch.float16)
    assert output_error(calibration, w, q) < 0.7 * output_error(calibration, w, rtn)
    # Fresh rows from the same distribution: the gain is not an artefact of the fit.
    fresh = correlated_inputs(1024, mix, seed=4)
    assert output_error(fresh, w, q) < 0.8 * output_error(fresh, w, rtn)


def test_hessian_is_the_same_however_rows_are_batched() -> None:
    x = torch.randn(300, 16, generator=gen(3))
    whole, parts = HessianAccumulator(16), HessianAccumulator(16)
    whole.add(x)
    for chunk in (x[:7], x[7:200], x[200:]):
        parts.add(chunk)
    expected = 2.0 / 300 * (x.double().t() @ x.double())
    assert torch.allclose(whole.hessian, expected) and torch.allclose(parts.hessian, expected)


def test_inputs_never_seen_do_not_break_the_factorisation() -> None:
    x = torch.randn(512, 64, generator=gen(4))
    x[:, 5] = 0.0  # a dead feature: H has a zero row and column
    acc = HessianAccumulator(64)
    acc.add(x)
    q = gptq_quantize(torch.randn(32, 64, generator=gen(5)), acc.hessian, 32)
    assert torch.isfinite(dequantize_int4(q, torch.float32)).all()


def test_checkpoint_loads_into_the_codes_gptq_chose(
    tiny_model_dir: Callable[[str], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tiny_model_dir("llama")
    model, config = load_model(source, torch.float32)
    assert isinstance(model, LlamaForCausalLM)
    samples = torch.randint(3, config.vocab_size, (4, 32), generator=gen(6))
    chosen = gptq_model.gptq_model(model, samples, 32, symmetric=False, chunk=3)
    assert len(chosen) == 4 * config.num_hidden_layers
    sizes = gptq_model.shard_sizes(config)
    dense = dict(iterate_weights(source))
    out = str(tmp_path / "gptq")
    gptq_model.write_gptq_checkpoint(source, out, dense, chosen, sizes, 32, False, {"source": "test"})
    # Keep the int4 layers in our layout so their buffers can be compared code for code.
    monkeypatch.setattr(Int4Method, "convert_for_cpu", lambda self, layer: None)
    loaded, _ = load_model(out, torch.float32)
    for name, weight in chosen.items():
        layer = loaded.get_submodule(name)
        assert isinstance(layer, LinearLayer) and isinstance(layer.method, Int4Method)
        assert layer.scales is not None and layer.zeros is not None and weight.zeros is not None, name
        assert torch.equal(layer.qweight, weight.qweight) and torch.equal(layer.scales, weight.scales), name
        assert torch.equal(layer.zeros, weight.zeros), name
    # gptq_model left the model holding the dequantized weights: the loaded checkpoint is
    # the same function.
    for name in chosen:
        layer = model.get_submodule(name)
        assert isinstance(layer, LinearLayer)
        assert torch.equal(layer.weight, dequantize_int4(chosen[name], torch.float32))


def test_cadence_quantize_writes_a_servable_checkpoint(tiny_model_dir: Callable[[str], str], tmp_path: Path) -> None:
    from cadence.server.cli import main

    out = str(tmp_path / "gptq-cli")
    main(
        [
            "quantize",
            tiny_model_dir("tied"),
            out,
            "--samples",
            "3",
            "--sample-length",
            "24",
            "--group-size",
            "64",
            "--log-level",
            "warning",
        ]
    )
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        qconfig = json.load(f)["quantization_config"]
    assert qconfig["quant_method"] == "gptq" and qconfig["group_size"] == 64 and qconfig["sym"] is True
    assert qconfig["calibration"]["source"] == "self-generated" and qconfig["calibration"]["samples"] == 3
    llm = LLM(out, dtype="float32", block_size=4, max_model_len=128, num_gpu_blocks=64)
    assert isinstance(llm.engine.model.get_submodule("model.layers.0.mlp.down_proj").method, Int4Method)
    tokens = greedy_tokens(llm, TINY_PROMPTS[:2], max_tokens=4)
    assert all(len(t) == 4 for t in tokens)


@pytest.mark.parametrize("symmetric", [True, False])
def test_all_zero_and_all_positive_groups_stay_exact_and_portable(symmetric: bool) -> None:
    w = torch.randn(16, 64, generator=gen(8)) * 0.02
    w[3, :32] = 0.0  # a pruned group: scale 0 must not become 0 / 0
    w[5, 32:] = w[5, 32:].abs()  # nothing below zero in the group
    acc = HessianAccumulator(64)
    acc.add(torch.randn(256, 64, generator=gen(9)))
    q = gptq_quantize(w, acc.hessian, 32, symmetric)
    dense = dequantize_int4(q, torch.float32)
    assert torch.isfinite(dense).all() and bool((dense[3, :32] == 0).all())
    if not symmetric:
        # GPTQ v1 stores zero - 1 in four bits: a zero of 0 would be written as 15.
        assert q.zeros is not None and int(q.zeros.min()) >= 1


def test_cadence_quantize_refuses_what_it_cannot_calibrate(
    tiny_model_dir: Callable[[str], str], tmp_path: Path
) -> None:
    source = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="at least one calibration sample of at least 2 tokens"):
        gptq_model.quantize_checkpoint(source, str(tmp_path / "a"), num_samples=0)
    with pytest.raises(ValueError, match="at least one calibration sample"):
        gptq_model.quantize_checkpoint(source, str(tmp_path / "b"), sample_length=1)
    # An already-quantized checkpoint (here, one this test writes) is refused by name.
    out = str(tmp_path / "gptq")
    gptq_model.quantize_checkpoint(source, out, group_size=32, num_samples=2, sample_length=16)
    with pytest.raises(ValueError, match="already quantized"):
        gptq_model.quantize_checkpoint(out, str(tmp_path / "c"), num_samples=2, sample_length=16)
