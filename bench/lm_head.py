"""Dense against int8 LM head (``--quantize-lm-head``) at batch-1 decode, interleaved.

    python bench/lm_head.py                         # the default model, --quantization gguf
    python bench/lm_head.py --quantization none     # a dense body

Both engines live in one process and take turns generating, so the machine's load drifts
over both alike; bench/quant.py's rows run one after another and cannot show a few ms.
Prints the median model-forward and head ms per decode step (bench/step_probe.py), the
step-time bound on tok/s, and the int8 head's ratio over the dense one.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from quant import decode_phase_ms  # noqa: E402
from quant_eval import EVAL_TEXT  # noqa: E402
from step_probe import StepProbe  # noqa: E402

from cadence import LLM, SamplingParams  # noqa: E402
from cadence.engine.default_model import resolve_model_path  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--quantization", default="gguf", help="the body's: gguf, int8, int4 or none")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    path = resolve_model_path(args.model)
    body = None if args.quantization == "none" else args.quantization
    engines = {head: LLM(path, dtype=args.dtype, quantization=body, quantize_lm_head=head, max_model_len=1024,
                         num_gpu_blocks=128) for head in (False, True)}
    probes = {head: StepProbe(llm) for head, llm in engines.items()}
    tokenizer = engines[False].get_tokenizer()
    assert tokenizer is not None
    prompt = tokenizer(EVAL_TEXT)["input_ids"][:32]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(args.rounds):
        for llm in engines.values():
            llm.generate([{"prompt_token_ids": prompt}], params)
    print(f"# LM head at batch-1 decode ({time.strftime('%Y-%m-%d %H:%M')}), {os.path.basename(path)}, "
          f"body {args.quantization}, {args.rounds} x {args.new_tokens} tokens each, load {os.getloadavg()[0]:.2f}\n")
    print("| head | forward ms | head ms | step-bound tok/s |")
    print("|---|---:|---:|---:|")
    bound = {}
    for head, probe in probes.items():
        forward_ms, head_ms = decode_phase_ms(probe)
        bound[head] = 1e3 / (forward_ms + head_ms)
        print(f"| {'int8' if head else 'dense'} | {forward_ms:.1f} | {head_ms:.2f} | {bound[head]:.1f} |")
    print(f"\nint8 head / dense head: {bound[True] / bound[False]:.2f}x step-bound decode")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
