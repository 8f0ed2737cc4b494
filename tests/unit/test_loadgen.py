"""The load generator's parts on their own: statistics on hand-made timelines, the arrival
process, fault assignment, the capacity search, the SSE reader and the datasets."""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from cadence.loadgen.datasets import DatasetOptions, build_dataset
from cadence.loadgen.faults import assign_kinds
from cadence.loadgen.records import HarnessHealth, RequestRecord, RunResult, RunSettings
from cadence.loadgen.report import save_result
from cadence.loadgen.request import StreamReader
from cadence.loadgen.schedule import arrival_offsets
from cadence.loadgen.stats import SLO, percentile, summarize
from cadence.loadgen.sweep import CapacitySearch, SweepSpec, find_capacity
from cadence.loadgen.tokenizer import LocalTokenizer


def record(index: int, due: float, sent: float, token_times: list[float], done: float, tokens: int) -> RequestRecord:
    r = RequestRecord(index, "normal", prompt_len=10, expected_output_len=tokens, due=due)
    r.sent, r.token_times, r.done, r.output_tokens = sent, token_times, done, tokens
    r.status, r.success, r.usage_prompt_tokens = 200, True, 11
    return r


def run_of(records: list[RequestRecord], duration: float) -> RunResult:
    return RunResult(RunSettings(2.0, 1.0, 1, len(records)), 0.0, duration, records, HarnessHealth([0.001, 0.003]))


def test_percentiles_interpolate_between_ranks_as_numpy_and_vllm_do() -> None:
    values = [40.0, 10.0, 30.0, 20.0]
    assert percentile(values, 50) == 25.0
    # rank 0.99 * 3 = 2.97: 30 + 0.97 * (40 - 30)
    assert percentile(values, 99) == pytest.approx(39.7)
    assert percentile(values, 0) == 10.0 and percentile(values, 100) == 40.0
    assert math.isnan(percentile([], 50))


def test_latencies_count_from_when_the_request_was_due_not_when_it_was_sent() -> None:
    # Due at 0, held 0.5 s for a concurrency slot, first token at 1.0, three tokens by 1.25.
    queued = record(0, due=0.0, sent=0.5, token_times=[1.0, 1.1, 1.2], done=1.25, tokens=3)
    prompt = record(1, due=1.0, sent=1.0, token_times=[1.2, 1.3], done=1.3, tokens=2)
    failed = RequestRecord(2, "normal", 10, 3, due=1.5)
    failed.sent, failed.done, failed.status, failed.error = 1.5, 1.6, 503, "HTTP 503: full"
    summary = summarize(run_of([queued, prompt, failed], duration=2.0), (50, 99), SLO.parse(["ttft:500"]))

    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["total_input_tokens"] == 22 and summary["total_output_tokens"] == 5
    assert summary["request_throughput"] == 1.0 and summary["output_throughput"] == 2.5
    assert summary["mean_ttft_ms"] == pytest.approx((1000 + 200) / 2)
    assert summary["median_e2el_ms"] == pytest.approx((1250 + 300) / 2)
    # TPOT: (e2el - ttft) / (tokens - 1): 0.25 / 2 and 0.1 / 1.
    assert summary["mean_tpot_ms"] == pytest.approx((125 + 100) / 2)
    assert summary["mean_itl_ms"] == pytest.approx(100)
    # Only the unqueued request meets TTFT <= 500 ms: the queued one waited 1 s from its due time.
    assert summary["request_goodput"] == 0.5
    assert summary["mean_send_delay_ms"] == pytest.approx(500 / 3)
    assert summary["max_concurrent_requests"] == 2
    assert summary["ttfts"] == [1.0, pytest.approx(0.2), None]
    assert summary["errors"] == ["", "", "HTTP 503: full"]


def test_slo_parsing_refuses_what_it_cannot_judge() -> None:
    assert SLO.parse(["ttft:500", "tpot:50"]).limits_ms == {"ttft": 500.0, "tpot": 50.0}
    for bad in (["ttft=500"], ["itl:5"], ["e2el:-1"]):
        with pytest.raises(ValueError):
            SLO.parse(bad)


