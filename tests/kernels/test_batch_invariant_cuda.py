"""``--batch-invariant`` on the Triton paths: a row's bits do not depend on the batch.

Each kernel in batch-invariant mode must give every row the same bits for M = 1, 2, 3, 7,
16 (and past one M tile), attention a sequence's rows the same bits alone or among others
and under any chunking of its prompt; the default mode's choices do depend on the batch,
which the tests show too, so that the invariant ones mean something. Without CUDA the
kernels run in Triton's interpreter on tiny shapes (fp16/fp32); the end-to-end tests run
the engine on the Triton backend there, and again on a GPU (marked ``gpu``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from cadence import LLM
from cadence.engine.attention.backend import AttentionSpec
from cadence.engine.attention.selector import create_attention_backend
from cadence.engine.quantization.linear_layer import LinearLayer
from cadence.kernels.batch_invariant.triton_gemm import batch_invariant_linear, reference
from cadence.kernels.formats.fp8_format import quantize_fp8_weight
from cadence.kernels.formats.quant_formats import quantize_int4, quantize_int8
from cadence.kernels.triton import paged_attention as pa
from cadence.kernels.triton.rms_norm import rms_norm
from cadence.kernels.triton.silu_and_mul import silu_and_mul
from cadence.kernels.triton.w4a16 import w4a16_matmul
from cadence.kernels.triton.w8a8_fp8 import fp8_matmul
from cadence.kernels.triton.w8a16 import w8a16_matmul
from cadence.server.cli import build_parser, engine_args_from
from tests.support.helpers import DEVICE, KERNEL_TOL, gen, greedy, make_llm, poisoned, rel_err

ROW_COUNTS = (1, 2, 3, 7, 16)
DTYPES = [torch.float16, torch.float32]
Matmul = Callable[[torch.Tensor, bool], torch.Tensor]

# Without a GPU these kernels run in the interpreter, modelled as a GPU multiplies (conftest).
pytestmark = pytest.mark.usefixtures("rowwise_interpreter_dot")


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed)).to(DEVICE, dtype)


def rows_by_m(matmul: Matmul, x: torch.Tensor, invariant: bool) -> dict[int, torch.Tensor]:
    """The first M rows' outputs, computed as a batch of M, for each M of ROW_COUNTS."""
    return {m: matmul(x[:m], invariant) for m in ROW_COUNTS}


def matmuls(dtype: torch.dtype, n: int = 80, k: int = 256) -> dict[str, Matmul]:
    """Every GEMM family, as (rows, batch_invariant) -> output, on one random weight."""
    w = randn(n, k, dtype=torch.float32, seed=1)
    bias = randn(n, dtype=dtype, seed=2)
    qweight, scale = quantize_int8(w.float())
    int4 = quantize_int4(w.float(), group_size=64)
    wq, w_scale = quantize_fp8_weight(w.float())
    dense = w.to(dtype)
    return {
        "dense": lambda x, inv: (
            batch_invariant_linear(x, dense, bias) if inv else torch.nn.functional.linear(x, dense, bias)
        ),
        "w8a16": lambda x, inv: w8a16_matmul(x, qweight, scale.to(dtype), batch_invariant=inv),
        "w4a16": lambda x, inv: w4a16_matmul(x, int4, batch_invariant=inv),
        "fp8": lambda x, inv: fp8_matmul(x, wq, w_scale, batch_invariant=inv),
    }


@pytest.mark.parametrize("dtype", DTYPES)
def test_invariant_gemm_matches_reference_and_writes_every_element(dtype: torch.dtype) -> None:
    w, bias = randn(70, 200, dtype=dtype, seed=3), randn(70, dtype=dtype, seed=4)
    for m in (1, 70):  # one M tile, and more than one
        x = randn(m, 200, dtype=dtype, seed=5)
        out = batch_invariant_linear(x, w, bias, out=poisoned(m, 70, dtype, DEVICE))
        assert rel_err(out, reference(x, w, bias)) < KERNEL_TOL[dtype]
    with pytest.raises(TypeError, match="differ"):
        batch_invariant_linear(x.float() if dtype != torch.float32 else x.half(), w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["dense", "w8a16", "w4a16", "fp8"])
def test_invariant_gemms_give_each_row_the_same_bits_for_every_m(dtype: torch.dtype, family: str) -> None:
    matmul = matmuls(dtype)[family]
    x = randn(70, 256, dtype=dtype, seed=6)
    full = matmul(x, True)  # 70 rows: two M tiles
    for m, out in rows_by_m(matmul, x, True).items():
        assert torch.equal(out, full[:m]), f"M={m}"
    # A row in the second M tile, alone: the same bits as among the other 69.
    assert torch.equal(matmul(x[65:66], True), full[65:66])
    assert rel_err(full, matmul(x, False)) < 2e-2  # the same product (fp8: a different quantization path)


