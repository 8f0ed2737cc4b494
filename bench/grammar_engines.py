"""llguidance against xgrammar on Cadence's structured-output workload, each in its own process.

On the default model's tokenizer (SmolLM2-135M-Instruct, resolved as `cadence serve` does),
for the schemas of bench/structured_schemas.py: import and tokenizer-setup time, compile
time per schema (cold, no cache), masks per token while walking each schema's example at
batch 1 and at batch 64 (the library's parallel batch call, and one matcher after another),
and memory (RSS growth in the engine's own process). Then hostile schemas (deep nesting,
a 10,000-value enum, catastrophic and exploding regexes, a huge alternation, ...), each
in a fresh process with a time and memory limit, reporting what each engine did.

    python bench/grammar_engines.py                    # every engine found, threads = cores
    python bench/grammar_engines.py --engines llguidance --skip-hostile

xgrammar is not a Cadence dependency. Install it for this bench only, without its declared
dependencies (torch, triton, transformers are already installed; --no-deps keeps a CUDA
torch out):

    pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi

Without it the bench measures llguidance alone and says so.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

from common.grammar_engine_adapters import ENGINES, XGRAMMAR_INSTALL
from common.grammar_engine_report import cadence_check_lines, failure_lines, hostile_table, walk_notes, workload_table
from common.grammar_pathological import hostile_cases
from structured_schemas import check_all, schemas

RESULT_PREFIX = "RESULT "


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    ap.add_argument("--model", help="HF folder or .gguf whose tokenizer to use (default: Cadence's default model)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for batch calls and compiles")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--skip-hostile", action="store_true")
    ap.add_argument("--hostile-timeout", type=float, default=60.0, help="seconds per hostile case (default 60)")
    ap.add_argument("--hostile-max-rss-gib", type=float, default=4.0, help="memory per hostile case (default 4)")
    ap.add_argument("--worker", choices=["workload", "hostile"], help=argparse.SUPPRESS)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--model-path", help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def run_worker(args: argparse.Namespace) -> int:
    from common.grammar_engine_worker import measure_hostile, measure_workload

    if args.worker == "workload":
        result = measure_workload(args.engine, args.threads, args.batch, args.model_path, schemas())
    else:
        case = next(c for c in hostile_cases() if c.name == args.case)
        result = measure_hostile(args.engine, args.threads, args.model_path, case)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


def _rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            line = next((x for x in f if x.startswith("VmRSS:")), "VmRSS: 0 kB")
    except OSError:
        return 0.0
    return int(line.split()[1]) / 1024


def _busy_cpu_seconds() -> float:
    """CPU-seconds all processes have been busy since boot (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def spawn(worker_args: list[str], timeout: float, max_rss_mib: float) -> dict[str, Any]:
    """A worker's result; or its fate (timeout, killed for memory, crashed) when it gives none.

    `other_cores` in the result: the mean number of cores other processes kept busy while it ran."""
    command = [sys.executable, os.path.abspath(__file__), *worker_args]
    busy, children, own, wall = _busy_cpu_seconds(), _children_cpu_seconds(), time.process_time(), time.monotonic()
    with tempfile.TemporaryFile("w+") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True)
        deadline, peak = time.monotonic() + timeout, 0.0
        fate = ""
        while process.poll() is None:
            peak = max(peak, _rss_mib(process.pid))
            if peak > max_rss_mib:
                fate = f"killed: RSS over {max_rss_mib / 1024:.0f} GiB"
            elif time.monotonic() > deadline:
                fate = f"timeout: over {timeout:.0f} s"
            if fate:
                process.kill()
                process.wait()
                break
            time.sleep(0.05)
        out.seek(0)
        text = out.read()
    result = next((json.loads(x[len(RESULT_PREFIX) :]) for x in text.splitlines() if x.startswith(RESULT_PREFIX)), None)
    mine = (_children_cpu_seconds() - children) + (time.process_time() - own)
    others = (_busy_cpu_seconds() - busy) - mine
    if result is not None:
        return dict(result, other_cores=max(0.0, others / (time.monotonic() - wall)))
    if not fate:
        code = process.returncode
        fate = f"crashed: signal {-code}" if code < 0 else f"crashed: exit {code}"
        fate += f" ({text.strip().splitlines()[-1][:100]})" if text.strip() else ""
    return {"outcome": fate}


def cpu_line() -> str:
    """lscpu's model name and the ISA flags that matter for these libraries' inner loops."""
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    model = next((x.split(":", 1)[1].strip() for x in lscpu.splitlines() if x.startswith("Model name:")), "?")
    flags_line = next((x for x in lscpu.splitlines() if x.startswith("Flags:")), "")
    wanted = ("sse4_2", "avx2", "bmi2", "avx512f", "avx512bw", "avx512_vnni", "amx_tile")
    flags = [f for f in wanted if f in flags_line.split()]
    return f"{model}, {os.cpu_count()} cores, flags: {' '.join(flags)}"


def commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(
        ["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    )
    dirty = subprocess.run(["git", "-C", here, "status", "--porcelain"], capture_output=True, text=True, check=False)
    return out.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    engines = list(args.engines)
    if importlib.util.find_spec("xgrammar") is None and any(e.startswith("xgrammar") for e in engines):
        print(f"xgrammar is not installed, so llguidance alone is measured; install it with `{XGRAMMAR_INSTALL}`")
        engines = [e for e in engines if not e.startswith("xgrammar")]
    from cadence.engine.default_model import resolve_model_path

    model_path = resolve_model_path(args.model)
    schema_set = schemas()
    check_all(schema_set)
    load_start = os.getloadavg()
    print(f"# Grammar engines on Cadence's structured-output workload ({time.strftime('%Y-%m-%d %H:%M %Z')})")
    print(f"commit {commit()}; python {sys.version.split()[0]}; {args.threads} threads for batch calls and compiles")
    print(f"cpu: {cpu_line()}")
    print(f"tokenizer: {model_path}")
    print(f"{len(schema_set)} schemas; batch {args.batch}; load average at start {load_start[0]:.2f}\n")
    common = ["--threads", str(args.threads), "--batch", str(args.batch), "--model-path", model_path]
    results = []
    for engine in engines:
        result = spawn(["--worker", "workload", "--engine", engine, *common], timeout=3600, max_rss_mib=16 * 1024)
        if "engine" not in result:
            print(f"{engine}: the workload run gave no result ({result['outcome']})")
            continue
        results.append(result)
    print(workload_table(results))
    failures = failure_lines(results)
    print(
        "\nSchemas an engine refused or could not walk:"
        if failures
        else "\nEvery engine compiled and walked every schema."
    )
    print("\n".join(failures))
    print("\n".join(walk_notes(results)))
    if not args.skip_hostile:
        cases = hostile_cases()
        outcomes = {}
        for case in cases:
            for engine in engines:
                worker = ["--worker", "hostile", "--engine", engine, "--case", case.name, *common]
                outcomes[(engine, case.name)] = spawn(worker, args.hostile_timeout, args.hostile_max_rss_gib * 1024)
        print("\n" + hostile_table(cases, outcomes, engines))
        checks = cadence_check_lines(cases, outcomes)
        if checks:
            print("\nCadence's own grammar_text + check_grammar (strict settings) on each hostile schema:")
            print("\n".join(checks))
    load_end = os.getloadavg()
    print(f"\nload average (1 min) at start {load_start[0]:.2f}, at end {load_end[0]:.2f} (2 cores)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
