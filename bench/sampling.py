"""The sampler at batch 1/16/64 on a 49152-token vocabulary, old against new in one process.

    python bench/sampling.py                 # the default model's real logits, plus flat and uniform
    python bench/sampling.py --synthetic     # no model: heavy-tailed synthetic logits instead
    python bench/sampling.py --step          # also a batch-64 decode step of the default model

"Old" is the sampler before this bench existed, kept here only as the baseline: top_k/top_p
from each row's largest 1024 logits (a partial topk) with a full sort for the rows whose
nucleus is wider, then an exponential race with one Exp(1) draw per token. Both run through
the same `Sampler.__call__`; the old stages are swapped in for the old rows of the table.
Each cell is the median wall-clock time of one sampler call, the two versions taking turns.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import torch

import cadence.engine.sampler as sampler_mod
from cadence import SamplingParams
from cadence.engine.default_model import resolve_model_path
from cadence.engine.sampler import Sampler, SamplingMetadata
from common.machine import machine_info, machine_line

VOCAB = 49152
SETTINGS: dict[str, SamplingParams] = {
    "T=0.7 top_p=0.95": SamplingParams(temperature=0.7, top_p=0.95),
    "T=0.7": SamplingParams(temperature=0.7),
    "T=0.7 top_k=50 top_p=0.95": SamplingParams(temperature=0.7, top_k=50, top_p=0.95),
    "T=0.7 min_p=0.05 top_p=0.95": SamplingParams(temperature=0.7, min_p=0.05, top_p=0.95),
    "T=0.7 top_p=0.95 penalties": SamplingParams(
        temperature=0.7, top_p=0.95, repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5
    ),
    "T=0.7 top_p=0.95 logprobs=5": SamplingParams(temperature=0.7, top_p=0.95, logprobs=5),
}


# ---------------------------------------------------------------- the old stages (baseline only)


def _old_thresholds(vals: torch.Tensor, k: torch.Tensor, p: torch.Tensor, z_full: torch.Tensor | None, vocab: int):
    neg_inf = float("-inf")
    width = vals.shape[1]
    k_on = k > 0
    kth = vals.gather(1, (k - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    kth = torch.where(k_on, kth, torch.full_like(kth, neg_inf))
    if z_full is None:
        return kth, torch.zeros_like(k_on)
    vals = vals.masked_fill(vals < kth.unsqueeze(1), neg_inf)
    e = (vals - vals[:, :1]).exp()
    c = e.cumsum(dim=-1)
    z = torch.where(k_on, c[:, -1], z_full)
    mass_before = torch.cat([torch.zeros_like(c[:, :1]), c[:, :-1]], dim=1)
    keep = mass_before < (p * z).unsqueeze(1)
    n_keep = keep.sum(dim=-1)
    cutoff = vals.gather(1, (n_keep - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    active = p < 1.0
    threshold = torch.where(active, torch.maximum(cutoff, kth), kth)
    return threshold, active & ~k_on & keep[:, -1] & (width < vocab)


def _old_apply_top_k_top_p(logits: torch.Tensor, md: SamplingMetadata) -> None:
    if md.top_k is None and md.top_p is None:
        return
    batch, vocab = logits.shape
    k = md.top_k.clamp(max=vocab) if md.top_k is not None else torch.zeros(batch, dtype=torch.int64)
    width = int(k.max())
    z_full = None
    if md.top_p is not None:
        p = md.top_p.to(logits.dtype)
        width = max(width, 1024)
        z_full = (logits - logits.amax(dim=-1, keepdim=True)).exp_().sum(dim=-1)
    else:
        p = torch.ones(batch, dtype=logits.dtype)
    vals = logits.topk(min(width, vocab), dim=-1).values
    threshold, open_rows = _old_thresholds(vals, k, p, z_full, vocab)
    if bool(open_rows.any()):
        assert z_full is not None
        rows = open_rows.nonzero().squeeze(1)
        full = logits[rows].sort(dim=-1, descending=True).values
        threshold[rows] = _old_thresholds(full, k[rows], p[rows], z_full[rows], vocab)[0]
    logits.masked_fill_(logits < threshold.unsqueeze(1), float("-inf"))


def _old_sample_rows(probs: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    q = torch.empty_like(probs)
    assert md.unseeded_rows is not None and md.unseeded_rows.numel() == probs.shape[0]
    q.uniform_().log_().neg_()
    return sampler_mod.row_argmax(probs.div_(q))


@contextlib.contextmanager
def old_sampler() -> Iterator[None]:
    """Sampler.__call__ runs the old top_k/top_p and the old per-token race meanwhile (and
    computes no shared mass, which the old stages did not use)."""
    names = ("top_k_top_p_threshold", "_mass", "_probabilities", "_sample_rows")
    saved = {name: getattr(sampler_mod, name) for name in names}

    def threshold(logits: torch.Tensor, md: SamplingMetadata, *_: object) -> None:
        _old_apply_top_k_top_p(logits, md)
        return None

    sampler_mod.top_k_top_p_threshold = threshold  # type: ignore[assignment]
    sampler_mod._mass = lambda logits, *_: logits  # type: ignore[assignment]
    sampler_mod._probabilities = lambda logits, *_: logits.sub_(logits.amax(-1, keepdim=True)).exp_()  # type: ignore[assignment]
    sampler_mod._sample_rows = _old_sample_rows  # type: ignore[assignment]
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(sampler_mod, name, value)


# ---------------------------------------------------------------- logits


def model_logits(rows: int) -> torch.Tensor:
    """The default model's next-token logits at `rows` positions of the fixed evaluation text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.from_tests import EVAL_TEXT

    path = resolve_model_path(None)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    ids = tokenizer(EVAL_TEXT, return_tensors="pt").input_ids[:, :rows]
    with torch.inference_mode():
        return model(ids).logits[0].float().clone()


