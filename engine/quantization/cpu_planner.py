"""Choosing each quantized layer's CPU kernels by measuring them on the machine that serves.

Which of ``packed``, ``dequant``, ``dense``, ``fp16``, ``bf16``, ``bf16dot``, ``int8x2dot``
and ``int8dot`` (``cpu_kernels.py``) is fastest depends on the CPU (AMX, AVX512-BF16, plain AVX2), the
layer's shape and the batch size, in ways no rule of thumb captured. After loading, layers
are grouped by format and shape; each group's kernels are timed at the batch sizes of
``BUCKETS`` on the group's own layers, in turn, so the weights stream from memory as they
do in a real step. The times are cached on disk, keyed by CPU model, ISA flags, torch
version and thread count, so later starts skip them.

``--cpu-kernels`` (``EngineArgs.cpu_kernels``):

* ``auto`` (default): one kernel family for the rows of generated tokens, the one that
  is fastest across the batch sizes of decode steps (``GENERATED_BUCKETS``), each weighed
  against the best time of all the planned layers at that size; and for a decoder
  projection, one for the rows of prompt tokens, the fastest at prefill sizes
  (``PROMPT_BUCKETS``) on the group's own times, where the two differ
  (``prompt_rows.py``). A row's kernel follows from what its token is, never from its
  batch, so greedy decoding stays batch invariant; within the dense family, a kept dense
  copy where memory allows. Among the choices, besides the kernels that keep activations
  at bf16 or finer, are those whose arithmetic is the weight format's own
  (``QuantizedMethod.format_kernels``): a GGUF's Q4_0/Q4_1 blocks get ``int8dot``, the
  8-bit activations per block of 32 that llama.cpp, the format's reference, computes them
  with.
* ``precise``: ``auto`` without the format's own kernels: activations are never rounded
  coarser than bf16 (``int8dot`` moves the default model's perplexity by about 0.5% and
  some greedy tokens; bench/RESULTS.md).
* ``throughput``: one kernel family per layer for every row, ranked on batched steps only
  (M of ``THROUGHPUT_MIN_BATCH`` and up): for a server that is rarely at batch 1. Batch
  invariant too; a batch-1 step may be slower than under ``auto``.
* ``fastest``: the fastest kernel at each batch size, even if that mixes numerics.
* ``packed``, ``dequant``, ``dense``, ``fp16``, ``bf16``, ``bf16dot``, ``int8x2dot``, ``int8dot``:
  that kernel everywhere it runs (its copy regardless of memory), and ``precise``'s choice
  for a group that does not run it (the int8 LM head under an int4 kernel). The integer kernels
  (``OPT_IN_KERNELS``) run only so, or as a format's own: ``int8dot``'s 8-bit activations
  change some greedy tokens, and ``int8x2dot`` is for batch-1 latency, not a served
  step's batches.
* a path to a ``.json`` file: ``auto``, with the times read from and saved to that file.

A kept copy (``dense``'s fp32 chunks, the half and integer kernels' packed ones) is made only
while all of them fit in ``DENSE_MEMORY_FRACTION`` of the memory available after loading:
a quantized model that would not fit dense stays quantized. ``fp16`` is offered with fp32
activations on builds with fbgemm, ``bf16`` with fp32 activations on CPUs with native
bf16, the integer kernels for int4 weights with fp32 activations on CPUs with AVX2; a group
whose weights overflow fp16, or whose shape no tile size keeps invariant, is not offered
that kernel.
"""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from cadence.engine.engine_args import available_host_memory
from cadence.engine.quantization.cpu_kernel_table import (
    KernelTable,
    default_table_path,
)
from cadence.engine.quantization.cpu_kernels import (
    BUCKETS,
    DENSE,
    DEQUANT,
    HALF_KERNELS,
    HELD_KERNELS,
    INT8DOT,
    INT8X2DOT,
    INT_DOT_LEVELS,
    KERNELS,
    PACKED,
    KernelPlan,
)
from cadence.engine.quantization.linear import QuantizedMethod, dense_bytes
from cadence.engine.quantization.method import LinearLayer
from cadence.kernels import int8_dot
from cadence.kernels.half_linear import FORMATS, available

