"""How many KV blocks an engine gets: from the user's choice, or from the machine's memory.

On CUDA the cache takes the GPU memory free after the weights; on CPU a share of the
machine's memory, from facts of the machine and the model rather than what is free now.
"""

from __future__ import annotations

import logging

import torch

from cadence.engine.engine_args import EngineArgs
from cadence.engine.machine_memory import GiB, available_host_memory, total_host_memory

logger = logging.getLogger(__name__)

# CPU: the share of the machine's memory, after the weights, that the KV caches of the
# engines on it take together.
HOST_KV_CACHE_FRACTION = 0.25


def kv_cache_bytes_per_block(args: EngineArgs, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one layer's K and V take per block: values, plus a float32 scale per row
    when the cache is quantized."""
    rows = 2 * args.block_size * num_kv_heads
    if args.kv_cache_dtype == "auto":
        return rows * head_dim * torch.empty((), dtype=dtype).element_size()
    return rows * (head_dim + 4)


def kv_cache_budget_bytes(args: EngineArgs, device: torch.device, weights_bytes: int) -> tuple[int, str]:
    """How many bytes the KV cache may take when neither blocks nor bytes were given, and why.

    On CUDA: the free memory left after loading weights, less the share that
    gpu_memory_utilization keeps back. On CPU: from facts of the machine and the model, never
    from what is free at the moment, so that a restart, or a start beside leftovers or other
    work, gets the same cache: `HOST_KV_CACHE_FRACTION` of the machine's memory
    (`total_host_memory`) less the weights of every engine on it (`weights_bytes` each), in
    equal shares between the `engines_per_host` engines. Together they never take more than
    the machine has, whether a cache is resident from the start (a prefill engine's
    shared-memory KV) or only as it is written (``host_memory.zeroed_pages``).
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = max(0, int(free - (1.0 - args.gpu_memory_utilization) * total))
        return budget, f"the GPU memory free after the weights, less {1.0 - args.gpu_memory_utilization:.0%} kept back"
    machine = total_host_memory()
    engines = args.engines_per_host
    budget = int(max(0, machine - engines * weights_bytes) * HOST_KV_CACHE_FRACTION) // engines
    why = (
        f"{HOST_KV_CACHE_FRACTION:.0%} of the machine's {machine / GiB:.1f} GiB after {_gib(weights_bytes)} of weights"
    )
    if engines > 1:
        why = f"{why} for each of {engines} engines, shared equally between them"
    return budget, why


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB"


def resolve_num_blocks(
    args: EngineArgs,
    device: torch.device,
    bytes_per_block: int,
    max_model_len: int,
    max_num_seqs: int,
    weights_bytes: int,
) -> int:
    """The number of KV blocks, from the user's choice or from memory (the model's weights
    take `weights_bytes` of host memory)."""
    blocks_per_seq = -(-max_model_len // args.block_size)
    if args.num_gpu_blocks is not None:
        num_blocks, why = args.num_gpu_blocks, "as num_gpu_blocks sets"
    elif args.kv_cache_memory is not None:
        num_blocks, why = args.kv_cache_memory // bytes_per_block, f"kv_cache_memory {_gib(args.kv_cache_memory)}"
    else:
        budget, why = kv_cache_budget_bytes(args, device, weights_bytes)
        # No more than the cache could ever use (every sequence at max_model_len, and one
        # spare sequence's worth that keeps freed prefixes for reuse): memory nobody can
        # use would only starve the next engine in the same process.
        useful = (max_num_seqs + 1) * blocks_per_seq * bytes_per_block
        if budget > useful:
            why = f"what {max_num_seqs + 1} sequences of {max_model_len} tokens can use, of {_gib(budget)} ({why})"
            budget = useful
        num_blocks = budget // bytes_per_block
        if device.type == "cpu":
            _warn_if_short(num_blocks * bytes_per_block)
    logger.info(
        "KV cache: %d blocks of %d tokens, %s: %s", num_blocks, args.block_size, _gib(num_blocks * bytes_per_block), why
    )
    if num_blocks < blocks_per_seq:
        raise ValueError(
            f"the KV cache has room for {num_blocks} blocks of {args.block_size} tokens, but one "
            f"sequence of max_model_len={max_model_len} needs {blocks_per_seq}; give more memory "
            "(num_gpu_blocks / kv_cache_memory) or lower max_model_len"
        )
    return num_blocks


def _warn_if_short(cache_bytes: int) -> None:
    """Say so when the cache exceeds the memory free now: its size stands (the same at
    every start), but a full cache may then push the machine into swap or the OOM killer."""
    available = available_host_memory()
    if cache_bytes > available:
        logger.warning(
            "KV cache: %s is more than the %s of memory available now; other work or what dead processes "
            "left holds the rest, and a full cache may not fit (kv_cache_memory chooses less)",
            _gib(cache_bytes),
            _gib(available),
        )
