"""A small tool-aware chat template in the Hermes/Qwen2.5 style, for tiny test models:
the tools' names in the system turn (their schemas would not fit a tiny model's
context), calls as <tool_call> JSON, tool answers as <tool_response>, and a <think>
opened at the generation prompt when `enable_thinking` is true, or closed empty when it is
false (as Qwen3's template turns thinking off).

transformers renders templates with trim_blocks (a newline right after a block tag is
dropped), so no block tag here is followed by a newline that should be kept.
"""

from __future__ import annotations

TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n"
    "{% for tool in tools %}{{ tool.function.name }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{% if message.content %}{{ message.content }}\n{% endif %}"
    "{% for call in message.tool_calls %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n"
    '<tool_response id="{{ message.tool_call_id }}">\n{{ message.content }}\n</tool_response><|im_end|>\n'
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined %}{% if enable_thinking %}<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
    "{% endif %}"
)
