"""Real clients as their users run them against `cadence serve` on a tiny random model:
LangChain's `with_structured_output` and `bind_tools`, and one tool-using turn of the
OpenAI Agents SDK. Each skips only where its package is not installed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict

from tests.support.server_checks import MODEL
from tests.support.server_harness import ServerProcess
from tests.support.tool_chat_template import TOOL_CHAT_TEMPLATE


class Forecast(BaseModel):
    # Closed and finite: a random model's answer always completes within max_tokens.
    model_config = ConfigDict(extra="forbid")

    city: Literal["Paris", "Rome", "Oslo"]
    sky: Literal["sun", "rain"]
    windy: bool


@pytest.fixture(scope="module")
def server(tiny_model_dir: Callable[[str], str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TOOL_CHAT_TEMPLATE)
    args = ["--num-gpu-blocks", "512", "--served-model-name", MODEL, "--chat-template", str(template)]
    with ServerProcess(
        tiny_model_dir("llama"), *args, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"
    ) as p:
        yield p


def test_langchain_structured_output_and_tools(server: ServerProcess) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(
        model=MODEL, base_url=f"{server.base_url}/v1", api_key="unused", max_tokens=200, seed=1, max_retries=0
    )
    assert isinstance(chat.with_structured_output(Forecast).invoke("Weather?"), Forecast)

    def get_forecast(city: Literal["Paris", "Rome"], windy: bool) -> str:
        """The forecast for a city."""
        return f"{city}: {windy}"

    for choice in ("required", "get_forecast"):
        # strict: additionalProperties false, or the arguments may hold any other keys.
        bound = chat.bind_tools([get_forecast], tool_choice=choice, parallel_tool_calls=False, strict=True)
        message = bound.invoke("Weather in Paris?")
        (call,) = message.tool_calls[:1]
        assert call["name"] == "get_forecast"
        assert call["args"]["city"] in ("Paris", "Rome") and isinstance(call["args"]["windy"], bool)


def test_agents_sdk_runs_a_tool_using_turn(server: ServerProcess) -> None:
    agents = pytest.importorskip("agents")
    openai = pytest.importorskip("openai")
    agents.set_tracing_disabled(True)  # nothing leaves for OpenAI's servers
    called: list[tuple[str, bool]] = []

    @agents.function_tool
    def get_forecast(city: Literal["Paris", "Rome"], windy: bool) -> str:
        """The forecast for a city."""
        called.append((city, windy))
        return "sunny"

    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    agent = agents.Agent(
        name="forecaster",
        instructions="Use the tool.",
        tools=[get_forecast],
        model=agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        # The first turn must call the tool; the SDK then resets the choice to auto for the answer.
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=200, extra_args={"seed": 2}
        ),
    )
    result = asyncio.run(agents.Runner.run(agent, "Weather in Paris?", max_turns=3))
    assert called and called[0][0] in ("Paris", "Rome")
    assert isinstance(result.final_output, str)
