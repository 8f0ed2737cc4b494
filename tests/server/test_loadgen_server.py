"""`cadence loadgen` end to end: against a live Cadence on a tiny model, its counts equal the
server's usage and /metrics deltas, its files and plots are written, and the faults it
injects leave the server idle; against the synthetic server, its timing is honest about
queueing in the harness."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cadence.loadgen.main import main as loadgen
from tests.support.server_checks import assert_idle
from tests.support.server_harness import ServerProcess
from tests.support.synthetic_server import SyntheticServerProcess

MODEL = "tiny"
VLLM_FIELDS = (
    "duration completed failed total_input_tokens total_output_tokens request_throughput output_throughput "
    "total_token_throughput request_goodput input_lens output_lens ttfts itls generated_texts errors"
).split()


@pytest.fixture(scope="module")
def server(tiny_model_dir: Callable[[str], str]) -> Iterator[ServerProcess]:
    args = ("--served-model-name", MODEL, "--block-size", "4", "--num-gpu-blocks", "512", "--max-num-seqs", "8")
    with ServerProcess(tiny_model_dir("llama"), *args) as process:
        yield process


def run(server_url: str, tmp_path: Path, *flags: str) -> dict[str, Any]:
    result = tmp_path / "result.json"
    argv = ["--base-url", server_url, "--disable-tqdm", "--metrics-interval", "0.2", "--save-result", str(result)]
    assert loadgen([*argv, *flags]) == 0
    return json.loads(result.read_text())


def is_png(path: Path) -> bool:
    data = path.read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        return False
    width, height = struct.unpack(">II", data[16:24])
    return width > 200 and height > 200


def test_counts_equal_the_servers_usage_and_metrics(server: ServerProcess, tmp_path: Path) -> None:
    flags = ("--num-prompts", "12", "--random-input-len", "24", "--random-output-len", "6", "--ignore-eos")
    plots = tmp_path / "plots"
    out = run(
        server.base_url, tmp_path, *flags, "--max-concurrency", "4", "--goodput", "ttft:60000", "--plot", str(plots)
    )

    assert all(field in out for field in VLLM_FIELDS)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert all(f"{stat}_{metric}_ms" in out for stat in ("mean", "median", "std", "p99"))
    assert out["completed"] == 12 and out["failed"] == 0 and out["errors"] == [""] * 12
    assert out["output_lens"] == [6] * 12 and out["total_output_tokens"] == 72
    assert out["request_goodput"] == pytest.approx(out["request_throughput"])
    assert out["max_concurrent_requests"] <= 4
    # The prompts were cut to length with the server's own tokenizer, and its usage agrees.
    assert out["input_lens"] == [24] * 12 and out["total_input_tokens"] == 288
    # One gap between each two text chunks: a chunk may carry several tokens when the front
    # end wakes after several engine steps (a busy machine can fold a whole answer into one
    # chunk), or none when a token ends inside a UTF-8 character. So at most 5 gaps each,
    # none negative, and most requests streamed in more than one chunk.
    assert all(len(gaps) <= 5 and min(gaps, default=0.0) >= 0.0 for gaps in out["itls"])
    assert sum(len(gaps) >= 1 for gaps in out["itls"]) >= 6

    metrics = out["server_metrics"]
    assert metrics["available"] and metrics["prefix"] == "cadence" and metrics["idle_after_run"]
    key = metrics["key"]
    assert key["generation_tokens"] == 72 and key["prompt_tokens"] == out["total_input_tokens"]
    assert key["request_success"] == {"length": 12}
    assert len(metrics["timeline"]) >= 1 and "num_requests_running" in metrics["timeline"][0]

    detail = [json.loads(line) for line in (tmp_path / "result.requests.jsonl").read_text().splitlines()]
    assert len(detail) == 12 and {d["output_tokens"] for d in detail} == {6}
    assert all(d["ttft_s"] >= d["send_delay_s"] for d in detail)
    pngs = sorted(p.name for p in plots.iterdir())
    assert pngs == ["run_latency_cdf.png", "run_timeline.png"] and all(is_png(plots / p) for p in pngs)


def test_chat_and_a_rate_sweep(server: ServerProcess, tmp_path: Path) -> None:
    flags = ("--endpoint", "chat", "--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "4")
    out = run(
        server.base_url, tmp_path, *flags, "--ignore-eos", "--sweep", "request-rate=20,inf", "--plot", str(tmp_path)
    )
    points = out["sweep"]["points"]
    assert out["sweep"]["axis"] == "request-rate" and [p["value"] for p in points] == [20, "inf"]
    assert all(p["completed"] == 4 and p["total_output_tokens"] == 16 for p in points)
    # Chat prompts carry the template's tokens too, and the server's usage counts them.
    assert all(n > 8 for p in points for n in p["input_lens"])
    assert is_png(tmp_path / "sweep_goodput.png")


def test_faults_are_answered_and_leave_the_server_idle(server: ServerProcess, tmp_path: Path) -> None:
    flags = ("--num-prompts", "24", "--random-input-len", "12", "--random-output-len", "40", "--ignore-eos")
    out = run(server.base_url, tmp_path, *flags, "--abort-fraction", "0.25", "--malformed-fraction", "0.25")

    faults = out["faults"]
    assert sum(case["sent"] for case in faults["malformed"].values()) == 6
    for name, case in faults["malformed"].items():
        assert case["refused_with_4xx"] == case["sent"] == case["with_error_body"], name
    assert faults["malformed"]["unknown model"]["statuses"] == {"404": 1}
    # The harness cuts a stream after a number of chunks, and a busy front end may fold
    # several tokens into one chunk, so a stream can end before its cut comes: it then
    # finished, and nothing else may have happened to it.
    aborted = faults["aborted"]
    assert aborted["sent"] == 6 and aborted["failed_otherwise"] == 0
    assert aborted["disconnected_mid_stream"] + aborted["finished_before_the_cut"] == 6
    assert aborted["disconnected_mid_stream"] >= 1
    # Only the normal requests count, and all of them finished.
    assert out["completed"] == 12 and out["failed"] == 0

    metrics = out["server_metrics"]
    assert metrics["idle_after_run"]
    # The engine may finish an aborted stream's 40 tokens before the harness, reading
    # behind it, cuts the connection: the server then rightly counts it as "length".
    finished = metrics["key"]["request_success"]
    assert set(finished) <= {"length", "abort"} and sum(finished.values()) == 18
    assert finished.get("length", 0) >= 12 and finished.get("abort", 0) >= 1
    assert_idle(server)
    assert server.metric("cadence:kv_cache_usage_perc") == 0.0
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 4, "ignore_eos": True}
    answer = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4


def test_waiting_for_a_concurrency_slot_counts_against_latency(
    tiny_model_dir: Callable[[str], str], tmp_path: Path
) -> None:
    # Every answer takes 0.2 s to its first token and 0.23 s in all; requests are due
    # every 0.05 s but only one may be in flight, so each waits longer than the last.
    with SyntheticServerProcess(ttft=0.2, itl=0.01) as synthetic:
        flags = ("--num-prompts", "6", "--custom-output-len", "4", "--request-rate", "20", "--burstiness", "1000")
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text('{"prompt": "x"}\n')
        out = run(
            synthetic.base_url,
            tmp_path,
            *flags,
            "--max-concurrency",
            "1",
            "--dataset-name",
            "custom",
            "--dataset-path",
            str(prompts),
            "--tokenizer",
            tiny_model_dir("llama"),
        )
    detail = [json.loads(line) for line in (tmp_path / "result.requests.jsonl").read_text().splitlines()]
    assert out["completed"] == 6
    for i, d in enumerate(detail):
        # From due: the wait for the slot plus the server's own 0.2 s.
        assert d["ttft_s"] - d["send_delay_s"] == pytest.approx(0.2, abs=0.05)
        if i:
            assert d["send_delay_s"] > detail[i - 1]["send_delay_s"]
    assert detail[-1]["send_delay_s"] > 0.7  # five waits of about 0.18 s
    assert out["mean_ttft_ms"] > 500 and not math.isnan(out["mean_send_delay_ms"])
