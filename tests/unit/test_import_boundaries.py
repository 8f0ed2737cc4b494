"""What each process and the client SDK import: the SDK and the OpenAI schema work without
the server's dependencies, and the API process imports neither torch nor the engine core.

Each check runs in a fresh interpreter, since this one has long since imported everything.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import cadence

# The server's and the engine's dependencies; an SDK user installs none of them.
SERVER_ONLY_PACKAGES = (
    "torch",
    "transformers",
    "tokenizers",
    "fastapi",
    "starlette",
    "uvicorn",
    "zmq",
    "numba",
    "triton",
    "gguf",
    "safetensors",
    "msgpack",
)

# A meta-path finder that refuses the server's dependencies, as if they were not installed.
BLOCKER = textwrap.dedent(
    f"""
    import sys

    BLOCKED = {SERVER_ONLY_PACKAGES!r}

    class Blocker:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if any(name == blocked or name.startswith(blocked + ".") for blocked in BLOCKED):
                raise ImportError(f"{{name}} is not installed here")
            return None

    sys.meta_path.insert(0, Blocker)
    """
)


def run_python(code: str) -> None:
    """Run `code` in a fresh interpreter that imports this checkout's cadence; fail with its output."""
    source_root = str(Path(cadence.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [source_root, os.environ.get("PYTHONPATH")])))
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_client_sdk_imports_and_parses_without_server_dependencies() -> None:
    run_python(
        BLOCKER
        + textwrap.dedent(
            """
            import httpx

            import cadence.client
            from cadence.openai_schema.requests import ChatCompletionRequest
            from cadence.openai_schema.responses import ChatChoice, ChatCompletionResponse, ChatResponseMessage

            request = ChatCompletionRequest.model_validate(
                {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            )
            assert request.requested_max_tokens == 4

            answer = ChatCompletionResponse(
                id="chatcmpl-1",
                created=0,
                model="m",
                choices=[ChatChoice(index=0, message=ChatResponseMessage(content="hello"), finish_reason="stop")],
            )

            def serve(http_request: httpx.Request) -> httpx.Response:
                assert http_request.url.path == "/v1/chat/completions"
                return httpx.Response(200, content=answer.model_dump_json())

            with cadence.client.Client("http://cadence.test", transport=httpx.MockTransport(serve)) as client:
                reply = client.chat([{"role": "user", "content": "hi"}], model="m", max_tokens=4)
            assert reply.choices[0].message.content == "hello"

            loaded = sorted(name for name in sys.modules if name.startswith(("cadence.server", "cadence.engine")))
            assert not loaded, f"the SDK imported {loaded}"
            """
        )
    )


def test_openai_schema_imports_neither_server_nor_engine() -> None:
    run_python(
        textwrap.dedent(
            """
            import sys

            import cadence.openai_schema.requests
            import cadence.openai_schema.responses

            loaded = sorted(name for name in sys.modules if name.startswith(("cadence.server", "cadence.engine")))
            assert not loaded, f"the schema imported {loaded}"
            """
        )
    )


def test_api_server_imports_no_torch_and_no_engine_core() -> None:
    run_python(
        textwrap.dedent(
            """
            import sys

            import cadence.server.api_server
            from cadence.tokenization.loading import load_tokenizer

            heavy = sorted(
                name
                for name in sys.modules
                if name.split(".")[0] in ("torch", "numba", "triton")
                or name in ("cadence.engine.engine_core", "cadence.engine.model_runner", "cadence.engine.llm")
            )
            assert not heavy, f"the API process imported {heavy}"
            """
        )
    )