logger = logging.getLogger(__name__)

PRECISE = "precise"
CPU_KERNEL_MODES = ("auto", PRECISE, "throughput", "fastest", *KERNELS)
# ``throughput`` ranks kernels as ``auto`` does, on the batch sizes from this one up only.
THROUGHPUT_MIN_BATCH = 16
BATCHED_BUCKETS = tuple(m for m in BUCKETS if m >= THROUGHPUT_MIN_BATCH)
# What ``auto`` ranks the kernel of generated tokens' rows on (decode steps, batch 1 to a
# full server's 256) and, for decoder projections, that of prompt tokens' rows (prefill chunks).
GENERATED_BUCKETS = BUCKETS
PROMPT_BUCKETS = (64, 256)
# Kernels that run only where ``--cpu-kernels`` names them, or (int8dot) where they are
# the weight format's own arithmetic (bench/RESULTS.md has why): int8dot's one int8 level
# of activations per block, as llama.cpp's, changes some greedy tokens, which is a
# format's own numerics for GGUF's 4-bit blocks and a trade no mode makes for others;
# int8x2dot wins batch 1 by its 4-bit codes but loses from batch 16 on CPUs without
# AVX-512, where a served step's rows are, while auto's ranking over every batch size
# would choose it.
OPT_IN_KERNELS = (INT8X2DOT, INT8DOT)
DENSE_MEMORY_FRACTION = 0.25  # the KV cache takes a quarter of what is left after this
MIN_CORE_SHARE = 0.6  # below this share of the cores while measuring, the times are not saved
# Each (kernel, M) cell is timed over the group's layers in turn until _CELL_SECONDS have
# passed and _MIN_CALLS calls were made (two calls, once _CELL_CAP_SECONDS are spent), at
# most two passes (or _MAX_CALLS_FLOOR calls). The fastest call counts: other work on the
# machine only ever adds time, and every layer in the turn is as cold as the next.
_CELL_SECONDS = 0.03
_CELL_CAP_SECONDS = 0.25
_MIN_CALLS = 3
_MAX_CALLS_FLOOR = 10  # a group of few layers still gets this many tries at a quiet moment


def validate_cpu_kernels(mode: str) -> str:
    """A mode name, or a path to a .json table whose folder exists; ValueError otherwise."""
    if mode in CPU_KERNEL_MODES:
        return mode
    folder = os.path.dirname(os.path.abspath(os.path.expanduser(mode)))
    if not mode.endswith(".json") or not os.path.isdir(folder):
        raise ValueError(
            f"cpu_kernels must be one of {', '.join(CPU_KERNEL_MODES)} or a .json table path "
            f"in an existing folder, got {mode!r}"
        )
    return os.path.abspath(os.path.expanduser(mode))


@dataclass
class LayerGroup:
    """Layers of one format and shape: they get the same measurement and the same plan."""

    key: str
    method: QuantizedMethod
    layers: list[LinearLayer]
    kernels: tuple[str, ...]

    @property
    def token_rows(self) -> bool:
        """Whether the layers take the step's token rows, so prompt rows may get their own kernel."""
        return all(layer.token_rows for layer in self.layers)

    @property
    def format_kernels(self) -> tuple[str, ...]:
        """The group's kernels whose arithmetic is its weight format's own (``auto`` may choose them)."""
        return tuple(k for k in self.method.format_kernels if k in self.kernels)

    def held_bytes(self, kernel: str, dtype: torch.dtype) -> int:
        """The memory ``kernel``'s kept copies take for the whole group (packed half copies
        are padded to their GEMM's blocks)."""
        layer = self.layers[0]
        if kernel in INT_DOT_LEVELS:
            return len(self.layers) * int8_dot.packed_bytes(layer.out_features, layer.in_features)
        if kernel not in HALF_KERNELS:
            return len(self.layers) * dense_bytes(layer, dtype)
        bounds = self.method.chunk_bounds(layer)
        packed_bytes = FORMATS[kernel].packed_bytes
        return len(self.layers) * sum(packed_bytes(stop - start, layer.in_features) for start, stop in bounds)

    def hold(self, kernel: str, dtype: torch.dtype) -> None:
        for layer in self.layers:
            if kernel in HALF_KERNELS:
                self.method.hold_half(layer, kernel)
            elif kernel in INT_DOT_LEVELS:
                self.method.hold_int_dot(layer, kernel)
            else:
                self.method.hold_dense(layer, dtype)

    def drop(self, kernel: str) -> None:
        for layer in self.layers:
            if kernel in HALF_KERNELS:
                self.method.drop_half(layer, kernel)
            elif kernel in INT_DOT_LEVELS:
                self.method.drop_int_dot(layer, kernel)
            else:
                self.method.drop_dense(layer)


