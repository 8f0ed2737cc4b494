"""What EngineCore is built from, apart from the loop: the generation EOS ids, the
default step token budget, and the KV connector's halves and layout for a role."""

from __future__ import annotations

import json
import os

import torch

from cadence.engine.attention.backend import AttentionSpec
from cadence.engine.engine_args import EngineArgs
from cadence.engine.kv_connector.scheduler_side import SchedulerSideConnector
from cadence.engine.kv_connector.worker_side import WorkerSideConnector
from cadence.engine.kv_transfer.factory import create_kv_transport
from cadence.engine.kv_transfer.layout import KVLayout, weights_digest
from cadence.engine.model_config import ModelConfig


def generation_eos_ids(model_path: str, config: ModelConfig) -> set[int]:
    """EOS ids from config.json and, when present, generation_config.json."""
    eos = set(config.eos_token_id)
    path = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            value = json.load(f).get("eos_token_id")
        eos.update([value] if isinstance(value, int) else value or [])
    return eos


def default_token_budget(device: torch.device) -> int:
    """A step's tokens when the user sets none. On CPU the linears run in tiles of at most
    128 rows, so a bigger step gains no GEMM speed and only holds every prompt of it back
    for the whole step: 1024 beat 512 and 2048 on both concurrencies of bench/vs_peers.py
    (bench/RESULTS.md). On GPU a big step keeps the device busy."""
    return 1024 if device.type == "cpu" else 2048


def kv_connectors(args: EngineArgs) -> tuple[WorkerSideConnector | None, SchedulerSideConnector | None]:
    """The runner's and the scheduler's halves of the KV connector. Prompt KV crosses
    engines only in a disaggregation role: a colocated engine has no connector."""
    if args.kv_role == "colocated":
        return None, None
    transport = create_kv_transport(args.kv_transport, exporting=args.kv_role == "prefill", host=args.kv_host)
    return WorkerSideConnector(transport), SchedulerSideConnector(args.kv_wait_timeout, args.kv_hold_timeout)


def kv_layout_of(
    args: EngineArgs, config: ModelConfig, spec: AttentionSpec, dtype: torch.dtype, precision: str
) -> KVLayout:
    """What another engine must match to read this engine's KV blocks."""
    return KVLayout(
        model=weights_digest(args.model),
        num_layers=config.num_hidden_layers,
        block_size=args.block_size,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        dtype=str(dtype).removeprefix("torch."),
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization or "none",
        precision=precision,
    )
