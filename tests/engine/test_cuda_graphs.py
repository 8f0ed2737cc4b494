"""Decode steps through DecodeGraphs' static, padded inputs give the eager engine's tokens.

On CPU nothing can be captured, so `DecodeGraphs(use_graphs=False)` runs the forward on
the very buffers a replay would read: padded batch sizes, the KV slot -1 of padding rows,
one upload per step and a fixed split count. The Triton attention kernel runs in the
interpreter. On a GPU the same checks run with real graph capture and replay.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from cadence import LLM, SamplingParams
from cadence.engine.attention.backend import AttentionSpec
from cadence.engine.attention.triton_backend import TritonAttentionBackend, split_ladder
from cadence.engine.cuda_graphs import CAPTURE_BATCH_SIZES, DecodeGraphs
from cadence.engine.input_batch import StepInputs
from tests.support.helpers import hf_greedy

# Three sequences pad to a batch of 4; the lengths differ so the rows' contexts differ.
PROMPTS = [[5, 9, 13], [20 + i for i in range(9)], [7, 7, 7, 7, 8]]
MAX_TOKENS = 5


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def count_runs(graphs: DecodeGraphs) -> list[int]:
    """Wraps `graphs.run` to record each decode step's batch size."""
    sizes: list[int] = []
    run = graphs.run

    def counted(step: StepInputs, block_table: np.ndarray) -> torch.Tensor:
        sizes.append(step.num_seqs)
        return run(step, block_table)

    graphs.run = counted  # type: ignore[method-assign]
    return sizes


def test_padded_static_inputs_give_the_eager_tokens(tiny_model_dir: Callable[[str], str]) -> None:
    path = tiny_model_dir("llama")
    expected = hf_greedy(path, PROMPTS, MAX_TOKENS)
    llm = LLM(
        path,
        dtype="float32",
        block_size=4,
        max_model_len=64,
        num_gpu_blocks=64,
        attention_backend="triton",
        enforce_eager=True,
    )
    runner = llm.engine.runner
    assert runner.decode_graphs is None
    runner.decode_graphs = DecodeGraphs(
        runner.model,
        runner.backend,
        runner.kv_caches,
        max_batch=4,
        max_model_len=64,
        block_size=4,
        device=runner.device,
        use_graphs=False,
    )
    sizes = count_runs(runner.decode_graphs)
    # Block 0, the first one handed out, holds the first prompt's position 0: a padding
    # row writing to slot 0 instead of skipping its slot -1 would change that prompt's tokens.
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy())] == expected
    # Every step after the prefill was a 3-sequence decode through the padded path.
    assert sizes == [3] * (MAX_TOKENS - 1)


def test_batch_sizes_and_split_ladder() -> None:
    assert list(CAPTURE_BATCH_SIZES) == sorted(set(CAPTURE_BATCH_SIZES))
    # One sequence of 8 KV heads leaves 124 of 132 SMs idle: up to cdiv(132, 8) = 17 splits.
    assert split_ladder(1, 8, 32768, 132) == [1, 2, 4, 8, 16]
    assert split_ladder(32, 8, 32768, 132) == [1]  # 256 programs already fill the GPU
    assert split_ladder(1, 8, 300, 132) == [1]  # too short to split at all


def test_the_backend_picks_the_largest_captured_split_not_above_its_choice() -> None:
    backend = TritonAttentionBackend(AttentionSpec(8, 8, 16, 0.25), block_size=16)
    cpu = torch.device("cpu")  # a nominal 8 SMs: one sequence of 8 KV heads fills them
    assert backend.graph_variants(1, 32768, cpu) == [1]
    ladder = [1, 2, 4, 8, 16]
    assert backend.pick_graph_variant(1, 32768, ladder, cpu) == 1
    narrow = TritonAttentionBackend(AttentionSpec(1, 1, 16, 0.25), block_size=16)
    assert narrow.graph_variants(1, 32768, cpu) == [1, 2, 4, 8]  # cdiv(8, 1) = 8 splits
    assert narrow.pick_graph_variant(1, 700, ladder, cpu) == 2  # 700 // 256 = 2 splits
    assert narrow.pick_graph_variant(1, 200, ladder, cpu) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_replayed_graphs_match_eager_on_gpu(
    tiny_model_dir: Callable[[str], str], tmp_path: Path, kv_cache_dtype: str
) -> None:
    # The tiny llama with room for a context long enough to split (its RoPE table grows).
    path = str(tmp_path / "llama")
    shutil.copytree(tiny_model_dir("llama"), path)
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    (tmp_path / "llama" / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    options = dict(
        dtype="float32", block_size=16, max_model_len=2048, num_gpu_blocks=512, kv_cache_dtype=kv_cache_dtype
    )
    # A long prompt makes the one-sequence step choose split-KV (2048 // 256 splits).
    prompts = PROMPTS + [[(11 * i) % 300 + 3 for i in range(1500)]]
    eager = LLM(path, enforce_eager=True, **options)
    assert eager.engine.runner.decode_graphs is None
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, greedy())]
    expected_long = [o.outputs[0].token_ids for o in eager.generate(prompts[-1:], greedy())]
    del eager

    llm = LLM(path, **options)
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.use_graphs
    # The one-sequence ladder reaches 4 splits; count that graph's replays.
    split_graph = graphs._captured[(1, 4)]
    replays = []

    class CountingGraph:
        def replay(self) -> None:
            replays.append(1)
            split_graph.graph.replay()

    graphs._captured[(1, 4)] = type(split_graph)(CountingGraph(), split_graph.hidden)
    sizes = count_runs(graphs)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy())] == expected
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[-1:], greedy())] == expected_long
    assert sizes and set(sizes) <= {4, 1}
    assert len(replays) == MAX_TOKENS - 1  # the long prompt's decodes (1505+ tokens: 5 -> 4 splits)


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_model_replays_match_eager_on_gpu(tmp_path: Path, quantization: str) -> None:
    """The decode GEMVs (with their split-K tickets) inside replayed graphs: a model wide
    enough for the int4 GEMV's 128-wide K tiles, in fp16."""
    path = write_wide_llama(tmp_path / "wide")
    options = dict(dtype="float16", quantization=quantization, max_model_len=256, num_gpu_blocks=64)
    eager = LLM(path, enforce_eager=True, **options)
    expected = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, greedy())]
    del eager
    llm = LLM(path, **options)
    sizes = count_runs(llm.engine.runner.decode_graphs)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy())] == expected
    assert sizes == [3] * (MAX_TOKENS - 1)


def write_wide_llama(path: Path) -> str:
    """A seeded random Llama with hidden 128 and intermediate 256, plus the tiny tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.support.tiny_tokenizer import save_tiny_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(str(path), safe_serialization=True)
    save_tiny_tokenizer(str(path))
    return str(path)