def layer_groups(modules: Iterable[nn.Module], dtype: torch.dtype, mode: str = "auto") -> list[LayerGroup]:
    """The model's CPU-quantized layers that have a choice of kernels, grouped by format and
    shape. An ``OPT_IN_KERNELS`` kernel is among the choices only where ``mode`` names it,
    or where it is the layer's format's own and ``mode`` ranks kernels (not ``precise``)."""
    members: dict[tuple[str, int, int, int | None, bool, bool], LayerGroup] = {}
    for module in modules:
        if not isinstance(module, LinearLayer) or not isinstance(module.method, QuantizedMethod):
            continue
        kernels = module.method.cpu_kernels(module)
        own_format = module.method.format_kernels if mode != PRECISE and mode not in KERNELS else ()
        # The half and integer kernels take fp32 activations, and run where their GEMM does;
        # no kernel keeps a copy of weights that a load replaces (an offloaded expert's slot).
        kernels = tuple(
            k
            for k in kernels
            if (k not in OPT_IN_KERNELS or k == mode or k in own_format)  # first: asking the hardware compiles
            and (k not in HELD_KERNELS or module.weights_fixed)
            and (k not in HALF_KERNELS or (dtype == torch.float32 and available(FORMATS[k])))
            and (k not in INT_DOT_LEVELS or (dtype == torch.float32 and int8_dot.hardware_ready()))
        )
        if len(kernels) > 1:
            fmt = type(module.method).__name__.removesuffix("Method").lower()
            shape = (fmt, module.out_features, module.in_features, getattr(module, "cpu_group_size", None))
            key = (*shape, module.token_rows, module.weights_fixed)
            members.setdefault(key, LayerGroup("", module.method, [], kernels)).layers.append(module)
    for (fmt, n, k, group_size, *_), entry in members.items():
        group = "" if group_size is None else f" g{group_size}"
        entry.key = f"{fmt} {n}x{k}{group} {str(dtype).removeprefix('torch.')} x{len(entry.layers)}"
    return list(members.values())


def time_cell(group: LayerGroup, kernel: str, m: int, dtype: torch.dtype) -> float:
    """Microseconds of one layer's call at M = ``m``: the fastest of a few calls over the
    group's layers in turn (the first call of a cell also sets up the kernel)."""
    x = torch.randn(m, group.layers[0].in_features).to(dtype)
    limit = max(2 * len(group.layers), _MAX_CALLS_FLOOR)
    times: list[float] = []
    spent = 0.0
    while len(times) < limit:
        layer = group.layers[len(times) % len(group.layers)]
        start = time.perf_counter()
        group.method.run_cpu_kernel(layer, x, kernel)
        elapsed = time.perf_counter() - start
        times.append(elapsed)
        spent += elapsed
        if (len(times) >= _MIN_CALLS and spent >= _CELL_SECONDS) or (len(times) >= 2 and spent >= _CELL_CAP_SECONDS):
            break
    return min(times) * 1e6