@pytest.mark.parametrize("family", ["w8a16", "w4a16"])
def test_default_gemms_do_depend_on_m(family: str) -> None:
    """Why the mode exists: by default our quantized GEMMs choose the kernel (GEMV or
    tiled), split-K and tile size by M, and a row's last bits follow (cuBLAS does the
    same for dense layers on a GPU, by heuristics of its own)."""
    # fp32 outputs: an fp16 output's rounding would hide most differences in the fp32 sums.
    matmul = matmuls(torch.float32, n=128, k=1024)[family]
    x = randn(40, 1024, dtype=torch.float32, seed=7)  # 40 rows: a larger M tile, no split
    by_m = {**rows_by_m(matmul, x, False), 40: matmul(x, False)}
    assert any(not torch.equal(by_m[1], out[:1]) for out in by_m.values())


def test_default_attention_splits_follow_the_batch() -> None:
    # One long decode alone splits its KV range to fill the SMs; among 16 it does not.
    assert pa.choose_num_splits(1, 2, 1024, 8) > 1
    assert pa.choose_num_splits(16, 2, 1024, 8) == 1


def one_sequence_cache(
    seq_len: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A paged cache holding ``seq_len`` tokens of one sequence in scattered blocks, plus a
    second, unrelated sequence of 23 tokens; block tables for both."""
    g = gen(seed)
    blocks = -(-seq_len // block_size) + -(-23 // block_size)
    perm = torch.randperm(blocks + 2, generator=g)
    kv = torch.randn(2, blocks + 2, block_size, kv_heads, head_dim, generator=g)
    tables = torch.zeros(2, blocks, dtype=torch.int32)
    first = -(-seq_len // block_size)
    tables[0, :first] = perm[:first]
    tables[1, : blocks - first] = perm[first:blocks]
    return kv.to(DEVICE, dtype), tables.to(DEVICE)


def attend(
    q_parts: list[torch.Tensor],
    kv: torch.Tensor,
    tables: torch.Tensor,
    seqs: list[tuple[int, int, int]],
    window: int | None,
    invariant: bool,
    num_splits: int | None = None,
) -> list[torch.Tensor]:
    """One launch over the sequences ``seqs`` = [(table row, context, query length)] with
    their query rows ``q_parts``; the outputs split back per sequence."""
    q = torch.cat(q_parts)
    seq_lens = torch.tensor([c + n for _, c, n in seqs], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0] + [n for *_, n in seqs], device=DEVICE).cumsum(0).to(torch.int32)
    out = pa.paged_attention(
        q,
        kv,
        tables[[t for t, *_ in seqs]],
        seq_lens,
        starts,
        max(n for *_, n in seqs),
        q.shape[-1] ** -0.5,
        window=window,
        num_splits=num_splits,
        out=torch.full_like(q, float("nan")),
        batch_invariant=invariant,
    )
    return list(out.split([n for *_, n in seqs]))


@pytest.mark.parametrize(
    "dtype,group,window", [(torch.float32, 4, None), (torch.float16, 1, None), (torch.float16, 2, 9)]
)
def test_invariant_attention_rows_do_not_depend_on_batch_or_chunking(
    dtype: torch.dtype, group: int, window: int | None
) -> None:
    length, kv_heads, head_dim, block_size = 70, 2, 16, 8
    kv, tables = one_sequence_cache(length, kv_heads, head_dim, block_size, dtype, seed=8)
    q = randn(length, kv_heads * group, head_dim, dtype=dtype, seed=9)
    other = randn(23, kv_heads * group, head_dim, dtype=dtype, seed=10)
    (whole,) = attend([q], kv, tables, [(0, 0, length)], window, True)
    ref = pa.reference(
        q,
        kv,
        tables[:1],
        torch.tensor([length], device=DEVICE),
        torch.tensor([0, length], device=DEVICE),
        head_dim**-0.5,
        window=window,
    )
    assert rel_err(whole, ref) < KERNEL_TOL[dtype]
    # Chunked prefills at several split points, each chunk beside a decode and a prefill
    # of the other sequence: the same bits as the whole prompt at once.
    for cuts in ([0, 17, 18, 70], [0, 1, 33, 64, 70], [0, 69, 70]):
        chunks = []
        for c0, c1 in zip(cuts, cuts[1:]):
            mine, *_ = attend(
                [q[c0:c1], other[22:23], other[:5]], kv, tables, [(0, c0, c1 - c0), (1, 22, 1), (1, 0, 5)], window, True
            )
            chunks.append(mine)
        assert torch.equal(torch.cat(chunks), whole), cuts
    # The last token as a decode, alone, and after 15 other decodes of other lengths.
    (alone,) = attend([q[-1:]], kv, tables, [(0, length - 1, 1)], window, True)
    assert torch.equal(alone, whole[-1:])
    crowd = [(1, c, 1) for c in range(7, 22)] + [(0, length - 1, 1)]
    outs = attend([other[c : c + 1] for c in range(7, 22)] + [q[-1:]], kv, tables, crowd, window, True)
    assert torch.equal(outs[-1], whole[-1:])
    with pytest.raises(ValueError, match="does not split"):
        attend([q[-1:]], kv, tables, [(0, length - 1, 1)], window, True, num_splits=2)


def test_default_attention_decode_differs_from_its_prefill_row() -> None:
    """Without the mode the decode tiles (and, alone, split-KV) differ from the prefill's."""
    length = 300
    kv, tables = one_sequence_cache(length, 1, 16, 16, torch.float32, seed=11)
    q = randn(length, 4, 16, dtype=torch.float32, seed=12)
    (whole,) = attend([q], kv, tables, [(0, 0, length)], None, False)
    (alone,) = attend([q[-1:]], kv, tables, [(0, length - 1, 1)], None, False)
    assert not torch.equal(alone, whole[-1:])
    assert rel_err(alone, whole[-1:]) < KERNEL_TOL[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_wise_layer_ops_do_not_depend_on_m(dtype: torch.dtype) -> None:
    x, res = randn(16, 96, dtype=dtype, seed=13), randn(16, 96, dtype=dtype, seed=14)
    weight = randn(96, dtype=dtype, seed=15)
    gate_up = randn(16, 2 * 96, dtype=dtype, seed=16)
    norm, summed = rms_norm(x, weight, 1e-5, res)
    act = silu_and_mul(gate_up)
    for m in ROW_COUNTS:
        norm_m, summed_m = rms_norm(x[:m], weight, 1e-5, res[:m])
        assert torch.equal(norm_m, norm[:m]) and torch.equal(summed_m, summed[:m])
        assert torch.equal(silu_and_mul(gate_up[:m]), act[:m])


def test_backend_captures_one_unsplit_graph_per_batch_size() -> None:
    spec = AttentionSpec(8, 2, 16, 0.25)
    device = torch.device(DEVICE)
    default = create_attention_backend("triton", spec, 16, device)
    invariant = create_attention_backend("triton", spec, 16, device, batch_invariant=True)
    assert len(default.graph_variants(1, 4096, device)) > 1  # split-KV counts for long contexts
    assert invariant.graph_variants(1, 4096, device) == [1]
    assert invariant.pick_graph_variant(1, 4096, [1], device) == 1
    with pytest.raises(ValueError, match="needs the triton attention backend"):
        create_attention_backend("torch", spec, 16, torch.device("cuda"), batch_invariant=True)


def test_flag_reaches_engine_args(tiny_model_dir: Callable[[str], str]) -> None:
    folder = tiny_model_dir("llama")
    assert engine_args_from(build_parser().parse_args(["serve", folder, "--batch-invariant"])).batch_invariant
    assert not engine_args_from(build_parser().parse_args(["serve", folder])).batch_invariant


PROMPT = [11, 40, 2, 99, 7, 7, 301, 5, 60, 18, 250, 3, 77]
OTHERS = [[(17 * i + j) % 500 + 3 for j in range(1 + (5 * i) % 19)] for i in range(15)]


def invariant_runs(llm_for: Callable[..., LLM], tokens: int) -> tuple[list[int], list[int], list[int]]:
    """One request's greedy tokens: alone, among 15 others of other lengths, and with its
    prompt chunked by a small token budget (while the others run beside it)."""
    alone = llm_for().generate([PROMPT], greedy(tokens))[0].outputs[0].token_ids
    crowd = llm_for().generate(OTHERS[:7] + [PROMPT] + OTHERS[7:], greedy(tokens))[7].outputs[0].token_ids
    chunked = llm_for(max_num_batched_tokens=5).generate(OTHERS[:3] + [PROMPT], greedy(tokens))[3]
    return alone, crowd, chunked.outputs[0].token_ids


def test_engine_on_the_triton_backend_is_batch_invariant(tiny_model_dir: Callable[[str], str]) -> None:
    """The engine's plumbing, in the interpreter: every layer and the tied head switched."""
    path = tiny_model_dir("tied")

    def llm_for(**options: object) -> LLM:
        return make_llm(path, attention_backend="triton", batch_invariant=True, max_num_seqs=16, **options)

    llm = llm_for()
    model = llm.engine.model
    layers = [m for m in model.modules() if isinstance(m, LinearLayer)]
    assert layers and all(layer.batch_invariant for layer in layers) and model.batch_invariant
    assert llm.engine.runner.backend.batch_invariant
    alone, crowd, chunked = invariant_runs(llm_for, 4)
    assert alone == crowd == chunked


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True])
@pytest.mark.parametrize("kind,quantization", [("llama", None), ("tied", None), ("qwen2", "int4"), ("llama", "int8")])
def test_greedy_tokens_do_not_depend_on_the_batch_on_a_gpu(
    tiny_model_dir: Callable[[str], str], kind: str, quantization: str | None, enforce_eager: bool
) -> None:
    path = tiny_model_dir(kind)

    def llm_for(**options: object) -> LLM:
        return make_llm(
            path,
            dtype="float16",
            device="cuda",
            batch_invariant=True,
            quantization=quantization,
            enforce_eager=enforce_eager,
            max_num_seqs=16,
            **options,
        )

    alone, crowd, chunked = invariant_runs(llm_for, 12)
    assert alone == crowd == chunked