def test_arrivals_have_the_asked_rate_and_burstiness() -> None:
    for burstiness in (1.0, 0.25, 4.0):
        offsets = arrival_offsets(8000, 10.0, burstiness, seed=3)
        gaps = [b - a for a, b in zip(offsets, offsets[1:])]
        mean = statistics.fmean(gaps)
        assert mean == pytest.approx(0.1, rel=0.05)
        # A gamma gap's squared coefficient of variation is 1 / shape.
        assert statistics.pvariance(gaps) / mean**2 == pytest.approx(1 / burstiness, rel=0.15)
    assert arrival_offsets(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    assert arrival_offsets(50, 5.0, 1.0, 7) == arrival_offsets(50, 5.0, 1.0, 7)
    with pytest.raises(ValueError):
        arrival_offsets(5, 0.0, 1.0, 0)


def test_faults_take_exactly_their_share_of_the_requests() -> None:
    kinds = assign_kinds(40, 0.25, 0.1, seed=1)
    assert kinds.count("abort") == 10 and kinds.count("malformed") == 4 and kinds.count("normal") == 26
    assert kinds == assign_kinds(40, 0.25, 0.1, seed=1) and kinds != assign_kinds(40, 0.25, 0.1, seed=2)
    with pytest.raises(ValueError):
        assign_kinds(10, 0.6, 0.6, 0)


def capacity_probe(threshold: float, calls: list[float]) -> Callable[[float, int], Awaitable[dict]]:
    """A fake run: it meets the SLO (p90 TTFT 100 ms) exactly when the rate is at most `threshold`."""

    async def probe(rate: float, index: int) -> dict:
        calls.append(rate)
        ttft = 100.0 if rate <= threshold else 900.0
        return {"failed": 0, "completed": 10, "p90_ttft_ms": ttft}

    return probe


@pytest.mark.parametrize("threshold", [5.3, 0.3, 1.0])
def test_capacity_search_brackets_then_bisects_within_its_probe_budget(threshold: float) -> None:
    calls: list[float] = []
    search = CapacitySearch(SLO.parse(["ttft:200"]), at_percentile=90, start_rate=1.0, tolerance=0.05, max_probes=12)
    found, points = asyncio.run(find_capacity(search, capacity_probe(threshold, calls)))
    assert found is not None and found <= threshold
    assert (threshold - found) / threshold <= 0.06
    assert len(points) == len(calls) <= 12


def test_capacity_search_reports_none_when_even_the_lowest_rate_fails() -> None:
    calls: list[float] = []
    search = CapacitySearch(SLO.parse(["ttft:200"]), start_rate=1.0, max_probes=20, min_rate=0.1)
    found, _ = asyncio.run(find_capacity(search, capacity_probe(0.01, calls)))
    assert found is None and calls == [1.0, 0.5, 0.25, 0.125]  # half of 1/8 is under min_rate


def test_sweep_spec() -> None:
    assert SweepSpec.parse("request-rate=1,2.5,inf").values == [1.0, 2.5, math.inf]
    assert SweepSpec.parse("max-concurrency=1,8").axis == "max-concurrency"
    for bad in ("rate=1,2", "request-rate=", "max-concurrency=1.5", "request-rate=0"):
        with pytest.raises(ValueError):
            SweepSpec.parse(bad)


def sse(chunks: list[dict[str, Any]]) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def test_the_stream_reader_gives_one_answer_however_the_bytes_are_cut() -> None:
    chunks: list[dict[str, Any]] = [
        {"choices": [{"index": 0, "text": "Hello", "finish_reason": None}]},
        {"choices": [{"index": 0, "text": "", "finish_reason": None}]},
        {"choices": [{"index": 0, "text": " wörld", "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}},
    ]
    data = sse(chunks)
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(data)), 6))
        r = RequestRecord(0, "normal", 7, 3, 0.0)
        r.status = 200
        reader = StreamReader(r, start=0.0)
        for a, b in zip([0, *cuts], [*cuts, len(data)]):
            reader.feed(data[a:b])
        assert r.token_times == [] and reader.events <= 5  # nothing is parsed until finish()
        reader.finish()
        assert r.success and reader.finished and r.generated_text == "Hello wörld" and r.finish_reason == "length"
        assert len(r.token_times) == 2  # the empty chunk carries no text
        assert r.output_tokens == 3 and r.usage_prompt_tokens == 7


def test_without_usage_the_reader_counts_text_chunks() -> None:
    r = RequestRecord(0, "normal", 7, 3, 0.0)
    r.status = 200
    reader = StreamReader(r, start=0.0)
    reader.feed(sse([{"choices": [{"index": 0, "delta": {"content": t}}]} for t in ("a", "b", "c")]))
    reader.finish()
    assert r.output_tokens == 3 and r.usage_prompt_tokens is None and r.generated_text == "abc" and r.success


def test_a_stream_cut_short_or_carrying_an_error_is_a_failure() -> None:
    cut = RequestRecord(0, "normal", 7, 3, 0.0)
    cut.status = 200
    reader = StreamReader(cut, start=0.0)
    reader.feed(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n')
    reader.finish()
    assert not cut.success and "without [DONE]" in cut.error
    failed = RequestRecord(1, "normal", 7, 3, 0.0)
    failed.status = 200
    reader = StreamReader(failed, start=0.0)
    reader.feed(b'data: {"error": {"message": "engine died", "type": "server_error"}}\n\ndata: [DONE]\n\n')
    reader.finish()
    assert not failed.success and failed.error == "engine died" and failed.error_body is not None


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Callable[[str], str]) -> LocalTokenizer:
    return LocalTokenizer(tiny_model_dir("llama"))


def test_random_prompts_have_their_counted_length_and_share_no_prefix(tokenizer: LocalTokenizer) -> None:
    options = DatasetOptions("random", num_prompts=20, seed=1, random_input_len=40, random_range_ratio=0.5)
    samples = build_dataset(tokenizer, options)
    assert len(samples) == 20
    for s in samples:
        assert s.prompt_len == len(tokenizer.encode(s.prompt))
        assert 20 - 2 <= s.prompt_len <= 60 + 2
        assert 64 <= s.output_len <= 192
    assert len({s.prompt[:12] for s in samples}) == 20
    assert [s.prompt for s in build_dataset(tokenizer, options)] == [s.prompt for s in samples]


def test_prefix_repetition_shares_exactly_the_asked_prefixes(tokenizer: LocalTokenizer) -> None:
    options = DatasetOptions(
        "prefix-repetition",
        num_prompts=12,
        prefix_repetition_prefix_len=30,
        prefix_repetition_suffix_len=10,
        prefix_repetition_num_prefixes=3,
    )
    samples = build_dataset(tokenizer, options)
    prefixes = {s.prompt[: len(tokenizer.decode(tokenizer.encode(s.prompt)[:25]))] for s in samples}
    assert len(prefixes) == 3
    assert all(35 <= s.prompt_len <= 45 and s.output_len == 128 for s in samples)


def test_sharegpt_takes_first_exchanges_and_drops_what_cannot_be_timed(
    tokenizer: LocalTokenizer, tmp_path: Path
) -> None:
    long_reply = "the quick brown fox jumps over the lazy dog " * 3
    conversations = [
        {
            "conversations": [
                {"from": "human", "value": "Tell me about Paris and Berlin"},
                {"from": "gpt", "value": long_reply},
            ]
        },
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": long_reply}]},  # prompt too short
        {"conversations": [{"from": "gpt", "value": "no user turn"}]},
        {
            "messages": [
                {"role": "user", "content": "Paged KV caches store blocks"},
                {"role": "assistant", "content": long_reply},
            ]
        },
    ]
    path = tmp_path / "share.json"
    path.write_text(json.dumps(conversations))
    samples = build_dataset(tokenizer, DatasetOptions("sharegpt", num_prompts=2, path=str(path)))
    assert sorted(s.prompt for s in samples) == ["Paged KV caches store blocks", "Tell me about Paris and Berlin"]
    assert all(s.output_len == len(tokenizer.encode(long_reply)) for s in samples)
    with pytest.raises(ValueError, match="fewer than --num-prompts"):
        build_dataset(tokenizer, DatasetOptions("sharegpt", num_prompts=3, path=str(path)))


def test_custom_jsonl_keeps_order_and_per_line_lengths(tokenizer: LocalTokenizer, tmp_path: Path) -> None:
    path = tmp_path / "custom.jsonl"
    path.write_text('{"prompt": "one two", "output_tokens": 5}\n{"prompt": "three"}\n')
    samples = build_dataset(tokenizer, DatasetOptions("custom", num_prompts=3, path=str(path), custom_output_len=9))
    assert [(s.prompt, s.output_len) for s in samples] == [("one two", 5), ("three", 9), ("one two", 5)]


def test_an_slo_percentile_missing_from_the_summary_is_an_error_not_a_failure() -> None:
    summary = summarize(run_of([record(0, 0.0, 0.0, [0.1, 0.2], 0.2, 2)], 1.0), (99,))
    slo = SLO.parse(["ttft:500"])
    assert slo.met_at(summary, 99)
    with pytest.raises(KeyError, match="p90_ttft_ms"):
        slo.met_at(summary, 90)


def test_the_stream_reader_reads_crlf_events_however_the_bytes_are_cut() -> None:
    # sse-starlette (llama-cpp-python's server, among others) ends its lines with CRLF.
    data = sse([{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in ("a", "b")])
    data = data.replace(b"\n", b"\r\n")
    for cut in range(1, len(data)):
        r = RequestRecord(0, "normal", 7, 2, 0.0)
        r.status = 200
        reader = StreamReader(r, start=0.0)
        reader.feed(data[:cut])
        reader.feed(data[cut:])
        reader.finish()
        assert r.success and r.generated_text == "ab" and len(r.token_times) == 2, cut
    whole = StreamReader(RequestRecord(0, "normal", 7, 2, 0.0), start=0.0)
    whole.feed(data)
    assert whole.events == 3  # what an abort after N events counts


def test_a_fixed_sharegpt_output_length_is_not_held_to_the_minimum(tokenizer: LocalTokenizer, tmp_path: Path) -> None:
    turns = [{"from": "human", "value": "Tell me about Paris and Berlin"}, {"from": "gpt", "value": "ok"}]
    path = tmp_path / "share.json"
    path.write_text(json.dumps([{"conversations": turns}]))
    options = DatasetOptions("sharegpt", num_prompts=1, path=str(path), sharegpt_output_len=2)
    assert [s.output_len for s in build_dataset(tokenizer, options)] == [2]


def test_the_result_files_are_strict_json(tmp_path: Path) -> None:
    lone = record(0, 0.0, 0.0, [0.1], 0.1, 1)  # one token: no TPOT, no ITL
    result = run_of([lone], 1.0)
    summary = {**summarize(result), "pair": (math.nan, math.inf)}
    detail = save_result(tmp_path / "r.json", summary, [("run", result)])

    def refuse(name: str) -> None:
        raise ValueError(f"{name} in the JSON")

    loaded = json.loads((tmp_path / "r.json").read_text(), parse_constant=refuse)
    assert loaded["mean_tpot_ms"] is None and loaded["pair"] == [None, "inf"]
    json.loads(detail.read_text(), parse_constant=refuse)


def test_random_prompts_share_the_whole_asked_prefix(tokenizer: LocalTokenizer) -> None:
    options = DatasetOptions("random", num_prompts=20, seed=1, random_input_len=20, random_prefix_len=32)
    ids = [tokenizer.encode(s.prompt) for s in build_dataset(tokenizer, options)]
    assert all(i[:32] == ids[0][:32] for i in ids)


@pytest.mark.parametrize(
    "payload", [b"[1, 2]", b'"text"', b'{"choices": ["a"]}', b'{"usage": {"completion_tokens": "x"}}']
)
def test_a_chunk_of_another_shape_fails_its_request_not_the_run(payload: bytes) -> None:
    r = RequestRecord(0, "normal", 7, 3, 0.0)
    r.status = 200
    reader = StreamReader(r, start=0.0)
    reader.feed(b"data: " + payload + b"\n\ndata: [DONE]\n\n")
    reader.finish()
    assert not r.success and "another shape" in r.error