def candidates(times: dict[str, list[float]], affordable: set[str]) -> list[str]:
    """The kernels ``auto`` and ``fastest`` choose among: ``packed``, the dense family
    (``dense`` where its copy fits, else ``dequant``: the same bits, no copy), and the half
    and integer kernels whose copies fit (the integer ones timed only where the mode names
    them or they are the format's own)."""
    dense_family = DENSE if DENSE in affordable and DENSE in times else DEQUANT
    held = [k for k in (*HALF_KERNELS, *INT_DOT_LEVELS) if k in affordable]
    return [k for k in (PACKED, dense_family, *held) if k in times]


def choose(
    times: dict[str, list[float]],
    mode: str,
    affordable: set[str],
    model_best: list[float] | None = None,
    token_rows: bool = False,
    format_kernels: tuple[str, ...] = (),
) -> KernelPlan:
    """The plan from measured µs per bucket. A ranking takes the one kernel with the least
    mean over its batch sizes of time / ``model_best`` (the whole model's best linear time
    at that size among the finer kernels, so a group weighs by its share of the step; this
    group's own best without it). ``auto`` ranks on ``GENERATED_BUCKETS``, and where the
    layers take the step's ``token_rows``, gives prompt rows the winner on
    ``PROMPT_BUCKETS`` (relative to this group's own best) if it differs; ``throughput``
    ranks on the batch sizes from ``THROUGHPUT_MIN_BATCH`` up.

    A kernel among ``format_kernels`` (coarser arithmetic, the weight format's own) is
    weighed against what ``precise`` chooses without it, on the same scale: it replaces
    that choice where it ranks better, and for generated tokens only where it is also no
    slower at every batch size from ``THROUGHPUT_MIN_BATCH`` up (a kernel that wins small
    batches alone would trade a server's throughput for batch-1 latency, and numerics
    with it)."""
    if mode in KERNELS:
        return KernelPlan.fixed(mode)
    names = candidates(times, affordable)
    if mode == "fastest":
        return KernelPlan(tuple(min(names, key=lambda k: times[k][i]) for i in range(len(BUCKETS))))
    finer = [k for k in names if k not in format_kernels] or names
    own_best = [min(times[k][i] for k in finer) for i in range(len(BUCKETS))]

    def score(kernel: str, sizes: tuple[int, ...], scale: list[float]) -> float:
        return sum(times[kernel][BUCKETS.index(m)] / scale[BUCKETS.index(m)] for m in sizes)

    def best_on(sizes: tuple[int, ...], scale: list[float], batched: bool = False) -> str:
        """The finer kernels' winner, unless a format kernel ranks better (and, with
        ``batched``, is no slower than it at any batched size)."""
        best = min(finer, key=lambda k: score(k, sizes, scale))
        for kernel in (k for k in names if k not in finer):
            better = score(kernel, sizes, scale) < score(best, sizes, scale)
            slower = any(times[kernel][BUCKETS.index(m)] > times[best][BUCKETS.index(m)] for m in BATCHED_BUCKETS)
            if better and not (batched and slower):
                best = kernel
        return best

    scale = model_best or own_best
    if mode == "throughput":
        return KernelPlan.fixed(best_on(BATCHED_BUCKETS, scale))
    generated = best_on(GENERATED_BUCKETS, scale, batched=True)
    # Prefill sizes only: the group's own times decide, so the choice does not move with
    # what else the model plans (an offloaded MoE plans fewer expert layers than a resident one).
    prompt = best_on(PROMPT_BUCKETS, own_best) if token_rows else generated
    return KernelPlan.fixed(generated) if prompt == generated else KernelPlan.fixed(generated).with_prompt(prompt)


def model_best_times(measured: list[tuple[LayerGroup, dict[str, list[float]], set[str]]]) -> list[float] | None:
    """µs per bucket of every measured group's fastest finer candidate (not its format's
    own kernels), times its layer count: the best time of all the layers with a choice of
    kernels as ``precise`` would plan them (what ``auto`` weighs a group by)."""
    best = [0.0] * len(BUCKETS)
    for group, times, affordable in measured:
        names = candidates(times, affordable)
        names = [k for k in names if k not in group.format_kernels] or names
        if not names:
            return None
        for i in range(len(BUCKETS)):
            best[i] += len(group.layers) * min(times[k][i] for k in names)
    return best


