"""A CPU install has no triton: serving, quantized or not, must never import it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable


def test_cpu_paths_never_import_triton(tiny_model_dir: Callable[[str], str]) -> None:
    path = tiny_model_dir("llama")
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["triton"] = None  # any `import triton` now raises ImportError
        from cadence import LLM, SamplingParams
        params = SamplingParams(max_tokens=3, temperature=0.0)
        for options in ({{}}, {{"quantization": "int8"}}, {{"quantization": "int4"}}, {{"quantization": "fp8"}},
                        {{"kv_cache_dtype": "int8"}}):
            llm = LLM({path!r}, device="cpu", num_gpu_blocks=32, max_model_len=64, **options)
            assert len(llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 3, options
        print("ok")
        """
    )
    # A fresh interpreter without TRITON_INTERPRET: what `cadence serve` sees on a CPU box.
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
