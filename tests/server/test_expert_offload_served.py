"""Expert offloading end to end: `cadence serve` on a tiny MoE folder answers the openai
SDK identically with and without `--expert-offload disk`, and reports the expert
counters on /metrics; and with `disk`, the engine's resident memory stays under the
budget of the model without its experts plus the slots, read from /proc/self/status."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch
from openai.types import Completion
from transformers import MixtralConfig, MixtralForCausalLM

from tests.support.server_harness import ServerProcess

PROMPTS = [f"request {i} asks about {'experts ' * (i % 5)}and slots" for i in range(16)]


def _answers(server: ServerProcess) -> list[str]:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)

    def ask(prompt: str) -> str:
        completion = client.completions.create(
            model=client.models.list().data[0].id,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert isinstance(completion, Completion)  # the SDK's own model validated the body
        return completion.choices[0].text

    with ThreadPoolExecutor(16) as pool:  # 16 at once: the steps batch them
        return list(pool.map(ask, PROMPTS))


def test_served_answers_match_with_and_without_offloading(tiny_model_dir: Callable[[str], str]) -> None:
    """Same text for 16 concurrent completions; expert misses and bytes on /metrics."""
    path = tiny_model_dir("mixtral")
    common = ("--num-gpu-blocks", "256", "--dtype", "float32")
    with ServerProcess(path, *common) as resident:
        expected = _answers(resident)
        with pytest.raises(KeyError):
            resident.metric("cadence:expert_cache_misses_total")  # not exported without offloading
    with ServerProcess(path, *common, "--expert-offload", "disk", "--expert-cache-size", "2") as offloaded:
        assert _answers(offloaded) == expected
        assert offloaded.metric("cadence:expert_cache_misses_total") > 0
        assert offloaded.metric("cadence:expert_load_bytes_total") > 0
        layer_steps = offloaded.metric("cadence:expert_layer_steps_total")
        assert layer_steps >= 2 * 8  # two MoE layers, at least one step per generated token


_PROBE = """
import json, sys
import torch
from cadence.engine.llm import LLM
from cadence.engine.sampling_params import SamplingParams

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) restarts from here
options = json.loads(sys.argv[2])
llm = LLM(sys.argv[1], dtype="float32", block_size=4, max_model_len=64, num_gpu_blocks=64, max_num_seqs=16, **options)
params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
outputs = llm.generate([{"prompt_token_ids": [5 + i, 9, 13]} for i in range(16)], params)
print(json.dumps({
    "grew": status("VmRSS") - before,
    "peak": status("VmHWM") - before,
    "tokens": [o.outputs[0].token_ids for o in outputs],
}))
"""

EXPERT_BYTES = 4 * 16 * 3 * 256 * 1024 * 4  # layers x experts x (gate, up, down) x hidden x intermediate x fp32
SLOT_BYTES = 4 * (2 + 2) * 3 * 256 * 1024 * 4  # layers x (2 cache slots + 2 stream buffers) x an expert


def _probe(path: str, options: dict[str, object]) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, path, json.dumps(options)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_disk_offload_keeps_resident_memory_under_budget(tmp_path: Path) -> None:
    """A Mixtral whose experts take 192 MiB: served from disk with 2 slots per layer, the
    process grows (at its peak, loading included) by no more than the resident run's
    growth without the experts, plus the slots and 32 MiB; the tokens are the same."""
    config = MixtralConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=16,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    MixtralForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    resident = _probe(str(tmp_path), {})
    disk = _probe(str(tmp_path), {"expert_offload": "disk", "expert_cache_size": 2})
    assert disk["tokens"] == resident["tokens"]
    grew = resident["grew"]
    assert isinstance(grew, int) and grew > EXPERT_BYTES  # the measure sees the experts when resident
    budget = grew - EXPERT_BYTES + SLOT_BYTES + (32 << 20)
    assert isinstance(disk["peak"], int) and disk["peak"] < budget, (disk, resident)
