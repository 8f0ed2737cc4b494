"""The API process's chat options: tool-call and reasoning parsers and the chat template,
with the flags that set them on `cadence serve` and `cadence router` (vLLM's names)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ChatOptions:
    """How chat answers are read and prompts rendered, beyond what a request says."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # a name in cadence.server.tool_parsers.TOOL_PARSERS
    reasoning_parser: str | None = None  # a name in cadence.server.reasoning.REASONING_PARSERS
    chat_template: str | None = None  # the template's text, instead of the tokenizer's


def _tool_call_parser(name: str) -> str:
    from cadence.server.tool_parsers import TOOL_PARSERS

    if name not in TOOL_PARSERS:
        raise argparse.ArgumentTypeError(f"unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}")
    return name


def _reasoning_parser(name: str) -> str:
    from cadence.server.reasoning import REASONING_PARSERS

    if name not in REASONING_PARSERS:
        raise argparse.ArgumentTypeError(
            f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}"
        )
    return name


def load_chat_template(value: str) -> str:
    """--chat-template's text: a file's, or the value itself when it reads as a template
    (as vLLM decides: it holds template syntax or a newline)."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if any(mark in value for mark in ("{{", "{%", "\n")):
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is neither a file nor a Jinja template")


def add_chat_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("chat", "tool calls, reasoning and the chat template")
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let requests use tool_choice "auto" (the default with tools): the model decides, and '
        "--tool-call-parser reads its calls",
    )
    group.add_argument(
        "--tool-call-parser",
        type=_tool_call_parser,
        default=None,
        metavar="NAME",
        help="how the model writes tool calls: hermes (Qwen2.5/Qwen3, Hermes), llama3_json or mistral",
    )
    group.add_argument(
        "--reasoning-parser",
        type=_reasoning_parser,
        default=None,
        metavar="NAME",
        help="put the model's thinking into reasoning_content: qwen3 or deepseek_r1 (<think> ... </think>)",
    )
    group.add_argument(
        "--chat-template",
        type=load_chat_template,
        default=None,
        metavar="PATH",
        help="a Jinja chat template (a file, or the template itself) used instead of the tokenizer's",
    )


def chat_options_from(args: argparse.Namespace) -> ChatOptions:
    """The options from the flags; a one-line error when they do not go together."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit(f"cadence {args.command}: --enable-auto-tool-choice needs --tool-call-parser NAME")
    return ChatOptions(
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        chat_template=args.chat_template,
    )
