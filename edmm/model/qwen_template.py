"""The chat template of the built Qwen2.5 tokenizer (`edmm.model.qwen_vocab`)."""

# ruff: noqa: E501  (Jinja lines are kept whole)

from __future__ import annotations

# A chat template written for EDMM, in the embedded tiny model's format: tools in the system
# turn, calls as <tool_call>{"name": ..., "arguments": ...}</tool_call>, consecutive tool
# results in one user turn of <tool_response> blocks, reasoning (reasoning_content, or a
# <think> block in the content) shown only for assistant turns after the last user query.
QWEN_CHAT_TEMPLATE = r"""
{%- set tool_intro = "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" -%}
{%- set tool_outro = "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>" -%}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if has_system -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}
    {{- tool_intro -}}
    {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
    {{- tool_outro + '<|im_end|>\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- set state = namespace(last_query=messages | length - 1, searching=true) -%}
{%- for i in range(messages | length - 1, -1, -1) -%}
    {%- set m = messages[i] -%}
    {%- if state.searching and m.role == 'user' and m.content is string -%}
        {%- if not (m.content.startswith('<tool_response>') and m.content.endswith('</tool_response>')) -%}
            {%- set state.searching = false -%}
            {%- set state.last_query = i -%}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
    {%- set text = m.content if m.content is string else '' -%}
    {%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}
        {{- '<|im_start|>' + m.role + '\n' + text + '<|im_end|>\n' -}}
    {%- elif m.role == 'assistant' -%}
        {%- set thought = m.reasoning_content if m.reasoning_content is string else '' -%}
        {%- if m.reasoning_content is not string and '</think>' in text -%}
            {%- set thought = text.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}
            {%- set text = text.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if loop.index0 > state.last_query and (loop.last or thought) -%}
            {{- '<think>\n' + thought.strip('\n') + '\n</think>\n\n' + text.lstrip('\n') -}}
        {%- else -%}
            {{- text -}}
        {%- endif -%}
        {%- for call in m.tool_calls or [] -%}
            {%- set fn = call.function if call.function else call -%}
            {%- if text or not loop.first -%}{{- '\n' -}}{%- endif -%}
            {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' -}}
            {{- fn.arguments if fn.arguments is string else fn.arguments | tojson -}}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif m.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\n<tool_response>\n' + text + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}
""".strip()
