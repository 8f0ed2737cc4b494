"""What a user chooses when starting an engine (the KV cache's size: engine/kv_cache_size.py).

`engine_args_for` is the one front door: `cadence serve [MODEL] --flags` and
`LLM(model, **options)` both turn the user's model argument and options into EngineArgs
through it, so the server and the offline API load the same model the same way.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from cadence.engine.experts.options import ExpertOffloadOptions

if TYPE_CHECKING:
    import torch


@dataclass
class EngineArgs:
    """Engine options, with vLLM's names (`num_gpu_blocks` counts blocks on any device)."""

    model: str
    # Where a .gguf model (the default model is one) is converted once and cached; None
    # is ~/.cache/cadence. vLLM's name for its weights cache.
    download_dir: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    # The most tokens of one prompt a step computes (0: the whole budget), as vLLM's flag:
    # a long prompt then shares steps with the running streams instead of stalling them.
    long_prefill_token_threshold: int = 0
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes
    gpu_memory_utilization: float = 0.9
    # How many CPU engines share one machine's memory for their KV caches: the server
    # sets it for the prefill and decode engines it runs beside itself.
    engines_per_host: int = 1
    seed: int = 0
    attention_backend: str = "auto"  # auto (Triton on CUDA, torch elsewhere), torch or triton
    # Quantization applied while loading a dense checkpoint: None, "int8" (weight-only,
    # per output channel), "int4" (weight-only, groups of 128 along K, symmetric) or
    # "fp8" (W8A8: e4m3 weights per output channel, activations per token at run time).
    quantization: str | None = None
    # The LM head (and a tied embedding) as int8 per vocabulary row: True, False, or None
    # for "as the checkpoint has it": int8 under quantization="gguf" when the file stores
    # the head quantized, dense otherwise.
    quantize_lm_head: bool | None = None
    # The KV cache's storage: "auto" (the model's dtype), or "int8" / "fp8" with a scale
    # per token and KV head, which holds about 2-4x more tokens in the same memory.
    kv_cache_dtype: str = "auto"
    # Decode steps replay CUDA graphs on a GPU (engine/cuda_graphs.py); True launches
    # every kernel from Python instead, as vLLM's flag of the same name does.
    enforce_eager: bool = False
    # CPU: the kernel quantized layers run (engine/quantization/cpu_planner.py): "auto"
    # takes it by rule from the weight format and the instruction set, a kernel's name
    # runs that one wherever it can.
    cpu_kernels: str = "auto"
    # Greedy tokens independent of the batch a request runs in (engine/batch_invariant.py):
    # on CUDA every linear and attention kernel keeps one configuration for every batch,
    # at a cost in speed. CPU paths are batch invariant already under cpu_kernels="auto".
    batch_invariant: bool = False
    # Prefill/decode disaggregation (engine/kv_transfer/). "colocated" serves requests
    # whole; "prefill" also computes prompts for other engines and holds the KV for them
    # to read; "decode" also takes requests whose prompt KV it loads from a prefill engine.
    kv_role: str = "colocated"
    kv_transport: str = "in-process"  # how a decode engine reads a prefill engine's blocks
    # kv_transport="tcp": the address an exporting (prefill) engine binds and advertises
    # for KV reads over TCP (an address, host name or interface); its readers must reach it.
    kv_host: str = "127.0.0.1"
    # Seconds a decode engine waits for a parked prompt's KV before computing it itself,
    # and a prefill engine holds computed KV for a reader that never says it is done.
    kv_wait_timeout: float = 30.0
    kv_hold_timeout: float = 60.0
    # Seconds a request's grammar (structured outputs) may take to compile, counted from
    # when its compile starts, before the request fails with an error. Compiles run beside
    # the engine loop, so unconstrained requests and those whose grammar is ready go on;
    # a request whose grammar is new waits for a compile thread behind any others.
    structured_outputs_compile_timeout: float = 10.0
    # Mixture-of-experts models (engine/experts/): keep the routed experts in host memory
    # ("host") or memory-mapped files ("disk") with `expert_cache_size` slots per layer in
    # fast memory (None: twice the experts per token), evicting by `expert_cache_policy`
    # (lru or lfu); the next layer's experts are predicted and loaded ahead
    # (`expert_prefetch`); a step routing more distinct experts than
    # `expert_stream_threshold` (None: never on CPU, the slots on CUDA) streams them
    # through two buffers; on
    # CUDA, `expert_cpu_compute` runs a cold expert with few tokens on the CPU instead.
    expert_offload: str = "none"
    expert_cache_size: int | None = None
    expert_cache_policy: str = "lru"
    expert_prefetch: bool = True
    expert_stream_threshold: int | None = None
    expert_cpu_compute: bool = False

    def __post_init__(self) -> None:
        # Imported here so building EngineArgs (the CLI does, early) stays light.
        from cadence.engine.quantization.load_time_config import validate_quantization
        from cadence.kernels.formats.kv_quant import KV_CACHE_DTYPES

        self.quantization = validate_quantization(self.quantization)
        from cadence.kernels.cpu.kernel_names import validate_cpu_kernels

        self.cpu_kernels = validate_cpu_kernels(self.cpu_kernels)
        if self.quantize_lm_head is not None and not isinstance(self.quantize_lm_head, bool):
            raise ValueError(f"quantize_lm_head must be True, False or None, got {self.quantize_lm_head!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"unknown kv_role {self.kv_role!r}; use {', '.join(KV_ROLES)}")
        from cadence.engine.kv_transfer.factory import validate_kv_transport

        validate_kv_transport(self.kv_transport)
        # That a prefill engine holds longer than its decode engines wait is checked where
        # both are known, when the router admits them.
        if not (self.kv_wait_timeout > 0 and self.kv_hold_timeout > 0):
            raise ValueError("kv_wait_timeout and kv_hold_timeout must be positive seconds")
        if not self.structured_outputs_compile_timeout > 0:
            raise ValueError("structured_outputs_compile_timeout must be positive seconds")
        if self.engines_per_host < 1:
            raise ValueError("engines_per_host must be at least 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be 0 (no cap) or a number of tokens")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; use auto, int8 or fp8")
        self.expert_offload_options()  # validates

    def expert_offload_options(self) -> ExpertOffloadOptions:
        return ExpertOffloadOptions(
            mode=self.expert_offload,
            cache_size=self.expert_cache_size,
            policy=self.expert_cache_policy,
            prefetch=self.expert_prefetch,
            stream_threshold=self.expert_stream_threshold,
            cpu_compute=self.expert_cpu_compute,
        )

    def resolve_device(self) -> torch.device:
        # Imported here: the API process imports this module and must not load torch.
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


KV_ROLES = ("colocated", "prefill", "decode")
ENGINE_OPTIONS = frozenset(f.name for f in fields(EngineArgs)) - {"model"}


def quantization_for(option: str | None, model: str | None) -> str | None:
    """The quantization to load with: the option's, except that "none" means dense, and an
    unset option keeps a GGUF model (the default model is one) in its own quantized
    blocks, as llama.cpp and vLLM serve a GGUF."""
    if option is not None:
        return None if option.lower() == "none" else option
    is_gguf = model is None or model.lower().endswith(".gguf")
    return "gguf" if is_gguf else None


def engine_args_for(model: str | os.PathLike[str] | None = None, **options: object) -> EngineArgs:
    """EngineArgs for a user's model argument and engine options.

    `model` is an HF folder (loaded as it is), a .gguf file (converted once into the cache,
    see engine/gguf_loader.py) or None for the default model (SmolLM2-135M-Instruct's
    GGUF). `options` are EngineArgs fields; `quantization` unset or None picks "gguf" for
    a GGUF model and dense for a folder, and "none" asks for dense explicitly;
    `download_dir` is the conversion cache.
    Raises TypeError naming any option EngineArgs does not have, and ValueError for a bad
    value, both before any conversion starts; ModelFilesError (an OSError, one line naming
    the path and what to do) for model files or a cache that cannot be used.
    """
    unknown = sorted(set(options) - ENGINE_OPTIONS)
    if unknown:
        raise TypeError(_unknown_options_message(unknown))
    path = None if model is None else os.fspath(model)
    options["quantization"] = quantization_for(options.get("quantization"), path)  # type: ignore[arg-type]
    # Validate every value before resolving the model: a GGUF conversion can take a while.
    args = EngineArgs(model=path or "", **options)  # type: ignore[arg-type]
    # Imported here: the GGUF converter pulls in numpy, gguf and safetensors.
    from cadence.engine.default_model import resolve_model_path
    from cadence.engine.model_files import check_model_files

    folder = resolve_model_path(path, args.download_dir)
    # Here, not in the engine: a broken file is named to the user in one line, instead of
    # surfacing as an anonymous error in the engine process's traceback.
    check_model_files(folder)
    return replace(args, model=folder)


def _unknown_options_message(unknown: list[str]) -> str:
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, ENGINE_OPTIONS, n=1)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return (
        f"unknown engine option{'s' if len(unknown) > 1 else ''} {', '.join(parts)}; "
        f"the options are {', '.join(sorted(ENGINE_OPTIONS))}"
    )
