"""KV transports head to head: one prompt's blocks read from an exporter in another process.

    python bench/kv_transport.py [--mib 64] [--loads 12] [--transports shared-memory tcp nixl]

The exporter (a prefill engine's transport) lives in a spawned process with random
caches; this process reads `--mib` of scattered blocks per load into its own caches, as a
decode engine does, and times `start_load` to the result. Shared memory is the baseline
in the same run: each line gives its median time and throughput, and the ratio of the
baseline's median to its own (above 1: faster than shared memory). Loopback only: across
hosts the link's bandwidth bounds tcp and nixl.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event

import torch

from cadence.engine.kv_transfer.factory import create_kv_transport
from cadence.engine.kv_transfer.layout import KVLayout
from cadence.engine.kv_transfer.source import KVSource
from cadence.scheduler.remote_kv import KVLoad

NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 8, 16, 8, 128
BLOCK_BYTES = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 4  # float32, keys and values
LAYOUT = KVLayout("bench", NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, "float32", "auto")


def make_caches(zeros, num_blocks: int) -> list[torch.Tensor]:
    shape = (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return [zeros(shape, torch.float32, torch.device("cpu")) for _ in range(NUM_LAYERS)]


def export(name: str, num_blocks: int, sources: Queue, done: Event) -> None:
    """The exporter process: random caches, exported until the reader is done."""
    transport = create_kv_transport(name, exporting=True)
    caches = make_caches(transport.zeros, num_blocks)
    for cache in caches:
        cache.normal_()
    sources.put(transport.export(caches, LAYOUT))
    done.wait(600)
    transport.close()


def time_loads(name: str, source: KVSource, num_blocks: int, load_blocks: int, loads: int) -> list[float]:
    reader = create_kv_transport(name, exporting=False)
    target = make_caches(reader.zeros, num_blocks)
    generator = torch.Generator().manual_seed(0)
    seconds = []
    try:
        for index in range(loads + 2):  # the first two warm up connections and mappings
            remote = torch.randperm(num_blocks, generator=generator)[:load_blocks].tolist()
            local = torch.randperm(num_blocks, generator=generator)[:load_blocks].tolist()
            start = time.perf_counter()
            reader.start_load(KVLoad(f"load-{index}", source, remote, local), target)
            results = reader.poll()
            while not results:
                time.sleep(0.0005)  # a decode engine polls between steps, not in a spin
                results = reader.poll()
            elapsed = time.perf_counter() - start
            (result,) = results
            if result.error is not None or result.num_blocks_loaded != load_blocks:
                raise RuntimeError(f"{name}: load failed: {result}")
            if index >= 2:
                seconds.append(elapsed)
    finally:
        reader.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64, help="MiB per load")
    parser.add_argument("--loads", type=int, default=12)
    parser.add_argument("--transports", nargs="+", default=["shared-memory", "tcp", "nixl"])
    args = parser.parse_args()
    load_blocks = max(1, args.mib * 2**20 // BLOCK_BYTES)
    num_blocks = 2 * load_blocks
    context = multiprocessing.get_context("spawn")
    baseline: float | None = None
    print(f"{load_blocks} blocks of {BLOCK_BYTES / 2**20:.2f} MiB per load, {args.loads} loads, medians")
    for name in args.transports:
        if name == "nixl":
            try:
                import nixl_cu12  # noqa: F401
            except ImportError:
                print("nixl           not installed (pip install --no-deps nixl-cu12==1.5.1)")
                continue
        sources: Queue = context.Queue()
        done = context.Event()
        exporter = context.Process(target=export, args=(name, num_blocks, sources, done), daemon=True)
        exporter.start()
        try:
            seconds = time_loads(name, sources.get(timeout=120), num_blocks, load_blocks, args.loads)
        finally:
            done.set()
            exporter.join(30)
        median = statistics.median(seconds)
        baseline = baseline if baseline is not None else median
        rate = load_blocks * BLOCK_BYTES / median / 1e9
        print(f"{name:14s} {median * 1e3:7.1f} ms  {rate:5.2f} GB/s  x{baseline / median:.2f} vs {args.transports[0]}")


if __name__ == "__main__":
    main()