def plan_cpu_kernels(modules: Iterable[nn.Module], dtype: torch.dtype, mode: str = "auto") -> None:
    """Give every CPU-quantized layer among ``modules`` (activations in ``dtype``) its ``KernelPlan``,
    keeping the copies its kernels read (dense, the half and integer kernels'), and log what was chosen and why."""
    mode = validate_cpu_kernels(mode)
    groups = layer_groups(modules, dtype, mode)
    if not groups:
        return
    measuring = any(_group_mode(mode, group) not in KERNELS for group in groups)
    table = KernelTable(mode if mode.endswith(".json") else default_table_path()) if measuring else None
    budget = int(available_host_memory() * DENSE_MEMORY_FRACTION)
    clock = _MeasuringClock()
    measured: list[tuple[LayerGroup, dict[str, list[float]], set[str]]] = []
    for group in groups:
        own = _group_mode(mode, group)
        fixed = own in KERNELS
        times = {} if table is None or fixed else table.times(group.key, group.kernels)
        # A fixed mode keeps its kernel's copy whatever the memory; otherwise only within the budget.
        affordable = {
            k
            for k in HELD_KERNELS
            if k in group.kernels and (own == k or (not fixed and group.held_bytes(k, dtype) <= budget))
        }
        unaffordable = set(HELD_KERNELS) - affordable
        missing = [] if fixed else [k for k in group.kernels if k not in times and k not in unaffordable]
        for kernel in missing:
            if kernel in HELD_KERNELS and not _try_hold(group, kernel, dtype, affordable):
                continue
            with clock:
                times[kernel] = [round(time_cell(group, kernel, m, dtype), 1) for m in BUCKETS]
            if table is not None:
                table.record(group.key, kernel, times[kernel])
            if kernel in HELD_KERNELS:
                group.drop(kernel)  # made again below if chosen: two copies at once may not fit
        measured.append((group, times, affordable))
    model_best = model_best_times(measured)
    for group, times, affordable in measured:
        own = _group_mode(mode, group)
        fixed = own in KERNELS
        choice = own if own in ("throughput", "fastest", *KERNELS) else "auto"
        # Copies already kept for earlier groups leave less for this one.
        affordable -= {k for k in HELD_KERNELS if own != k and group.held_bytes(k, dtype) > budget}
        plan = _settle_plan(group, times, choice, affordable, model_best, None if fixed else budget, dtype)
        held = sum(group.held_bytes(k, dtype) for k in _held(plan))
        budget -= held
        for layer in group.layers:
            layer.cpu_plan = plan
        short_of_memory = not fixed and any(k in group.kernels and k not in affordable for k in HELD_KERNELS)
        _log_choice(group, plan, times, held, short_of_memory)
    if table is None or not clock.cells:
        return
    share = clock.core_share()
    if share < MIN_CORE_SHARE:
        logger.warning(
            "the machine was busy while measuring CPU kernels (this process had %.0f%% of its cores): "
            "the choices stand for this run, but the times are not saved",
            100 * share,
        )
        return
    table.save()
    logger.info(
        "timed %d CPU kernels at %d batch sizes in %.1f s (cached in %s)",
        clock.cells,
        len(BUCKETS),
        clock.wall,
        table.path,
    )


def _group_mode(mode: str, group: LayerGroup) -> str:
    """A kernel named for the whole model serves every group that runs it; a group that
    does not (the int8 LM head under an int4 kernel, say) gets what auto would give it
    among the kernels it was offered: no format's own (``layer_groups``), as ``precise``."""
    return mode if mode not in KERNELS or mode in group.kernels else "auto"


