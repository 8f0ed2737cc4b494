"""Reasoning parsers on outputs written as Qwen3 and DeepSeek-R1 write them, whole and cut anywhere."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cadence.server.reasoning import REASONING_PARSERS, ReasoningDelta, get_reasoning_parser
from cadence.server.tool_parsers import get_tool_parser
from tests.support.tool_call_outputs import TOOLS

# Generation prompts as the models' chat templates render them.
QWEN3_PROMPT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
QWEN3_NO_THINKING_PROMPT = QWEN3_PROMPT + "<think>\n\n</think>\n\n"
QWEN3_THINKING_2507_PROMPT = QWEN3_PROMPT + "<think>\n"
R1_DISTILL_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜><think>\n"
R1_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜>"
R1_NO_THINKING_PROMPT = R1_PROMPT + "<think>\n\n</think>\n\n"


@dataclass
class Recorded:
    id: str
    parser: str
    prompt: str
    text: str
    reasoning: str
    content: str


RECORDED = [
    Recorded(
        "qwen3-model-opens-think",
        "qwen3",
        QWEN3_PROMPT,
        "<think>\nThe user asks for 2+2. That is 4.\n</think>\n\n2 + 2 = **4**.",
        "\nThe user asks for 2+2. That is 4.\n",
        "\n\n2 + 2 = **4**.",
    ),
    Recorded("qwen3-thinking-disabled", "qwen3", QWEN3_NO_THINKING_PROMPT, "2 + 2 = 4.", "", "2 + 2 = 4."),
    Recorded(
        "qwen3-thinking-2507-prompt-opens-think",
        "qwen3",
        QWEN3_THINKING_2507_PROMPT,
        "Okay, simple arithmetic: 2+2=4 ✓.\n</think>\n\nIt is 4.",
        "Okay, simple arithmetic: 2+2=4 ✓.\n",
        "\n\nIt is 4.",
    ),
    Recorded(
        "qwen3-truncated-inside-think",
        "qwen3",
        QWEN3_PROMPT,
        "<think>\nLet me think about 日本語 and </thi",
        "\nLet me think about 日本語 and </thi",
        "",
    ),
    Recorded(
        "qwen3-end-tag-in-the-answer-stays",
        "qwen3",
        QWEN3_PROMPT,
        "<think>a<b</think>Close blocks with </think>, open with <think>.",
        "a<b",
        "Close blocks with </think>, open with <think>.",
    ),
    Recorded(
        "qwen3-tags-mentioned-without-thinking",
        "qwen3",
        QWEN3_PROMPT,
        "Use <think> tags</think> like this.",
        "",
        "Use <think> tags</think> like this.",
    ),
    Recorded(
        "qwen3-model-repeats-the-prompts-think",
        "qwen3",
        QWEN3_THINKING_2507_PROMPT,
        "<think>\nhmm</think>ok",
        "\nhmm",
        "ok",
    ),
    Recorded(
        "qwen3-tool-call-after-thinking",
        "qwen3",
        QWEN3_PROMPT,
        "<think>\nI need the weather tool.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
        "\nI need the weather tool.\n",
        '\n\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
    ),
    Recorded(
        "r1-distill-prompt-opens-think",
        "deepseek_r1",
        R1_DISTILL_PROMPT,
        "Alright, 2 + 2 is 4.\n</think>\n\nThe answer is $\\boxed{4}$.",
        "Alright, 2 + 2 is 4.\n",
        "\n\nThe answer is $\\boxed{4}$.",
    ),
    Recorded(
        "r1-model-writes-its-own-think",
        "deepseek_r1",
        R1_PROMPT,
        "<think>\nOk.\n</think>\n\n4",
        "\nOk.\n",
        "\n\n4",
    ),
    Recorded(
        "r1-reasoning-without-any-tag",
        "deepseek_r1",
        R1_PROMPT,
        "Two plus two: four.</think>4",
        "Two plus two: four.",
        "4",
    ),
    Recorded(
        "r1-truncated-is-all-reasoning",
        "deepseek_r1",
        R1_DISTILL_PROMPT,
        "Let me compute. 2+2... it is 4, so the answer <",
        "Let me compute. 2+2... it is 4, so the answer <",
        "",
    ),
    Recorded("r1-thinking-closed-by-template", "deepseek_r1", R1_NO_THINKING_PROMPT, "4</think>", "", "4</think>"),
    Recorded("r1-empty-output", "deepseek_r1", R1_DISTILL_PROMPT, "", "", ""),
]


def parse(recorded: Recorded, chunks: list[str]) -> tuple[str, str]:
    parser_class = get_reasoning_parser(recorded.parser)
    parser = parser_class(parser_class.starts_in_reasoning(recorded.prompt))
    deltas = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
    reasoning = "".join(delta.reasoning for delta in deltas)
    content = "".join(delta.content for delta in deltas)
    # Once content has come, no more reasoning does.
    first_content = next((i for i, delta in enumerate(deltas) if delta.content), len(deltas))
    assert not any(delta.reasoning for delta in deltas[first_content + 1 :])
    return reasoning, content


@pytest.mark.parametrize("recorded", RECORDED, ids=[recorded.id for recorded in RECORDED])
def test_whole_output(recorded: Recorded) -> None:
    assert parse(recorded, [recorded.text]) == (recorded.reasoning, recorded.content)


@pytest.mark.parametrize("recorded", RECORDED, ids=[recorded.id for recorded in RECORDED])
def test_cut_at_every_boundary(recorded: Recorded) -> None:
    text = recorded.text
    expected = (recorded.reasoning, recorded.content)
    for cut in range(len(text) + 1):
        assert parse(recorded, [text[:cut], text[cut:]]) == expected, f"cut at {cut}"
    assert parse(recorded, list(text)) == expected


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_random_chunks(data: st.DataObject) -> None:
    recorded = data.draw(st.sampled_from(RECORDED))
    text = recorded.text
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=10)))
    chunks = [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)])]
    assert parse(recorded, chunks) == (recorded.reasoning, recorded.content)


@pytest.mark.parametrize(
    ("parser_name", "prompt", "starts"),
    [
        ("qwen3", QWEN3_PROMPT, False),
        ("qwen3", QWEN3_NO_THINKING_PROMPT, False),
        ("qwen3", QWEN3_THINKING_2507_PROMPT, True),
        ("deepseek_r1", R1_DISTILL_PROMPT, True),
        ("deepseek_r1", R1_PROMPT, True),
        ("deepseek_r1", R1_NO_THINKING_PROMPT, False),
    ],
)
def test_where_the_output_starts(parser_name: str, prompt: str, starts: bool) -> None:
    assert get_reasoning_parser(parser_name).starts_in_reasoning(prompt) is starts


def test_a_split_end_tag_is_held_and_released_when_it_is_not_one() -> None:
    parser = get_reasoning_parser("deepseek_r1")(starts_in_reasoning=True)
    assert parser.feed("so x </th") == ReasoningDelta(reasoning="so x ")
    assert parser.feed("at is it") == ReasoningDelta(reasoning="</that is it")
    assert parser.feed("</") == ReasoningDelta()
    assert parser.feed("think>") == ReasoningDelta()
    assert parser.feed("4") == ReasoningDelta(content="4")


def test_an_opening_tag_at_the_start_is_held_until_known() -> None:
    parser = get_reasoning_parser("qwen3")(starts_in_reasoning=False)
    assert parser.feed("<thi") == ReasoningDelta()
    assert parser.feed("nk>hm") == ReasoningDelta(reasoning="hm")
    other = get_reasoning_parser("qwen3")(starts_in_reasoning=False)
    assert other.feed("<th") == ReasoningDelta()
    assert other.feed("e") == ReasoningDelta(content="<the")


def test_registry() -> None:
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1"}
    assert all(parser.end_marker == "</think>" for parser in REASONING_PARSERS.values())
    with pytest.raises(ValueError, match="qwen3"):
        get_reasoning_parser("nope")


def test_tool_calls_parsed_from_the_content_after_the_reasoning() -> None:
    """The chat handler chains the parsers: reasoning first, its content into the tool parser."""
    text = (
        "<think>\nThe user wants weather; a <tool_call> is needed.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}\n</tool_call>'
    )

    def run(chunks: list[str]) -> tuple[str, str, list[tuple[str | None, str]]]:
        reasoning_parser = get_reasoning_parser("qwen3")(starts_in_reasoning=False)
        tool_parser = get_tool_parser("hermes")(TOOLS)
        reasoning, content, calls = "", "", []
        for chunk in [*chunks, None]:
            split = reasoning_parser.feed(chunk) if chunk is not None else reasoning_parser.finish()
            parsed = tool_parser.feed(split.content)
            if chunk is None:
                finished = tool_parser.finish()
                parsed.content += finished.content
                parsed.calls += finished.calls
            reasoning += split.reasoning
            content += parsed.content
            calls += [(call.name, call.arguments) for call in parsed.calls]
        return reasoning, content, calls

    whole = run([text])
    assert whole[:2] == ("\nThe user wants weather; a <tool_call> is needed.\n", "\n\n")
    assert [name for name, _ in whole[2]] == ["get_weather"]
    assert "".join(arguments for _, arguments in whole[2]) == '{"city": "Köln"}'
    for cut in range(len(text) + 1):
        streamed = run([text[:cut], text[cut:]])
        assert streamed[:2] == whole[:2]
        assert "".join(arguments for _, arguments in streamed[2]) == '{"city": "Köln"}'
