"""A small tool-aware chat template in the Hermes/Qwen2.5 style, for tiny test models:
tools in the system turn, calls as <tool_call> JSON, tool answers as <tool_response>, and
a <think> opened at the generation prompt when `enable_thinking` is passed."""

from __future__ import annotations

TOOL_CHAT_TEMPLATE = """\
{%- if tools %}<|im_start|>system
Tools:
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- if message.content %}
{{ message.content }}
{%- endif %}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking %}<think>
{% endif %}{% endif %}"""