def _settle_plan(
    group: LayerGroup,
    times: dict[str, list[float]],
    choice: str,
    affordable: set[str],
    model_best: list[float] | None,
    budget: int | None,
    dtype: torch.dtype,
) -> KernelPlan:
    """The group's plan, its copies made: chosen, narrowed until the copies it reads fit
    ``budget`` together (None: no limit), and chosen again whenever the weights refuse a
    copy (``_try_hold``). Copies made for a plan given up are dropped."""
    while True:
        plan = _runnable(group, choose(times, choice, affordable, model_best, group.token_rows, group.format_kernels))
        # A mixed plan (``fastest``, or prompt rows apart) may read several copies: together they must fit too.
        while budget is not None and sum(group.held_bytes(k, dtype) for k in _held(plan)) > budget:
            affordable.discard(max(_held(plan), key=lambda k: group.held_bytes(k, dtype)))
            plan = _runnable(
                group, choose(times, choice, affordable, model_best, group.token_rows, group.format_kernels)
            )
        if all(_try_hold(group, k, dtype, affordable) for k in _held(plan)):
            break
    for kernel in HELD_KERNELS:
        if kernel not in plan.all_kernels:
            group.drop(kernel)
    return plan


def _held(plan: KernelPlan) -> list[str]:
    """The kernels of ``plan`` that read a kept copy."""
    return [k for k in HELD_KERNELS if k in plan.all_kernels]


def _runnable(group: LayerGroup, plan: KernelPlan) -> KernelPlan:
    if plan.all_kernels <= set(group.kernels):
        return plan
    logger.warning("%s does not run %s on CPU; it runs %s", group.key, plan.describe(), group.kernels[0])
    return KernelPlan.fixed(group.kernels[0])


def _try_hold(group: LayerGroup, kernel: str, dtype: torch.dtype, affordable: set[str]) -> bool:
    """Make the group's copies for ``kernel``; where its weights cannot take it (a half
    kernel: values beyond fp16's range, or no invariant tiling), the kernel leaves the
    group's choices."""
    try:
        group.hold(kernel, dtype)
    except (ValueError, RuntimeError) as exc:
        group.drop(kernel)
        group.kernels = tuple(k for k in group.kernels if k != kernel)
        affordable.discard(kernel)
        logger.info("CPU kernels for %s: no %s (%s)", group.key, kernel, exc)
        return False
    return True


class _MeasuringClock:
    """Wall and process CPU time spent timing kernels, and how many kernels were timed.

    The share of the cores our threads had meanwhile tells whether other work on the
    machine took them: times measured then would be kept for every later start."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self.cells = 0

    def __enter__(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def __exit__(self, *exc: object) -> None:
        self.wall += time.perf_counter() - self._wall
        self.cpu += time.process_time() - self._cpu
        self.cells += 1

    def core_share(self) -> float:
        cores = min(torch.get_num_threads(), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
        return self.cpu / max(self.wall * max(cores, 1), 1e-9)


def _log_choice(
    group: LayerGroup, plan: KernelPlan, times: dict[str, list[float]], held: int, short_of_memory: bool
) -> None:
    measured = "; ".join(f"{k} {'/'.join(f'{t:.0f}' for t in v)}" for k, v in times.items())
    why = f"µs per call at M={'/'.join(map(str, BUCKETS))}: {measured}" if measured else "fixed by --cpu-kernels"
    memory = (
        f", kept copies {held / 2**20:.0f} MiB" if held else (", no memory for kept copies" if short_of_memory else "")
    )
    invariant = "batch-invariant" if plan.batch_invariant else "not batch-invariant"
    logger.info("CPU kernels for %s: %s (%s%s; %s)", group.key, plan.describe(), invariant, memory, why)


def splits_prompt_rows(modules: Iterable[nn.Module]) -> bool:
    """Whether some layer runs prompt tokens' rows on a kernel of its own: then a token's K/V
    depends on which tokens before it were prompt tokens, and prefix-cache keys say so."""
    return any(isinstance(m, LinearLayer) and m.cpu_plan is not None and m.cpu_plan.prompt for m in modules)


def group_summary(modules: Iterable[nn.Module]) -> dict[str, int]:
    """How many layers run each plan (for tests and reports)."""
    counts: dict[str, int] = defaultdict(int)
    for module in modules:
        if isinstance(module, LinearLayer) and module.cpu_plan is not None:
            counts[module.cpu_plan.describe()] += 1
    return dict(counts)