def synthetic_logits(rows: int) -> torch.Tensor:
    """Heavy-tailed like a language model's: a Gumbel bulk plus a few strong candidates per row."""
    g = torch.Generator().manual_seed(0)
    logits = -torch.empty(rows, VOCAB).exponential_(generator=g).log() * 2.0
    strong = torch.randint(0, VOCAB, (rows, 8), generator=g)
    logits.scatter_add_(1, strong, torch.rand(rows, 8, generator=g) * 12)
    return logits


def metadata(params: SamplingParams, batch: int) -> SamplingMetadata:
    prompts = [[(7 * i + 3 * j) % VOCAB for j in range(300)] for i in range(batch)]
    outputs = [[(11 * i + 5 * j) % VOCAB for j in range(90)] for i in range(batch)]
    return SamplingMetadata.build(
        [params] * batch, prompts, outputs, [None] * batch, [set() for _ in range(batch)], torch.device("cpu")
    )


def interleaved_ms(calls: dict[str, Callable[[], object]], rounds: int, clock: Callable[[], float]) -> dict[str, float]:
    """Median milliseconds per call; the calls take turns so machine load drifts over all alike."""
    for fn in calls.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            start = clock()
            fn()
            samples[name].append((clock() - start) * 1e3)
    return {name: statistics.median(s) for name, s in samples.items()}


def decode_step_ms(batch: int, clock: Callable[[], float]) -> float:
    """Median engine step (ms, on `clock`) while `batch` greedy requests decode together on the
    default model: the prefill steps and the first decode steps are left out."""
    from cadence import LLM
    from cadence.engine.protocol import EngineCoreRequest

    engine = LLM(resolve_model_path(None), max_model_len=256, num_gpu_blocks=batch * 6 + 16, max_num_seqs=batch).engine
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(EngineCoreRequest(f"step-{i}", [(7 * i + 13 * j) % 40000 + 100 for j in range(32)], params))
    steps = []
    while engine.has_unfinished_requests():
        start = clock()
        engine.step()
        steps.append((clock() - start) * 1e3)
    return statistics.median(steps[-12:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--synthetic", action="store_true", help="synthetic heavy-tailed logits, no model")
    ap.add_argument("--step", action="store_true", help="also time a batch-64 decode step of the default model")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall clock, or CPU time on one thread (torch.set_num_threads(1), time.thread_time): "
        "the work itself, steady on a shared machine, where idle pool threads would spin on the CPU clock",
    )
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    args = ap.parse_args(argv)
    rows = max(args.batches)
    real = synthetic_logits(rows) if args.synthetic else model_logits(rows)
    g = torch.Generator().manual_seed(1)
    distributions = {
        "synthetic" if args.synthetic else "SmolLM2 logits": real,
        "flat (randn * 0.5)": torch.randn(rows, VOCAB, generator=g) * 0.5,
        "uniform": torch.zeros(rows, VOCAB),
    }
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    if args.clock == "cpu":
        torch.set_num_threads(1)
    step = decode_step_ms(64, clock) if args.step else None
    print(
        f"# Sampler, vocab {VOCAB} ({time.strftime('%Y-%m-%d %H:%M')}), {torch.get_num_threads()} threads, "
        f"{args.clock} clock"
    )
    print(machine_line(machine_info()))
    print(f"load average at start {os.getloadavg()[0]:.2f}")
    if step is not None:
        print(f"batch-64 decode step of the default model (greedy, median, {args.clock} clock): {step:.1f} ms")
    print()
    header = "| logits | setting | batch | old ms | new ms | old/new |" + (" new / step |" if step else "")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for dist_name, logits in distributions.items():
        for setting, params in SETTINGS.items():
            for batch in args.batches:
                x = logits[:batch].contiguous()
                md = metadata(params, batch)
                sampler = Sampler()

                def run_old() -> None:
                    with old_sampler():
                        sampler(x, md)

                calls = {"old": run_old, "new": lambda: sampler(x, md)}
                times = interleaved_ms(calls, args.rounds, clock)
                cells = [dist_name, setting, str(batch), f"{times['old']:.2f}", f"{times['new']:.2f}"]
                cells.append(f"{times['old'] / times['new']:.1f}x")
                if step is not None:
                    cells.append(f"{100 * times['new'] / step:.1f}%" if batch == 64 else "")
                print("| " + " | ".join(cells) + " |", flush=True)
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
