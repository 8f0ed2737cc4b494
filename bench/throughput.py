"""Offline throughput: Cadence's `LLM.generate` against transformers' static-batch `generate`.

Both run in this one process on the same model, the same prompts and the same number of
torch threads. Prints, per scenario, output tokens/s for each, their ratio, and where
Cadence's time went by the engine's own StepTimings (the host overhead share).

    python bench/throughput.py --scenario all            # the real run (several minutes)
    python bench/throughput.py --quick                   # tiny model, smoke test of the script
    python bench/throughput.py --profile                 # + torch.profiler / cProfile of decode steps

Without --model, a SmolLM2-135M-shaped Llama with random weights is built from a config
and saved once under bench/out/models/ (git-ignored): throughput does not depend on the
weight values, and nothing needs downloading.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys

import torch
from transformers import AutoConfig, PreTrainedModel

from common.cadence_runs import CadenceResult, blocks_needed, cadence_llm, max_model_len_for, run_cadence, warm_up
from common.decode_profile import profile_decode
from common.hf_baseline import HFResult, hf_generate, hf_load, run_hf
from common.machine import load_average_line, machine_info, machine_line
from common.random_llama import SMOLLM2_135M, TINY, build_random_model
from common.scenario_report import TABLE_HEADER, scenario_details, scenario_row
from common.workloads import Workload, make_workload


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a Hugging Face model folder (default: random SmolLM2-135M-shaped Llama)")
    ap.add_argument("--scenario", choices=["equal", "mixed", "all"], default="all")
    ap.add_argument("--num-prompts", type=int, default=None, help="default 64 (8 with --quick)")
    ap.add_argument("--quick", action="store_true", help="tiny model, few prompts: a smoke run of this script")
    ap.add_argument("--skip-hf", action="store_true", help="run Cadence only")
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        nargs="+",
        default=[512, 2048],
        help="Cadence token budgets to try; the best is reported (default: 512 2048)",
    )
    ap.add_argument("--profile", action="store_true", help="also profile 10 decode steps at full batch")
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="weights and activations of both engines (bfloat16 uses AMX where the CPU has it)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    return ap.parse_args(argv)


def choose_model(args: argparse.Namespace) -> tuple[str, str]:
    """The model folder to benchmark, and the report line that says what it is."""
    if args.model:
        return args.model, f"model: {args.model}"
    if args.quick:
        path = build_random_model("tiny-llama-random", TINY)
        return path, "model: tiny random Llama (--quick); numbers are meaningless, this only exercises the script"
    path = build_random_model("smollm2-135m-shaped-random", SMOLLM2_135M)
    return path, (
        "model: SmolLM2-135M-shaped Llama (576 hidden, 1536 MLP, 30 layers, 9/3 heads, vocab 49152, tied) "
        f"with random weights, saved at {path}; throughput does not depend on the weight values"
    )


def time_hf(model: PreTrainedModel, work: Workload) -> HFResult:
    print(f"   transformers generate: batch {len(work.prompts)}, max_new_tokens={max(work.max_tokens)} ...", flush=True)
    hf = run_hf(model, work)
    print(
        f"   transformers: {hf.seconds:.1f}s, {hf.useful_tokens} useful of {hf.generated_tokens} generated tokens, "
        f"{hf.tok_per_s:.1f} tok/s (other processes used {hf.other_cores:.2f} cores meanwhile)",
        flush=True,
    )
    return hf


def time_cadence(path: str, work: Workload, budgets: list[int], dtype: str) -> list[CadenceResult]:
    """One fresh, warmed-up engine per max_num_batched_tokens in `budgets`, each timed on `work`."""
    results: list[CadenceResult] = []
    for mbt in budgets:
        llm = cadence_llm(path, blocks_needed(work), mbt, max_model_len_for(work), dtype)
        warm_up(llm)
        print(f"   cadence max_num_batched_tokens={mbt} ...", flush=True)
        res = run_cadence(llm, work, mbt)
        print(
            f"   cadence mbt={mbt}: {res.seconds:.1f}s, {res.output_tokens} tokens, {res.tok_per_s:.1f} tok/s, "
            f"{res.num_steps} steps (other processes used {res.other_cores:.2f} cores meanwhile)",
            flush=True,
        )
        results.append(res)
        # Release this engine's KV cache and weights before the next one is built.
        del llm
        gc.collect()
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    num_prompts = args.num_prompts or (8 if args.quick else 64)
    path, weights_note = choose_model(args)
    vocab_size = AutoConfig.from_pretrained(path).vocab_size
    info = machine_info()
    scenarios = ["equal", "mixed"] if args.scenario == "all" else [args.scenario]

    report: list[str] = [
        f"Date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"Command: python bench/throughput.py {' '.join(argv if argv is not None else sys.argv[1:])}",
        f"{machine_line(info)}; transformers {info['transformers']}, Python {info['python']}",
        weights_note,
        f"{args.dtype} everywhere, greedy, ignore_eos; both engines run in this one process, each warmed up first.",
        "",
    ]
    print("\n".join(report), flush=True)
    load_before = os.getloadavg()

    hf_model = None
    if not args.skip_hf:
        hf_model = hf_load(path, args.dtype)
        hf_generate(hf_model, [[1, 2, 3, 4, 5, 6, 7, 8]] * 2, 4)  # warm-up

    rows: list[str] = []
    details: list[str] = []
    profile_lines: list[str] = []
    for name in scenarios:
        work = make_workload(name, num_prompts, vocab_size, args.quick)
        print(f"== scenario {name}: {work.description}", flush=True)
        hf = time_hf(hf_model, work) if hf_model is not None else None
        results = time_cadence(path, work, args.max_num_batched_tokens, args.dtype)
        best = max(results, key=lambda r: r.tok_per_s)
        rows.append(scenario_row(work, hf, results, best))
        details += scenario_details(work, hf, results, best)
        # Progress for whoever watches the run: the tail of the details so far.
        print("\n".join(details[-20:]), flush=True)

        if args.profile and name == "equal":
            profile_lines = profile_decode(path, work, best.max_num_batched_tokens, args.dtype)

    # The load average goes into the header, but only the end of the run knows it.
    report.insert(3, load_average_line(load_before, os.getloadavg()))
    print()
    print("=" * 100)
    print("\n".join(report + TABLE_HEADER + rows + [""] + details + profile_lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
