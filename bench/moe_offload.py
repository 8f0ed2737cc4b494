"""Expert offloading (engine/experts/): decode throughput against the fully resident
model, and what the expert caches did meanwhile.

    python bench/moe_offload.py --out bench/out/moe_offload.json    # the full run
    python bench/moe_offload.py --quick                             # tiny shapes: a smoke run
    python bench/moe_offload.py --regimes zipf --modes host --cache-sizes 2 8 --batches 1 32

Model: Mixtral-style (transformers' MixtralConfig), 8 experts top-2, hidden 1024, expert
MLP 1792, 8 layers, 4 heads of 256 / 2 KV heads, vocabulary 4096: 1.41 GB of routed experts
in fp32, 22 MB each. Random weights, saved once under bench/out/models/ in a folder named
after the shape: speed depends on the shapes and on which experts are routed, not on values.

Decode tok/s: B requests of 16 random token ids join at once (greedy, ignore_eos). The
engine step that prefills them (and samples each first token) is not timed; the clock and
the expert counters run over every later step until each request has N+1 tokens, so
tok/s = tokens those steps produced / their wall time, scheduling and sampling included.
Each engine and batch gets an untimed warm-up round, then R rounds: the fastest round's
tok/s, the counters summed over all R. The resident engine runs first and last in each
regime (kept loaded); ratios are to the mean of its two figures at the same batch.

Regimes. "random": routers as initialised, no locality (a cache's worst case). "zipf":
residual coordinate 0 is a constant (embedding column 0 = 5 x initializer_range; row 0 of
every o_proj and expert down_proj zeroed, so no layer writes it), which makes router column
0 a per-expert bias. Each layer ranks its experts by a seeded permutation; on calibration
prompts column 0 is set to give bias k * (log p_rank - mean) less the expert's mean logit
from the other columns, p_rank ~ rank^-1 and k = their logits' std over tokens x sqrt(6)/pi:
logits look like log p plus Gumbel-sized noise, so the first choice is about Zipf(1).
Both regimes' routed shares by rank (transformers, fresh prompts) are printed.

Stream or cache: at the largest batch (or --stream-batches) a 4-slot cache also runs with
expert_stream_threshold 0 (always stream through the two buffers) and 8 (never), beside
the default rule (on CPU: never stream; on CUDA: stream past the slot count).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import hashlib
import itertools
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import MixtralConfig, MixtralForCausalLM

from cadence import LLM, SamplingParams
from cadence.engine.engine_core import EngineCore
from cadence.engine.experts.offloaded import offloaded_stats
from cadence.engine.experts.stats import ExpertStats, ExpertStepStats
from cadence.engine.protocol import EngineCoreRequest
from common.machine import Contention, load_average_line, machine_info, machine_line
from common.random_llama import CACHE_DIR

# The sizes that differ between the full run and --quick (3 layers there, so two layers prefetch).
SHAPE: dict[str, Any] = dict(hidden_size=1024, intermediate_size=1792, num_hidden_layers=8, vocab_size=4096)
TINY: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, vocab_size=512)
COMMON: dict[str, Any] = dict(
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=1024,
    initializer_range=0.02,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
ZIPF_EXPONENT = 1.0
PROMPT_LEN = 16
BLOCK_SIZE = 16
_request_ids = itertools.count()


def model_folder(shape: dict[str, Any], regime: str) -> str:
    """A cache folder named by the main sizes and a digest of everything that shapes the
    checkpoint, so a changed shape or skew builds anew."""
    key = json.dumps({**shape, "regime": regime, "zipf": ZIPF_EXPONENT}, sort_keys=True)
    sizes = "-".join(f"{k[0]}{shape[k]}" for k in ("hidden_size", "intermediate_size", "num_hidden_layers"))
    name = f"mixtral-{sizes}-e{shape['num_local_experts']}-{regime}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"
    return os.path.join(CACHE_DIR, name)


def calibration_ids(vocab_size: int, seed: int) -> torch.Tensor:
    """8 prompts of 32 random token ids (ids 0-2 are the config's special tokens)."""
    return torch.randint(3, vocab_size, (8, 32), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def skew_routers(model: MixtralForCausalLM, ids: torch.Tensor) -> None:
    """The "zipf" regime's surgery (module docstring). Each router is set in a pre-hook
    during one forward pass, so a layer is calibrated on inputs already shaped by the
    skewed routing of the layers before it."""
    config = model.config
    model.model.embed_tokens.weight[:, 0] = 5 * config.initializer_range
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight[0] = 0
        layer.mlp.experts.down_proj[:, 0] = 0
    experts = config.num_local_experts
    log_p = -ZIPF_EXPONENT * torch.arange(1, experts + 1, dtype=torch.float32).log()
    log_p -= log_p.mean()
    ranks = torch.Generator().manual_seed(1)

    def calibrate(router: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0].reshape(-1, config.hidden_size).float()
        weight = router.get_parameter("weight")
        weight[:, 0] = 0
        rest = x @ weight.T  # [tokens, experts]: the logits without the bias column
        scale = rest.std(dim=0).mean() * math.sqrt(6) / math.pi  # Gumbel's std is pi / sqrt(6)
        bias = torch.empty(experts)
        bias[torch.randperm(experts, generator=ranks)] = scale * log_p  # expert perm[r] gets rank r + 1
        weight[:, 0] = (bias - rest.mean(dim=0)) / x[:, 0].mean()

    hooks = [layer.mlp.gate.register_forward_pre_hook(calibrate) for layer in model.model.layers]
    model(ids)
    for hook in hooks:
        hook.remove()


@torch.no_grad()
def routed_shares(model: MixtralForCausalLM, ids: torch.Tensor) -> list[float]:
    """Each layer's share of routed (token, expert) pairs per expert, sorted from the most
    routed down, averaged over layers."""
    counts: list[torch.Tensor] = []

    def record(router: torch.nn.Module, args: object, out: tuple[torch.Tensor, ...]) -> None:
        counts.append(torch.bincount(out[2].flatten(), minlength=model.config.num_local_experts).float())

    hooks = [layer.mlp.gate.register_forward_hook(record) for layer in model.model.layers]
    model(ids)
    for hook in hooks:
        hook.remove()
    shares = torch.stack([(c / c.sum()).sort(descending=True).values for c in counts]).mean(dim=0)
    return [round(v, 4) for v in shares.tolist()]


def build_model(shape: dict[str, Any], regime: str) -> tuple[str, dict[str, Any]]:
    """The regime's checkpoint (built once) and its routing.json: shares by rank, and the
    Zipf target where there is one."""
    path = model_folder(shape, regime)
    if not os.path.isfile(os.path.join(path, ".complete")):  # written last: a broken build is redone
        print(f"building random-weight MoE {os.path.basename(path)} (once) ...", flush=True)
        torch.manual_seed(0)
        model = MixtralForCausalLM(MixtralConfig(**shape)).eval()  # fp32: torch's default dtype
        if regime == "zipf":
            skew_routers(model, calibration_ids(shape["vocab_size"], seed=2))
        zipf = [r**-ZIPF_EXPONENT for r in range(1, shape["num_local_experts"] + 1)]
        routing = {
            "shares_by_rank": routed_shares(model, calibration_ids(shape["vocab_size"], seed=3)),
            "zipf_first_choice": [round(z / sum(zipf), 4) for z in zipf] if regime == "zipf" else None,
        }
        tmp = path + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, safe_serialization=True)
        with open(os.path.join(tmp, "routing.json"), "w", encoding="utf-8") as f:
            json.dump(routing, f)
        open(os.path.join(tmp, ".complete"), "w").close()
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        del model
        gc.collect()  # free the build's weights before the engines load theirs
    with open(os.path.join(path, "routing.json"), encoding="utf-8") as f:
        return path, json.load(f)


@dataclass(frozen=True)
class Config:
    mode: str  # "resident", "host" or "disk"
    cache: int | None = None  # slots per layer
    threshold: int | None = None  # expert_stream_threshold; None: the engine's default

    def label(self, experts: int) -> str:
        if self.mode == "resident":
            return "resident"
        rules = {None: "", 0: ", always stream", experts: ", never stream"}
        return f"{self.mode}, {self.cache} slots" + rules.get(self.threshold, f", stream > {self.threshold}")


@dataclass
class Row:
    regime: str
    config: str
    batch: int
    tok_s: float  # the fastest round's
    tokens: int  # decode tokens over all timed rounds
    other_cores: float  # mean cores other processes used meanwhile
    stats: dict[str, float] | None  # ExpertStepStats summed over the timed rounds, and its rates
    ratio: float = math.nan


def counters(stats: ExpertStats | None) -> ExpertStepStats:
    """A snapshot of the running totals, zero for a resident model."""
    return ExpertStepStats() if stats is None else stats.snapshot()


def make_llm(path: str, config: Config, args: argparse.Namespace) -> LLM:
    """An engine with KV for the largest batch at full length, and a token budget that
    prefills it in one step; no prefix cache, so every round's prefill is the same work."""
    max_len = PROMPT_LEN + args.decode_tokens + 8
    options: dict[str, object] = dict(
        dtype="float32",
        max_num_seqs=args.max_batch,
        max_num_batched_tokens=max(2048, args.max_batch * max_len),
        num_gpu_blocks=args.max_batch * -(-max_len // BLOCK_SIZE) + 4,
        block_size=BLOCK_SIZE,
        max_model_len=max_len,
        enable_prefix_caching=False,
    )
    if config.mode != "resident":
        options.update(expert_offload=config.mode, expert_cache_size=config.cache)
        options.update(expert_stream_threshold=config.threshold)
    return LLM(path, **options)


def decode_round(engine: EngineCore, prompts: list[list[int]], new_tokens: int) -> tuple[float, int, ExpertStepStats]:
    """Seconds and tokens of one batch's decode steps, and the expert counters' growth over
    them (zero for a resident model). The prefill step before them is not counted."""
    params = SamplingParams(max_tokens=new_tokens + 1, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(EngineCoreRequest(f"moe-{next(_request_ids)}", prompt, params))
    first = 0
    while first < len(prompts):  # every request's first token
        first += sum(len(o.new_token_ids) for o in engine.step())
    stats = offloaded_stats(engine.model)
    before, produced, start = counters(stats), 0, time.perf_counter()
    while engine.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    seconds = time.perf_counter() - start
    return seconds, produced, counters(stats).minus(before)


def measure(llm: LLM, regime: str, config: Config, batch: int, args: argparse.Namespace, warm_up: int = 2) -> Row:
    """One untimed warm-up round of ``warm_up`` tokens (a batch shape's first steps
    allocate), then the timed ones."""
    rng, vocab = random.Random(batch), llm.engine.vocab_size

    def prompts() -> list[list[int]]:
        return [[rng.randrange(3, vocab) for _ in range(PROMPT_LEN)] for _ in range(batch)]

    decode_round(llm.engine, prompts(), warm_up)
    best, tokens, total = math.inf, 0, ExpertStepStats()
    with Contention() as contention:
        for _ in range(args.rounds):
            seconds, produced, delta = decode_round(llm.engine, prompts(), args.decode_tokens)
            best, tokens, total = min(best, seconds / produced), tokens + produced, total.plus(delta)
    stats = None
    if config.mode != "resident":
        rates = dict(hit_rate=total.hit_rate, precision=total.prefetch_precision, recall=total.prefetch_recall)
        stats = {**dataclasses.asdict(total), **rates}
    row = Row(regime, config.label(args.experts), batch, 1 / best, tokens, contention.other_cores, stats)
    print(f"   {regime}: {row.config}, batch {batch}: {row.tok_s:.1f} tok/s", flush=True)
    return row


def run_config(path: str, regime: str, config: Config, batches: list[int], args: argparse.Namespace) -> list[Row]:
    """Load one engine, measure it at each batch, and free it before the next one loads."""
    start = time.perf_counter()
    llm = make_llm(path, config, args)
    print(f"  {config.label(args.experts)}: loaded in {time.perf_counter() - start:.1f}s", flush=True)
    rows = [measure(llm, regime, config, b, args) for b in batches]
    del llm
    gc.collect()
    return rows


def run_regime(regime: str, path: str, args: argparse.Namespace) -> list[Row]:
    """Resident first and last (one engine, kept loaded), every offloaded configuration in
    between; ratios to the mean of the two resident figures at the same batch."""
    resident = Config("resident")
    llm = make_llm(path, resident, args)
    # The first engine warms up at full length: kernels picked per shape (each context length
    # is one) are cached for the whole process, and the engines after it find them there.
    rows = [measure(llm, regime, resident, b, args, args.decode_tokens) for b in args.all_batches]
    half = args.experts // 2  # the stream/cache comparison's cache
    for mode in args.modes:
        for cache in args.cache_sizes:
            rows += run_config(path, regime, Config(mode, cache), args.batches, args)
        for threshold in (0, args.experts):
            rows += run_config(path, regime, Config(mode, half, threshold), args.stream_batches, args)
    again = [measure(llm, regime, resident, b, args) for b in args.all_batches]
    for row in again:
        row.config = "resident, again at the end"
    del llm
    gc.collect()
    base = {first.batch: (first.tok_s + last.tok_s) / 2 for first, last in zip(rows, again)}  # rows: resident first
    for row in rows + again:
        row.ratio = row.tok_s / base[row.batch]
    return rows + again


def table(rows: list[Row]) -> list[str]:
    lines = [
        "| regime | config | batch | tok/s | vs resident | hit rate | MB moved/token | prefetch P/R "
        "| stall s/token | experts/layer step | layer steps streamed/cached | other cores |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = ["-"] * 6
        if (s := r.stats) is not None:
            layer_steps = max(s["streamed_layers"] + s["cached_layers"], 1)
            cells = [
                f"{s['hit_rate']:.1%}",
                f"{s['load_bytes'] / 1e6 / r.tokens:.1f}",
                f"{s['precision']:.2f}/{s['recall']:.2f}",
                f"{s['stall_seconds'] / r.tokens:.4f}",
                f"{(s['hits'] + s['misses']) / layer_steps:.1f}",
                f"{s['streamed_layers']:.0f}/{s['cached_layers']:.0f}",
            ]
        lead = f"| {r.regime} | {r.config} | {r.batch} | {r.tok_s:.1f} | {r.ratio:.2f}x | "
        lines.append(lead + " | ".join(cells) + f" | {r.other_cores:.2f} |")
    return lines


LEGEND = [
    "hit rate: routed experts already in a slot when their layer ran (prefetched ones count); MB = 1e6 bytes",
    "copied into slots (prefetches included) per decode token; prefetch P/R: the share of experts predicted",
    "for a layer that it routed / of the experts routed in layers with a prediction, the share predicted",
    "(the prediction's quality: nothing is loaded ahead when the layer will stream or holds every expert);",
    "stall: seconds compute waited for loads (on CPU the copy thread's core time is not in it); experts/layer",
    "step: distinct experts routed per MoE layer per step; other cores: CPU other processes used meanwhile.",
    "disk maps the checkpoint: its pages come from the page cache (warm after loading), not from the device.",
]


def notes(rows: list[Row], args: argparse.Namespace) -> list[str]:
    """Streaming against caching at the comparison's cache, and resident figures that moved."""
    half, lines = args.experts // 2, []
    found = {(r.regime, r.config, r.batch): r for r in rows}
    for regime, mode, batch in itertools.product(args.regimes, args.modes, args.stream_batches):
        stream, cache = (found[(regime, Config(mode, half, t).label(args.experts), batch)] for t in (0, args.experts))
        default = found.get((regime, Config(mode, half).label(args.experts), batch))
        lines.append(
            f"- stream or cache: {regime}, {mode}, batch {batch}, {half} slots: always stream {stream.tok_s:.1f} "
            f"tok/s, never stream {cache.tok_s:.1f} tok/s, streaming {stream.tok_s / cache.tok_s:.2f}x caching"
            + (f"; the default rule {default.tok_s:.1f} tok/s" if default is not None else "")
        )
    for regime, batch in itertools.product(args.regimes, args.all_batches):
        start, end = (r for r in rows if r.regime == regime and r.batch == batch and r.config.startswith("resident"))
        if abs(end.tok_s / start.tok_s - 1) > 0.1:
            lines.append(f"- {regime}, batch {batch}: resident went from {start.tok_s:.1f} to {end.tok_s:.1f} tok/s")
            lines[-1] += " between the regime's start and end; its ratios carry that uncertainty"
    return lines


def commit() -> str:
    """The commit measured, marked when the tree differs from it (untracked files too)."""
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], capture_output=True, text=True, check=False, cwd=here).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + (" with uncommitted changes" if git("status", "--porcelain") else "")


def header(args: argparse.Namespace, argv: list[str]) -> list[str]:
    info, s = machine_info(), args.shape
    expert_mb = 3 * s["hidden_size"] * s["intermediate_size"] * 4 / 1e6
    experts_gb = expert_mb * s["num_local_experts"] * s["num_hidden_layers"] / 1e3
    return [
        f"# Expert offloading, decode ({datetime.datetime.now().isoformat(timespec='seconds')}, commit {commit()})",
        f"Command: python bench/moe_offload.py {' '.join(argv)}",
        f"{machine_line(info)}; transformers {info['transformers']}, Python {info['python']}",
        f"model: Mixtral-style, {s['num_local_experts']} experts top-{s['num_experts_per_tok']}, hidden "
        f"{s['hidden_size']}, expert MLP {s['intermediate_size']}, {s['num_hidden_layers']} layers, fp32: "
        f"{expert_mb:.1f} MB per expert, {experts_gb:.2f} GB of experts"
        + (" (--quick: the numbers mean nothing, this only exercises the script)" if args.quick else ""),
        f"{PROMPT_LEN}-token random prompts, {args.decode_tokens} timed decode tokens per request, "
        f"fastest of {args.rounds} round(s) after a warm-up; counters summed over the rounds",
    ]


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="concurrent requests")
    ap.add_argument("--cache-sizes", type=int, nargs="+", default=[2, 4, 6, 8], help="expert slots per layer")
    ap.add_argument("--modes", nargs="+", choices=["host", "disk"], default=["host", "disk"])
    ap.add_argument("--regimes", nargs="+", choices=["random", "zipf"], default=["random", "zipf"])
    ap.add_argument("--decode-tokens", type=int, help="timed tokens per request (default 32; 4 with --quick)")
    ap.add_argument("--rounds", type=int, help="timed rounds per engine and batch (default 2; 1 with --quick)")
    ap.add_argument("--stream-batches", type=int, nargs="+", help="the stream/cache comparison's (default: largest)")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's choice; 1 with --quick)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run of this script")
    ap.add_argument("--out", help="write the report's lines, the routing shares and every row here as JSON")
    args = ap.parse_args(argv)
    args.decode_tokens = args.decode_tokens or (4 if args.quick else 32)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.stream_batches = args.stream_batches or [max(args.batches)]
    args.all_batches = sorted(set(args.batches + args.stream_batches))
    args.max_batch = max(args.all_batches)
    args.threads = args.threads or (1 if args.quick else None)
    args.shape = {**COMMON, **(TINY if args.quick else SHAPE)}
    args.experts = args.shape["num_local_experts"]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads:
        # A thread per core stalls whenever another process takes a core of a shared machine,
        # and tiny shapes gain nothing from a second one.
        torch.set_num_threads(args.threads)
    lines, load_before = header(args, argv), os.getloadavg()
    print("\n".join(lines), flush=True)
    rows: list[Row] = []
    routing: dict[str, Any] = {}
    for regime in args.regimes:
        path, routing[regime] = build_model(args.shape, regime)
        print(f"== {regime}: routed shares by rank {routing[regime]['shares_by_rank']}", flush=True)
        rows += run_regime(regime, path, args)
    lines += [load_average_line(load_before, os.getloadavg()), "", *table(rows), "", *LEGEND, ""]
    for regime, r in routing.items():
        target = r["zipf_first_choice"]
        lines.append(f"- routing, {regime}: routed shares by rank (transformers, fresh prompts) {r['shares_by_rank']}")
        lines[-1] += f"; Zipf({ZIPF_EXPONENT:g}) first-choice target {target}" if target else ""
    lines += notes(rows, args)
    print("\n" + "=" * 100 + "\n" + "\n".join(lines))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(dict(report=lines, routing=routing, rows=[dataclasses.asdict(r) for r in rows]), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
