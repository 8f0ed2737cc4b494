"""The chat flags of `cadence serve` and `cadence router`: parsers by vLLM's names,
--chat-template as a file or inline, and one-line refusals at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from cadence.server.chat_options import ChatOptions, chat_options_from
from cadence.server.cli import build_parser


@pytest.mark.parametrize("command", [["serve", "/models/x"], ["router", "--decode", "http://d:1"]])
def test_the_flags_on_serve_and_router(command: list[str], tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json", "--reasoning-parser", "deepseek_r1"]
    args = build_parser().parse_args([*command, *flags, "--chat-template", str(template)])
    assert chat_options_from(args) == ChatOptions(True, "llama3_json", "deepseek_r1", "{{ messages[0]['content'] }}")
    assert chat_options_from(build_parser().parse_args(command)) == ChatOptions()


def test_an_inline_template_is_taken_as_it_is() -> None:
    args = build_parser().parse_args(["serve", "--chat-template", "{% for m in messages %}{{ m.content }}{% endfor %}"])
    assert args.chat_template == "{% for m in messages %}{{ m.content }}{% endfor %}"


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--tool-call-parser", "hermes2"], "unknown tool-call parser 'hermes2'; choose one of hermes, llama3_json"),
        (["--reasoning-parser", "r1"], "unknown reasoning parser 'r1'; choose one of qwen3, deepseek_r1"),
        (["--chat-template", "/no/such/template.jinja"], "is neither a file nor a Jinja template"),
    ],
)
def test_bad_values_are_one_line_refusals(flags: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["serve", *flags])
    assert refused.value.code == 2
    error_lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and named in error_lines[0]


def test_auto_tool_choice_needs_a_parser() -> None:
    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice"])
    with pytest.raises(SystemExit, match="--enable-auto-tool-choice needs --tool-call-parser"):
        chat_options_from(args)
