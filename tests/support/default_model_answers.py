"""Run as a script: start ``LLM()`` (the default model, as ``cadence serve`` runs it) and
print, as one JSON object, each chat question's greedy answer (text and token ids) and the
CPU kernel each quantized layer runs. The tests start it in processes of their own, with
an empty HOME or capped instruction sets, which must be set before the libraries load."""

from __future__ import annotations

import json
import sys

from cadence import LLM, SamplingParams
from cadence.engine.quantization.cpu_planner import group_summary

QUESTIONS = (
    "What is the capital of France?",
    "Name three colours.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
)
MAX_TOKENS = 24


def main() -> None:
    llm = LLM()
    tokenizer = llm.get_tokenizer()
    assert tokenizer is not None
    answers = {}
    for question in QUESTIONS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer.encode(str(text), add_special_tokens=False)
        (output,) = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
        answers[question] = {"text": output.outputs[0].text, "token_ids": list(output.outputs[0].token_ids)}
    json.dump({"answers": answers, "kernels": group_summary(llm.engine.model.modules())}, sys.stdout)


if __name__ == "__main__":
    main()
