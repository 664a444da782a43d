"""Formats and loss masks, packing, sources and splits, per-rank loading, and clear errors for bad input."""

import bz2
import codecs
import contextlib
import dataclasses
import gzip
import inspect
import importlib.metadata
import json
import lzma
import os
import re
import shutil
import socket
import string
import subprocess
import sys
from pathlib import Path

import datasets
import huggingface_hub
import pyarrow
import pyarrow.compute as pc
import pyarrow.json
import pyarrow.parquet
import pytest
import torch
import torch.distributed as dist
import yaml
import zstandard
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, AutoTokenizer, BioGptConfig, BloomConfig, ByT5Tokenizer, CTRLConfig,
                          CTRLLMHeadModel, GPT2Config, GPT2LMHeadModel, GPTJConfig, GPTJForCausalLM, JambaConfig,
                          LlamaConfig, LlamaForCausalLM, Lfm2Config, OPTConfig, OPTForCausalLM, PreTrainedTokenizerFast,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, RwkvConfig, RwkvForCausalLM, XGLMConfig,
                          XGLMForCausalLM)

from fsdp_recipes import data as data_module, data_sources, demo
from fsdp_recipes.config import ConfigError, TrainConfig, parse_config
from fsdp_recipes.data import (IGNORE_INDEX, build_dataloader, build_datasets, check_model_reads_data,
                               check_packing_separates_examples, collate, model_inputs, optimizer_step_batches,
                               pack_examples)
from fsdp_recipes.data_formats import (DEFAULT_CHAT_TEMPLATE, detect_format, overlaps_a_span, render_with_loss_spans,
                                       tokenize_example,
                                      turn_closing_token_id)
from fsdp_recipes.data_sources import carve_eval, load_split
from fsdp_recipes.model import load_tokenizer
from fsdp_recipes.trainer import token_loss_sum

from conftest import REPO, file_size_limit, read_metrics, subprocess_env, torchrun

TOKENIZER = demo.build_tokenizer()


def loss_tokens(out: dict, tokenizer=TOKENIZER) -> list[str]:
    """The tokens that carry loss: those predicted (position 1 on) whose label is not ignored."""
    assert [l for l in out["labels"] if l != IGNORE_INDEX] == [t for t, l in zip(out["input_ids"], out["labels"])
                                                               if l != IGNORE_INDEX]
    return tokenizer.convert_ids_to_tokens([t for t, l in zip(out["input_ids"][1:], out["labels"][1:])
                                            if l != IGNORE_INDEX])


def tokens(out: dict) -> list[str]:
    return TOKENIZER.convert_ids_to_tokens(out["input_ids"])


CHAT = {"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"},
                     {"role": "user", "content": "cd"}, {"role": "assistant", "content": "dc"}]}


def test_exact_loss_tokens_of_each_format():
    out = tokenize_example(CHAT, "chat", TOKENIZER, max_seq_length=64)
    assert TOKENIZER.decode(out["input_ids"]) == "<|user|>ab<|end|><|assistant|>ba<|end|><|user|>cd<|end|><|assistant|>dc<|end|>"
    assert loss_tokens(out) == ["b", "a", "<|end|>", "d", "c", "<|end|>"]

    out = tokenize_example({"instruction": "ab", "input": "", "output": "ba"}, "instruction", TOKENIZER, 64)
    assert TOKENIZER.decode(out["input_ids"]) == "<|user|>ab<|end|><|assistant|>ba<|end|>"
    assert loss_tokens(out) == ["b", "a", "<|end|>"]
    # A non-empty input follows the instruction in the user turn, after a blank line.
    text, spans = render_with_loss_spans({"instruction": "ab", "input": "cd", "output": "ba"}, "instruction", TOKENIZER)
    assert text == "<|user|>ab\n\ncd<|end|><|assistant|>ba<|end|>"
    assert [text[s:e] for s, e in spans] == ["ba<|end|>"]
    with pytest.raises(ConfigError, match=r"^row 1: 'input' must be a string, got 5$"):
        tokenize_example({"instruction": "ab", "input": 5, "output": "ba"}, "instruction", TOKENIZER, 64)
    # TRL's conversational prompt/completion (lists of messages): the error says how to write it as chat data.
    conversational = {"prompt": [{"role": "user", "content": "ab"}],
                      "completion": [{"role": "assistant", "content": "ba"}]}
    with pytest.raises(ConfigError, match=r"^row 1: 'prompt' must be a string, got \[\{'role': 'user', "
                                          r"'content': 'ab'\}\]; a prompt and a completion as lists of messages \(TRL's conversational "
                                          r"format\) are not read: write each row's prompt messages, then its "
                                          r"completion messages, as one 'messages' list$"):
        tokenize_example(conversational, "prompt_completion", TOKENIZER, 64)

    out = tokenize_example({"prompt": "ab", "completion": "cd"}, "prompt_completion", TOKENIZER, 64)
    assert tokens(out) == ["<|bos|>", "a", "b", "c", "d", "<|end|>"]
    assert loss_tokens(out) == ["c", "d", "<|end|>"]

    out = tokenize_example({"text": "abc"}, "text", TOKENIZER, 64)
    assert tokens(out) == ["<|bos|>", "a", "b", "c", "<|end|>"]
    assert loss_tokens(out) == ["a", "b", "c", "<|end|>"]

    # completion_only_loss=False: every token after the first carries loss.
    out = tokenize_example(CHAT, "chat", TOKENIZER, 64, completion_only_loss=False)
    assert loss_tokens(out) == tokens(out)[1:]
    out = tokenize_example({"prompt": "ab", "completion": "cd"}, "prompt_completion", TOKENIZER, 64,
                           completion_only_loss=False)
    assert loss_tokens(out) == ["a", "b", "c", "d", "<|end|>"]


def test_default_chat_template_marks_the_assistant_turn():
    tokenizer = demo.build_tokenizer()
    tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    text, spans = render_with_loss_spans(CHAT, "chat", tokenizer)
    assert text.startswith("<|bos|><|im_start|>user\nab<|end|>\n<|im_start|>assistant\nba<|end|>\n")
    assert [text[s:e] for s, e in spans] == ["ba<|end|>\n", "dc<|end|>\n"]
    # As prompt/completion and text examples, chat examples start with the BOS, and without one with the first turn.
    assert tokens(tokenize_example(CHAT, "chat", tokenizer, 64))[0] == "<|bos|>"
    without_bos = char_tokenizer(DEFAULT_CHAT_TEMPLATE, None, "<|end|>", ["<|end|>"])
    assert render_with_loss_spans(CHAT, "chat", without_bos)[0].startswith("<|im_start|>user\nab<|end|>\n")


def char_tokenizer(template: str, bos: str, eos: str, special_tokens: list[str]) -> PreTrainedTokenizerFast:
    """A hub tokenizer's behaviour for its chat template: each special token is one token, the rest one token per
    character (newline included)."""
    vocab = {token: i for i, token in enumerate(["<unk>"] + special_tokens + sorted(set(string.printable)))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, unk_token="<unk>",
                                        additional_special_tokens=[t for t in special_tokens if t not in (bos, eos)])
    tokenizer.chat_template = template
    return tokenizer


# google/gemma-2-2b-it's chat template (its tokenizer_config.json).
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)


# microsoft/Phi-3.5-mini-instruct's chat template (its tokenizer_config.json): a conversation rendered without
# generation prompt ends with the EOS, so an earlier turn rendered alone ends in an EOS the whole chat lacks there.
PHI35_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}{{'<|system|>\n' + "
    "message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
SYSTEM_CHAT = {"messages": [{"role": "system", "content": "be brief"}] + CHAT["messages"]}


def test_phi3_turns_end_before_the_eos_that_closes_only_the_whole_chat():
    tokenizer = char_tokenizer(PHI35_TEMPLATE, "<s>", "<|endoftext|>",
                               ["<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"])
    text, spans = render_with_loss_spans(SYSTEM_CHAT, "chat", tokenizer)
    assert text == ("<|system|>\nbe brief<|end|>\n<|user|>\nab<|end|>\n<|assistant|>\nba<|end|>\n<|user|>\ncd<|end|>\n"
                    "<|assistant|>\ndc<|end|>\n<|endoftext|>")
    assert [text[s:e] for s, e in spans] == ["ba<|end|>\n", "dc<|end|>\n<|endoftext|>"]
    out = tokenize_example(SYSTEM_CHAT, "chat", tokenizer, 128)
    assert loss_tokens(out, tokenizer) == ["b", "a", "<|end|>", "\n", "d", "c", "<|end|>", "\n", "<|endoftext|>"]
    # Reasoning in its own field, which this template never writes, is no reason to refuse the turn.
    reasoning = [{**m, "reasoning_content": "swap"} if m["role"] == "assistant" else m for m in SYSTEM_CHAT["messages"]]
    assert render_with_loss_spans({"messages": reasoning}, "chat", tokenizer) == (text, spans)


# google/gemma-3-1b-it's chat template (its tokenizer_config.json): the system message opens the first user turn.
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


@pytest.mark.parametrize("template, chat, system", [(GEMMA2_TEMPLATE, CHAT, ""), (GEMMA3_TEMPLATE, SYSTEM_CHAT,
                                                                                  "be brief\n\n")])
def test_gemma_turns_are_the_model_turns(template, chat, system):
    tokenizer = char_tokenizer(template, "<bos>", "<eos>", ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"])
    text, spans = render_with_loss_spans(chat, "chat", tokenizer)
    assert text == (f"<bos><start_of_turn>user\n{system}ab<end_of_turn>\n<start_of_turn>model\nba<end_of_turn>\n"
                    "<start_of_turn>user\ncd<end_of_turn>\n<start_of_turn>model\ndc<end_of_turn>\n")
    assert [text[s:e] for s, e in spans] == ["ba<end_of_turn>\n", "dc<end_of_turn>\n"]


# meta-llama/Llama-3.2-1B-Instruct's chat template (its tokenizer_config.json).
LLAMA32_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""


def test_llama3_turns_are_the_assistant_turns():
    tokenizer = char_tokenizer(LLAMA32_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>",
                               ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"])
    text, spans = render_with_loss_spans(SYSTEM_CHAT, "chat", tokenizer)
    # The date is pinned (the template's own fallback), not today's: the tokens do not change with the day.
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December "
                    "2023\nToday Date: 26 Jul 2024\n\nbe brief<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nab"
                    "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nba<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\ncd<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\ndc<|eot_id|>")
    assert [text[s:e] for s, e in spans] == ["ba<|eot_id|>", "dc<|eot_id|>"]


# The Qwen3 release's chat template (tokenizer_config.json of Qwen/Qwen3-0.6B, -1.7B, ...): an empty <think> block
# (non-thinking mode) only in the last turn, so an earlier turn rendered alone differs from the whole chat inside the
# turn, not only at its end.
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""


def test_qwen3_earlier_turns_are_located_without_the_think_block_of_the_last():
    tokenizer = char_tokenizer(QWEN3_TEMPLATE, None, "<|im_end|>",
                               ["<|im_end|>", "<|im_start|>", "<|endoftext|>", "<think>", "</think>"])
    text, spans = render_with_loss_spans(SYSTEM_CHAT, "chat", tokenizer)
    assert text == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nab<|im_end|>\n"
                    "<|im_start|>assistant\nba<|im_end|>\n<|im_start|>user\ncd<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n\n</think>\n\ndc<|im_end|>\n")
    assert [text[s:e] for s, e in spans] == ["ba<|im_end|>\n", "<think>\n\n</think>\n\ndc<|im_end|>\n"]
    labels = tokenize_example(SYSTEM_CHAT, "chat", tokenizer, max_seq_length=256)["labels"]
    assert tokenizer.decode([t for t in labels if t != IGNORE_INDEX]) == "".join(text[s:e] for s, e in spans)
    # The same answer twice: each turn is found at its own place.
    repeated = {"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}] * 2}
    text, spans = render_with_loss_spans(repeated, "chat", tokenizer)
    first = "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n"
    second = first + "ba<|im_end|>\n" + first
    assert [(s, text[s:e]) for s, e in spans] == [(len(first), "ba<|im_end|>\n"),
                                                  (len(second), "<think>\n\n</think>\n\nba<|im_end|>\n")]
    # An earlier turn with reasoning, in its content or in its own field: the whole chat drops it (the template
    # writes it into the last turn only), and the turn is trained on its answer as the chat renders it, the
    # reasoning counted as left out.
    reasoning = {"messages": [{"role": "user", "content": "ab"},
                              {"role": "assistant", "content": "<think>\nswap\n</think>\n\nba"},
                              {"role": "user", "content": "cd"}, {"role": "assistant", "content": "dc"}]}
    separate = {"messages": [reasoning["messages"][0], {"role": "assistant", "content": "ba",
                                                        "reasoning_content": "swap"}, *reasoning["messages"][2:]]}
    text, spans = render_with_loss_spans({"messages": separate["messages"][:2]}, "chat", tokenizer)
    assert [text[s:e] for s, e in spans] == ["<think>\nswap\n</think>\n\nba<|im_end|>\n"]
    for chat in (reasoning, separate):
        text, spans = render_with_loss_spans(chat, "chat", tokenizer)
        assert text == tokenizer.apply_chat_template(chat["messages"], tokenize=False) and "swap" not in text
        assert [text[s:e] for s, e in spans] == ["ba<|im_end|>\n", "<think>\n\n</think>\n\ndc<|im_end|>\n"]
        out = tokenize_example(chat, "chat", tokenizer, 256)
        assert tokenizer.decode([t for t in out["labels"] if t != IGNORE_INDEX]) == "".join(
            text[s:e] for s, e in spans)
        assert out["reasoning_left_out"] == 1
        # Without completion_only_loss: all of its text, as written.
        out = tokenize_example(chat, "chat", tokenizer, 256, completion_only_loss=False)
        assert tokenizer.decode(out["input_ids"]) == text and out["labels"][1:] == out["input_ids"][1:]
        assert out["reasoning_left_out"] == 1
    # Reasoning the template writes is not counted as left out.
    assert tokenize_example({"messages": separate["messages"][:2]}, "chat", tokenizer, 256)["reasoning_left_out"] == 0
    # An earlier answer of newlines only: no tail of its turn holds more than a newline, so it is not located.
    blank = {"messages": [reasoning["messages"][0], {"role": "assistant", "content": "\n\n\n"},
                          *reasoning["messages"][2:]]}
    with pytest.raises(ConfigError, match="renders a conversation differently from its prefixes"):
        render_with_loss_spans(blank, "chat", tokenizer)


# The Qwen2.5 release's chat template (tokenizer_config.json of Qwen/Qwen2.5-*-Instruct): ChatML, with Qwen's
# default system message in a conversation that has none.
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# mistralai/Mistral-Nemo-Instruct-2407's chat template (its tokenizer_config.json; model_type mistral): the system
# message goes into the last message only, and only when that is a user message.
MISTRAL_NEMO_TEMPLATE = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS][" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST]" + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST]" + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif (message.tool_calls is defined and message.tool_calls is not none) %}
        {{- "[TOOL_CALLS][" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- message["content"] + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS]{"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""


def test_qwen25_and_mistral_turns_are_the_assistant_turns():
    tokenizer = char_tokenizer(QWEN25_TEMPLATE, None, "<|im_end|>", ["<|im_end|>", "<|im_start|>", "<|endoftext|>"])
    text, spans = render_with_loss_spans(CHAT, "chat", tokenizer)
    assert text == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\nba<|im_end|>\n"
                    "<|im_start|>user\ncd<|im_end|>\n<|im_start|>assistant\ndc<|im_end|>\n")
    assert [text[s:e] for s, e in spans] == ["ba<|im_end|>\n", "dc<|im_end|>\n"]
    tokenizer = char_tokenizer(MISTRAL_NEMO_TEMPLATE, "<s>", "</s>", ["<s>", "</s>", "[INST]", "[/INST]"])
    text, spans = render_with_loss_spans(CHAT, "chat", tokenizer)
    assert text == "<s>[INST]ab[/INST]ba</s>[INST]cd[/INST]dc</s>"
    assert [text[s:e] for s, e in spans] == ["ba</s>", "dc</s>"]
    out = tokenize_example(CHAT, "chat", tokenizer, 64)
    assert loss_tokens(out, tokenizer) == ["b", "a", "</s>", "d", "c", "</s>"]
    # The template writes a system message only when a user message ends the conversation, so training data, which
    # ends with an answer, would lose it; and one that ends with a user message would hold it after the answers.
    assert tokenizer.apply_chat_template(SYSTEM_CHAT["messages"][:4], tokenize=False) == (
        "<s>[INST]ab[/INST]ba</s>[INST]be brief\n\ncd[/INST]")
    for chat in [SYSTEM_CHAT, {"messages": SYSTEM_CHAT["messages"][:3]}, {"messages": SYSTEM_CHAT["messages"][:4]}]:
        for completion_only_loss in (True, False):
            with pytest.raises(ConfigError, match=r"^row 1: the tokenizer's chat template leaves message 0 "
                                                  r"\(system\) out of the conversation: move its content into a "
                                                  r"message the template keeps"):
                tokenize_example(chat, "chat", tokenizer, 256, completion_only_loss=completion_only_loss)
    # Without a system message, a conversation that ends with a user message trains its answers.
    out = tokenize_example({"messages": CHAT["messages"][:3]}, "chat", tokenizer, 64)
    assert loss_tokens(out, tokenizer) == ["b", "a", "</s>"]


# A tool-calling conversation in transformers' (and OpenAI's) chat format: the row's tools, a call without content,
# the tool's result, the answer.
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_CHAT = {"messages": [{"role": "user", "content": "Paris?"}, {"role": "assistant", "tool_calls": [CALL]},
                          {"role": "tool", "content": '{"temp": 20}'}, {"role": "assistant", "content": "20 C."}],
             "tools": TOOLS}


def test_tool_calls_and_answers_are_learnt_with_the_tools_and_results_in_the_prompt():
    llama = char_tokenizer(LLAMA32_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>",
                           ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"])
    qwen = ["<|im_end|>", "<|im_start|>", "<|endoftext|>"]
    calls = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
    cases = [  # tokenizer, the turns that carry loss, how the template writes the tool's result
        (llama, ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', "20 C.<|eot_id|>"],
         '<|start_header_id|>ipython<|end_header_id|>\n\n"{\\"temp\\": 20}"<|eot_id|>'),  # a JSON string: escaped
        (char_tokenizer(QWEN25_TEMPLATE, None, "<|im_end|>", qwen), [calls, "20 C.<|im_end|>\n"],
         '<|im_start|>user\n<tool_response>\n{"temp": 20}\n</tool_response><|im_end|>\n'),
        # Qwen3 writes the empty think block into the last turn only: the call is found without one.
        (char_tokenizer(QWEN3_TEMPLATE, None, "<|im_end|>", qwen), [calls, "<think>\n\n</think>\n\n20 C.<|im_end|>\n"],
         '<|im_start|>user\n<tool_response>\n{"temp": 20}\n</tool_response><|im_end|>\n'),
    ]
    for tokenizer, turns, result in cases:
        text, spans = render_with_loss_spans(TOOL_CHAT, "chat", tokenizer)
        assert [text[s:e] for s, e in spans] == turns
        assert '"description": "The weather of a city"' in text[:spans[0][0]]  # the row's tools, before the call
        assert text[spans[0][1]:spans[1][0]].startswith(result)
        out = tokenize_example(TOOL_CHAT, "chat", tokenizer, 1024)
        assert "".join(loss_tokens(out, tokenizer)) == "".join(turns)
        # OpenAI's format (arguments as a JSON string, content None) as Arrow reads it (every message has every key,
        # None where it has none): the same text and spans.
        call = {**TOOL_CHAT["messages"][1], "content": None,
                "tool_calls": [{**CALL, "function": {**CALL["function"], "arguments": '{"city": "Paris"}'}}]}
        others = [{"tool_calls": None, **message} for message in TOOL_CHAT["messages"]]
        arrow = {"messages": [others[0], call, *others[2:]],
                 "tools": [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": None}}]}
        assert render_with_loss_spans(arrow, "chat", tokenizer) == (text, spans)
        if tokenizer is not llama:  # Qwen's templates also take a call without its `function` wrapper
            bare = {**call, "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]}
            assert render_with_loss_spans({**TOOL_CHAT, "messages": [others[0], bare, *others[2:]]}, "chat",
                                          tokenizer) == (text, spans)
        # An empty tool_calls is no call (JSON exports give every message one).
        empty = {**TOOL_CHAT, "messages": [{"tool_calls": [], **message} for message in TOOL_CHAT["messages"]]}
        assert tokenize_example(empty, "chat", tokenizer, 1024) == out
        # Nor are empty tools any (a JSON export's []): Llama 3's template would write a tool header for them.
        for tools in ([], None):
            assert render_with_loss_spans({**CHAT, "tools": tools}, "chat", tokenizer) == render_with_loss_spans(
                CHAT, "chat", tokenizer)


def test_qwen3_answers_after_the_last_user_message_and_earlier_calls_with_reasoning_are_trained_as_the_chat_writes_them():
    """Qwen3's generation prompt writes the assistant turns since the last user message with a <think> block (their
    reasoning, an empty one into the message just before the prompt), which the whole chat drops from a turn before a
    later user message, and from an answer without reasoning that another follows: the prompt of a later turn differs
    from the whole chat there. Each turn is trained on what the whole chat writes of it."""
    tokenizer = char_tokenizer(QWEN3_TEMPLATE, None, "<|im_end|>", ["<|im_end|>", "<|im_start|>", "<|endoftext|>"])
    user, result = TOOL_CHAT["messages"][0], TOOL_CHAT["messages"][2]
    calls = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
    answer = lambda content, **fields: {"role": "assistant", "content": content, **fields}
    thanks = [{"role": "user", "content": "thanks"}, answer("ok")]
    cases = [  # the messages, the turns that carry loss, how many messages' reasoning is left out
        # Answers in a row: the first, without reasoning, has no think block in the whole chat. The newlines after a
        # reasoning_content, which the template strips, do not count it as left out.
        ([user, answer("ba"), answer("dc")], ["ba<|im_end|>\n", "<think>\n\n</think>\n\ndc<|im_end|>\n"], 0),
        # An answer that repeats the user's words: found after them, not in them.
        ([{"role": "user", "content": "ba"}, answer("ba"), answer("dc")],
         ["ba<|im_end|>\n", "<think>\n\n</think>\n\ndc<|im_end|>\n"], 0),
        ([user, answer("ba"), answer("dc", reasoning_content="flip\n\n"), answer("<think>turn</think>fe")],
         ["ba<|im_end|>\n", "<think>\nflip\n</think>\n\ndc<|im_end|>\n", "<think>\nturn\n</think>\n\nfe<|im_end|>\n"], 0),
        # After the last user message: a call keeps its reasoning, an answer without has none.
        ([user, answer("", tool_calls=[CALL], reasoning_content="need weather"), result, answer("", tool_calls=[CALL]),
          result, answer("20 C."), answer("<think>sure</think>Hot.")],
         ["<think>\nneed weather\n</think>\n\n" + calls, calls, "20 C.<|im_end|>\n",
          "<think>\nsure\n</think>\n\nHot.<|im_end|>\n"], 0),
        # A call with reasoning before a later user message: the whole chat drops the reasoning, the run counts it.
        ([user, answer("", tool_calls=[CALL], reasoning_content="need weather"), result, answer("20 C."), *thanks],
         [calls, "20 C.<|im_end|>\n", "<think>\n\n</think>\n\nok<|im_end|>\n"], 1),
        ([user, answer("<think>need weather</think>Looking.", tool_calls=[CALL]), result,
          answer("<think>hot</think>20 C."), *thanks],
         ["Looking.\n" + calls, "20 C.<|im_end|>\n", "<think>\n\n</think>\n\nok<|im_end|>\n"], 2),
    ]
    for messages, turns, left_out in cases:
        chat = {"messages": messages, "tools": TOOLS}
        text, spans = render_with_loss_spans(chat, "chat", tokenizer)
        assert text == tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
        assert [text[s:e] for s, e in spans] == turns
        out = tokenize_example(chat, "chat", tokenizer, 2048)
        assert tokenizer.decode([t for t in out["labels"] if t != IGNORE_INDEX]) == "".join(turns)
        assert out["reasoning_left_out"] == left_out
    # A prompt that differs from the whole chat outside the assistant turns is still refused: a template that writes
    # the system message before the last user message only.
    system_last = char_tokenizer(
        "{%- set ns = namespace(last=-1) %}{%- for m in messages if m.role == 'user' %}{%- set ns.last = loop.index0 %}"
        "{%- endfor %}{%- set ns.users = 0 %}{%- for m in messages %}{%- if m.role == 'user' %}"
        "{%- if ns.users == ns.last %}{%- for s in messages if s.role == 'system' %}"
        "{{- '<|im_start|>system\n' + s.content + '<|im_end|>\n' }}{%- endfor %}{%- endif %}"
        "{%- set ns.users = ns.users + 1 %}{%- endif %}{%- if m.role != 'system' %}"
        "{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}",
        None, "<|im_end|>", ["<|im_end|>", "<|im_start|>", "<|endoftext|>"])
    system = SYSTEM_CHAT["messages"][0]
    for messages in (SYSTEM_CHAT["messages"], [*CHAT["messages"][:2], system, *CHAT["messages"][2:], *thanks]):
        assert "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n" + messages[-2]["content"] in \
            system_last.apply_chat_template(messages, tokenize=False)
        with pytest.raises(ConfigError, match="renders a conversation differently from its prefixes"):
            render_with_loss_spans({"messages": messages}, "chat", system_last)


def test_tool_rows_read_from_parquet_give_the_tokens_of_the_json_lines(tmp_path):
    # Parquet holds one schema for all rows: every message gets a tool_calls (None), the call a content (None), and
    # a row without tools gets tools None.
    rows = [TOOL_CHAT, CHAT]
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "tools.parquet")
    stored = pyarrow.parquet.read_table(tmp_path / "tools.parquet").to_pylist()
    assert stored[0]["messages"][0]["tool_calls"] is None and stored[1]["tools"] is None
    demo.write_jsonl(tmp_path / "tools.jsonl", rows)
    tokenizer = char_tokenizer(QWEN25_TEMPLATE, None, "<|im_end|>", ["<|im_end|>", "<|im_start|>", "<|endoftext|>"])
    expected = [tokenize_example(row, "chat", tokenizer, 1024) for row in rows]
    for name in ("tools.parquet", "tools.jsonl"):
        train, _ = build_datasets(cfg(tmp_path / name, max_seq_length=1024), tokenizer)
        assert train["input_ids"] == [out["input_ids"] for out in expected]
        assert train["labels"] == [out["labels"] for out in expected]


def test_a_template_without_tools_or_bad_tool_rows_stop_with_the_row(tmp_path):
    calls_only = char_tokenizer("{% for m in messages %}{{ m.role + ': ' + m.content }}"
                                "{% for c in m.tool_calls or [] %}{{ c.function.name }}{% endfor %}{{ eos_token }}"
                                "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}",
                                None, "</s>", ["</s>"])
    for tokenizer, message in [(TOKENIZER, "the tool calls of message 1"), (calls_only, "the row's tools")]:
        demo.write_jsonl(tmp_path / "tools.jsonl", [CHAT, TOOL_CHAT])
        with pytest.raises(ConfigError, match=rf"tools.jsonl \[train\]: row 2 \(line 2\): the tokenizer's chat template leaves "
                                              rf"{message} out of the conversation: use a tokenizer_name_or_path whose "
                                              "chat template writes tools and tool calls"):
            build_datasets(cfg(tmp_path / "tools.jsonl"), tokenizer)
    messages = TOOL_CHAT["messages"]
    # Dropped calls are found by their names, which may stand elsewhere in the conversation too.
    mentioned = {"messages": [{"role": "system", "content": "call get_weather"}, *messages]}
    with pytest.raises(ConfigError, match=r"^row 1: the tokenizer's chat template leaves the tool calls of message 2 "
                                          r"out of the conversation"):
        tokenize_example(mentioned, "chat", char_tokenizer(DEFAULT_CHAT_TEMPLATE, None, "</s>", ["</s>"]), 1024)
    # Llama 3's template drops the text beside a call, and Phi-3.5's drops tool messages.
    beside = {**TOOL_CHAT, "messages": [messages[0], {**messages[1], "content": "Let me look."}, *messages[2:]]}
    llama = char_tokenizer(LLAMA32_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>",
                           ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"])
    phi = char_tokenizer(PHI35_TEMPLATE, "<s>", "<|endoftext|>", ["<s>", "<|endoftext|>", "<|end|>"])
    for tokenizer, row, error in [
            (llama, beside, r"message 1 \(assistant\) out of the conversation: leave out the text beside its "
                            r"tool calls"),
            (phi, TOOL_CHAT, r"message 2 \(tool\) out of the conversation: use a tokenizer_name_or_path whose chat "
                             r"template writes tool messages")]:
        with pytest.raises(ConfigError, match=r"^row 1: the tokenizer's chat template leaves " + error):
            tokenize_example(row, "chat", tokenizer, 1024)
    for row, error in [
        ({"messages": [{**messages[0], "tool_calls": [CALL]}] + messages[1:]},
         r"row 1: message 0: 'tool_calls' must be a list of calls \(\{function: \{name, arguments\}\}\) of an "
         r"assistant message"),
        ({"messages": [messages[0], {**messages[1], "tool_calls": [{"function": {"arguments": {}}}]}]},
         r"row 1: message 1: 'tool_calls' must be a list of calls"),
        ({**TOOL_CHAT, "tools": "get_weather"}, r"row 1: 'tools' must be a list of function definitions"),
        ({**TOOL_CHAT, "tools": ["get_weather"]}, r"row 1: 'tools' must be a list of function definitions"),
        ({"messages": [messages[0], {"role": "assistant", "content": "20 C.", "reasoning_content": ["sunny"]}]},
         r"row 1: message 1: 'reasoning_content' must be a string"),
        ({"prompt": "a", "completion": "b", "tools": TOOLS}, r"row 1: a 'tools' column is read with chat data \(a "
                                                             r"'messages' column\) only, and this data set is read as "
                                                             r"prompt_completion"),
        ({"messages": [messages[0], {**messages[1], "tool_calls": [
            {"function": {"name": "get_weather", "arguments": "city=Paris"}}]}]},
         r"row 1: message 1: the arguments of tool call 'get_weather' are a string that is not JSON \(Expecting "
         r"value\): give them as an object, or as a JSON string of one"),
    ]:
        with pytest.raises(ConfigError, match=error):
            tokenize_example(row, detect_format(list(row)), char_tokenizer(QWEN25_TEMPLATE, None, "<|im_end|>",
                                                                           ["<|im_end|>"]), 1024)


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2's, Llama 3's and Qwen's kind of tokenizer: a word's token holds the space before it ('Ġyes')."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["Question: is the sky blue? Answer: yes it is. no it is not."] * 50, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = ("{% for m in messages %}{{ m.role + ': ' + m.content + '</s>' }}{% endfor %}"
                               "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    return tokenizer


def test_an_answer_after_the_prompts_trailing_space_carries_loss_on_its_first_word():
    tokenizer = byte_level_tokenizer()
    for prompt, completion in [("Question: is the sky blue? Answer: ", "yes"),
                               ("Question: is the sky blue? Answer:", " yes")]:
        out = tokenize_example({"prompt": prompt, "completion": completion}, "prompt_completion", tokenizer, 64)
        assert loss_tokens(out, tokenizer) == ["Ġyes", "</s>"]
    # Chat templates that end the generation prompt with a space ('assistant: ') give the same first token.
    chat = {"messages": [{"role": "user", "content": "is it?"}, {"role": "assistant", "content": "yes it is"}]}
    assert loss_tokens(tokenize_example(chat, "chat", tokenizer, 64), tokenizer) == ["Ġyes", "Ġit", "Ġis", "</s>"]


def test_a_conversation_that_opens_with_the_assistant_carries_loss_on_that_turn():
    chat = {"messages": [{"role": "assistant", "content": "hi"}] + CHAT["messages"][:2]}
    out = tokenize_example(chat, "chat", TOKENIZER, 64)
    assert TOKENIZER.decode(out["input_ids"]) == "<|assistant|>hi<|end|><|user|>ab<|end|><|assistant|>ba<|end|>"
    assert loss_tokens(out) == ["h", "i", "<|end|>", "b", "a", "<|end|>"]
    # The turn starts after the template's own text, which may hold the content's words (Llama 3's date header).
    tokenizer = char_tokenizer(LLAMA32_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>",
                               ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"])
    for content in ["Dec", ""]:
        text, spans = render_with_loss_spans({"messages": [{"role": "assistant", "content": content}]}, "chat",
                                             tokenizer)
        assert [text[s:e] for s, e in spans] == [f"{content}<|eot_id|>"]
    # A template that leaves out an opening answer: refused, not trained on the answers after it alone.
    skips_it = char_tokenizer("{% for m in messages %}{% if not (loop.first and m.role == 'assistant') %}{{ m.role + "
                              "': ' + m.content + eos_token }}{% endif %}{% endfor %}", None, "</s>", ["</s>"])
    with pytest.raises(ConfigError, match=r"^row 1: .* so assistant turns cannot be located"):
        tokenize_example(chat, "chat", skips_it, 64)


def test_a_template_whose_prompt_is_no_prefix_of_the_chat_is_refused_for_completion_only_loss():
    """Where the whole chat does not start as the prompt of its answer renders (here a header counts the messages),
    where the answer starts is not known: refused, not guessed."""
    tokenizer = char_tokenizer("{{ messages | length }} messages\n{% for m in messages %}{{ m.role + ': ' + m.content "
                               "+ eos_token }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}",
                               None, "</s>", ["</s>"])
    chat = {"messages": CHAT["messages"][:2]}
    with pytest.raises(ConfigError, match=r"^row 1: the tokenizer's chat template renders a conversation differently "
                                          r"from its prefixes, so assistant turns cannot be located: set "
                                          r"completion_only_loss false$"):
        tokenize_example(chat, "chat", tokenizer, 64)
    out = tokenize_example(chat, "chat", tokenizer, 64, completion_only_loss=False)
    assert "".join(loss_tokens(out, tokenizer)) == " messages\nuser: ab</s>assistant: ba</s>"  # after the first


def test_a_generation_prompt_unlike_the_turns_the_template_writes_is_refused():
    """A template whose generation prompt ('assistant: ') is not how it writes an answer's header ('bot: '): where a
    later answer starts is not known (an opening answer, found from its own header, is). Refused, not guessed."""
    tokenizer = char_tokenizer("{% for m in messages %}{{ ('bot' if m.role == 'assistant' else 'user') + ': ' + "
                               "m.content + eos_token }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}",
                               None, "</s>", ["</s>"])
    chat = {"messages": [{"role": "assistant", "content": "hi"}] + CHAT["messages"][:2]}
    assert render_with_loss_spans(chat, "chat", tokenizer, locate_turns=False)[0] == "bot: hi</s>user: ab</s>bot: ba</s>"
    with pytest.raises(ConfigError, match=r"^row 1: .* so assistant turns cannot be located: set completion_only_loss "
                                          r"false$"):
        tokenize_example(chat, "chat", tokenizer, 64)


def test_an_answer_closed_otherwise_when_rendered_last_is_refused_not_cut_before_its_closing():
    """A template that closes the last answer with the EOS and earlier ones with another token: an earlier answer,
    rendered as the last, does not show its closing in the chat. Refused, rather than trained without it."""
    tokenizer = char_tokenizer("{% for m in messages %}{{ m.role + ': ' + m.content }}{% if m.role == 'assistant' and "
                               "loop.last %}{{ eos_token }}{% else %}<eot>{% endif %}{% endfor %}"
                               "{% if add_generation_prompt %}assistant: {% endif %}", None, "</s>", ["</s>", "<eot>"])
    chat = {"messages": CHAT["messages"][:3]}
    assert tokenizer.apply_chat_template(chat["messages"], tokenize=False) == "user: ab<eot>assistant: ba<eot>user: cd<eot>"
    with pytest.raises(ConfigError, match=r"^row 1: .* so assistant turns cannot be located: set completion_only_loss "
                                          r"false$"):
        tokenize_example(chat, "chat", tokenizer, 64)


def test_an_answer_whose_tool_calls_only_an_earlier_turn_shows_is_refused_not_trained_without_them():
    """A template that writes an answer's tool calls only when a later message follows: rendered as the last message,
    the turn ends before its calls, which the chat holds. Refused, rather than trained on the text beside them."""
    tokenizer = char_tokenizer("{% for m in messages %}{{ m.role + ': ' + m.content }}{% if not loop.last %}"
                               "{% for c in m.tool_calls or [] %}{{ ' call ' + c.function.name }}{% endfor %}"
                               "{% endif %}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}assistant: "
                               "{% endif %}", None, "</s>", ["</s>"])
    messages = TOOL_CHAT["messages"]
    chat = {"messages": [messages[0], {**messages[1], "content": "Let me look."}, *messages[2:]]}
    assert "assistant: Let me look. call get_weather</s>tool:" in tokenizer.apply_chat_template(chat["messages"],
                                                                                                  tokenize=False)
    with pytest.raises(ConfigError, match=r"^row 1: .* so assistant turns cannot be located: set completion_only_loss "
                                          r"false$"):
        tokenize_example(chat, "chat", tokenizer, 1024)


def test_truncation_keeps_the_first_tokens():
    out = tokenize_example({"prompt": "abc", "completion": "defg"}, "prompt_completion", TOKENIZER, max_seq_length=5)
    assert tokens(out) == ["<|bos|>", "a", "b", "c", "d"] and out["overlong"]
    assert loss_tokens(out) == ["d"]
    # Exactly max_seq_length tokens is not overlong (overlong_examples drop keeps it).
    out = tokenize_example({"prompt": "abc", "completion": "d"}, "prompt_completion", TOKENIZER, max_seq_length=6)
    assert len(out["input_ids"]) == 6 and not out["overlong"]
    # Cut to its first token, an example has a label only where nothing is predicted: it has none (and is dropped).
    out = tokenize_example({"text": "abc"}, "text", TOKENIZER, max_seq_length=1)
    assert out["labels"] == out["input_ids"] and not out["has_labels"]
    assert tokenize_example({"text": "abc"}, "text", TOKENIZER, max_seq_length=2)["has_labels"]


def test_a_token_carries_loss_where_it_overlaps_a_span_found_by_bisection_not_per_span():
    # Tokens (char_start, char_end): one ending where the span starts, one straddling its start (' yes' after the
    # prompt's space), one inside, a zero-width one at the span's end (outside) and inside another; spans unsorted.
    offsets = [(0, 3), (2, 5), (5, 6), (8, 8), (12, 12), (20, 22)]
    assert overlaps_a_span(offsets, [(12, 14), (3, 8)]).tolist() == [False, True, True, False, True, False]
    assert overlaps_a_span(offsets, []).tolist() == [False] * 6
    # A span nested in a longer earlier one still counts that one's end.
    assert overlaps_a_span([(9, 10)], [(0, 12), (2, 4)]).tolist() == [True]
    # A 50-turn chat: each turn's answer and closing EOS, as a short chat marks them.
    turns = [{"role": role, "content": f"turn {i}"} for i in range(50) for role in ("user", "assistant")]
    out = tokenize_example({"messages": turns}, "chat", TOKENIZER, max_seq_length=4096)
    assert "".join(loss_tokens(out)) == "".join(f"turn {i}<|end|>" for i in range(50))


def test_formats_are_detected_from_columns_or_forced():
    assert detect_format(["messages", "id"]) == "chat"
    assert detect_format(["instruction", "input", "output"]) == "instruction"
    assert detect_format(["prompt", "completion"]) == "prompt_completion"
    assert detect_format(["text"]) == "text"
    # With the columns of several formats, the first in README's order: messages, instruction, prompt, text.
    every = ["text", "prompt", "completion", "instruction", "output", "messages"]
    assert [detect_format(every[:n]) for n in (6, 5, 3)] == ["chat", "instruction", "prompt_completion"]
    assert detect_format(["text", "prompt", "completion"], forced="text") == "text"
    # A forced format needs its columns too: without them tokenizing would fail on a missing key, row by row.
    with pytest.raises(ConfigError, match=r"^cannot read the data as chat: found the columns \['prompt', "
                                          r"'completion'\]; expected chat: messages \(rename with"):
        detect_format(["prompt", "completion"], forced="chat")
    with pytest.raises(ConfigError, match=r"found the columns \['question', 'answer'\]; expected chat: messages; "
                                          r"instruction: instruction, output; .*text: text"):
        detect_format(["question", "answer"])
    # A format needs all its columns: a prompt beside a `response`, not a completion, is no prompt_completion.
    with pytest.raises(ConfigError, match=r"^cannot read the data as any format: found the columns \['prompt', "
                                          r"'response'\]; expected chat"):
        detect_format(["prompt", "response"])


def test_collate_pads_to_the_longest_in_the_batch():
    batch = collate([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}], 0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert set(model_inputs(batch)) == {"input_ids", "attention_mask"}


def test_pack_restarts_positions_and_masks_the_first_label_of_each_example():
    # The last example's prompt (6, 7) carries no loss, and keeps none packed.
    examples = {"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]], "labels": [[1, 2, 3], [4, 5], [-100, -100, 8, 9]]}
    packed = pack_examples(pyarrow.table(examples), max_seq_length=6).to_pydict()
    assert packed["input_ids"] == [[1, 2, 3, 4, 5], [6, 7, 8, 9]]
    assert packed["position_ids"] == [[0, 1, 2, 0, 1], [0, 1, 2, 3]]
    assert packed["labels"] == [[-100, 2, 3, -100, 5], [-100, -100, 8, 9]]
    batch = collate([{k: v[i] for k, v in packed.items()} for i in range(2)], 0)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]  # padding: a segment of its own
    assert set(model_inputs(batch)) == {"input_ids", "position_ids"}
    flat = collate([{k: v[i] for k, v in packed.items()} for i in range(2)], 0, flatten=True)
    assert flat["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert flat["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert flat["labels"].tolist() == [[-100, 2, 3, -100, 5, -100, -100, 8, 9]]


def test_packed_rows_fill_max_seq_length_exactly_where_the_examples_fit():
    # Lengths 2+4, 3+3, 1+5 and 6 fit 6 exactly; the 2 left over starts the last row.
    lengths = [2, 4, 3, 3, 1, 5, 6, 2]
    ids = [list(range(100 * i, 100 * i + n)) for i, n in enumerate(lengths)]
    packed = pack_examples(pyarrow.table({"input_ids": ids, "labels": ids}), max_seq_length=6).to_pydict()
    assert [len(row) for row in packed["input_ids"]] == [6, 6, 6, 6, 2]
    assert [t for row in packed["input_ids"] for t in row] == [t for example in ids for t in example]  # in order
    assert packed["position_ids"] == [[0, 1, 0, 1, 2, 3], [0, 1, 2, 0, 1, 2], [0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5],
                                      [0, 1]]


def test_the_loader_concatenates_packed_rows_into_one_for_flash_attention_only():
    # Flash attention reads example boundaries from position_ids in a batch of one row alone; sdpa pads rows.
    rows = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "position_ids": [0, 1, 2]},
            {"input_ids": [4, 5], "labels": [-100, 5], "position_ids": [0, 1]}]
    for attn, input_ids, position_ids in [("flash_attention_2", [[1, 2, 3, 4, 5]], [[0, 1, 2, 0, 1]]),
                                          ("sdpa", [[1, 2, 3], [4, 5, 0]], [[0, 1, 2], [0, 1, 0]])]:
        config = cfg("unused", packing=True, attn_implementation=attn, per_device_train_batch_size=2)
        batch = next(iter(build_dataloader(datasets.Dataset.from_list(rows), config, TOKENIZER, 0, 1, False)))
        assert [batch["input_ids"].tolist(), batch["position_ids"].tolist()] == [input_ids, position_ids]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logits_equal_each_example_alone(tiny, attn):
    model = AutoModelForCausalLM.from_pretrained(tiny["model"], dtype=torch.float32, attn_implementation=attn).eval()
    model.config.use_cache = False  # as load_model does: transformers ignores position_ids for masking with a cache
    gen = torch.Generator().manual_seed(0)
    lengths = [7, 12, 5]
    examples = [torch.randint(5, len(TOKENIZER), (n,), generator=gen).tolist() for n in lengths]
    packed = pack_examples(pyarrow.table({"input_ids": examples, "labels": examples}), max_seq_length=20).to_pydict()
    assert [len(row) for row in packed["input_ids"]] == [19, 5]  # two rows: the second is padded
    batch = collate([{k: v[i] for k, v in packed.items()} for i in range(2)], TOKENIZER.pad_token_id)
    with torch.no_grad():
        packed_logits = model(**model_inputs(batch)).logits
        alone = [model(input_ids=torch.tensor([ex])).logits[0] for ex in examples]
        plain_causal = model(input_ids=batch["input_ids"]).logits  # attention crossing the boundary
        flat_logits = model(**model_inputs(collate([{k: v[i] for k, v in packed.items()} for i in range(2)],
                                                   TOKENIZER.pad_token_id, flatten=True))).logits
    pieces = [packed_logits[0, :7], packed_logits[0, 7:19], packed_logits[1, :5]]
    flat_pieces = [flat_logits[0, :7], flat_logits[0, 7:19], flat_logits[0, 19:]]
    deviation = max((p - a).abs().max().item() for p, a in zip(pieces + flat_pieces, alone + alone))
    print(f"{attn}: max |packed - alone| logit deviation {deviation:.2e}")
    assert deviation < 1e-5
    assert (plain_causal[0, 7:19] - alone[1]).abs().max() > 1e-2  # the check can fail
    # The loss sums agree too: no label is predicted across a boundary.
    alone_loss = sum(token_loss_sum(a[None], torch.tensor([ex])) for a, ex in zip(alone, examples))
    assert abs(token_loss_sum(packed_logits, batch["labels"]) - alone_loss) < 1e-4


SMALL = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
PACKING_MODELS = {
    # With dropout, which the check leaves out: the packed logits of two rows would differ by its draws alone.
    "llama": LlamaConfig(**SMALL, intermediate_size=128, num_key_value_heads=2, attention_dropout=0.5),
    # Tokens per expert depend on the first example: in one batch both rows' tokens share the experts' batches.
    "qwen3_moe": Qwen3MoeConfig(**SMALL, intermediate_size=128, num_key_value_heads=2, num_experts=8,
                                num_experts_per_tok=2, moe_intermediate_size=32, output_router_logits=True),
    "biogpt": BioGptConfig(**SMALL, intermediate_size=128),  # its mask is all ones: packing does not separate
    "opt": OPTConfig(**SMALL, ffn_dim=128, word_embed_proj_dim=64),
    "bloom": BloomConfig(vocab_size=300, hidden_size=64, n_layer=2, n_head=4),  # its mask ignores positions
    # Short convolutions carry the last tokens of an example into the next: a leak 2e-3 of attention's, refused.
    "lfm2": Lfm2Config(**SMALL, intermediate_size=128, num_key_value_heads=2, layer_types=["conv", "full_attention"]),
    # A Mamba layer and routed experts: a leak 6e-3 of attention's, which passed under the tenth experts were allowed.
    "jamba": JambaConfig(**SMALL, intermediate_size=128, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                         attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                         mamba_d_state=8, mamba_dt_rank=8),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_type", PACKING_MODELS)
def test_packing_is_refused_for_a_model_whose_packed_examples_see_each_other(model_type, dtype):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(PACKING_MODELS[model_type], attn_implementation="eager", dtype=dtype)
    model.config.use_cache = False  # as load_model does
    config = TrainConfig(model_name_or_path="unused", dataset_name="unused", attn_implementation="eager",
                         per_device_train_batch_size=2)
    if model_type in ("llama", "qwen3_moe"):
        for training in (False, True):
            check_packing_separates_examples(model.train(training), config, torch.device("cpu"))
            assert model.training == training  # left as it was found
        return
    with pytest.raises(ConfigError, match=rf"^packing: in this {model_type} model a packed example sees the example "
                                          r"before it in its sequence \(changing that example changes its logits by "
                                          r"up to [0-9.e-]+; [0-9.e-]+ with attention across the boundary\): its "
                                          r"attention does not separate examples by position_ids, or its layers "
                                          r"carry state across them. Set packing false$"):
        check_packing_separates_examples(model, config, torch.device("cpu"))


def test_packing_is_taken_by_a_model_in_which_no_example_sees_another():
    # Its attention's output zeroed, each token's logits read that token alone: the second example's change is 0,
    # packed or not, and 0 is no leak, though it is not below a thousandth of 0.
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(PACKING_MODELS["llama"], attn_implementation="eager")
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.data.zero_()
    config = TrainConfig(model_name_or_path="unused", dataset_name="unused", attn_implementation="eager")
    check_packing_separates_examples(model, config, torch.device("cpu"))


# Building data sets from files: rank 0 builds first, which needs a process group; a real 1-process one.
@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_reasoning_a_template_does_not_write_is_counted_and_reported(tmp_path, capsys):
    rows = [{"messages": [{"role": "user", "content": f"ab{i}"},
                          {"role": "assistant", "content": f"{i}ba", "reasoning_content": "swap" if i % 3 else None}]}
            for i in range(9)]
    demo.write_jsonl(tmp_path / "r.jsonl", rows)
    train, _ = build_datasets(cfg(tmp_path / "r.jsonl"), TOKENIZER)  # its template writes no reasoning
    assert set(train.column_names) == {"input_ids", "labels"}
    assert ("warning: " + str(tmp_path / "r.jsonl") + " [train]: the chat template leaves out the reasoning "
            "(reasoning_content, or a <think> block in the content) of 6 assistant messages, which are trained without "
            "it; to train on reasoning, use a tokenizer_name_or_path whose chat template writes it (Qwen3's, into the "
            "last turn)\n") in capsys.readouterr().out


def test_the_think_block_qwen3_drops_from_an_earlier_turns_content_is_counted_as_its_reasoning_content():
    """Without completion_only_loss, Qwen3's template drops the <think> block of a turn before the last user message
    from its content, as it drops a reasoning_content: both are counted, so that the run says so. The last turn's
    it writes."""
    tokenizer = char_tokenizer(QWEN3_TEMPLATE, None, "<|im_end|>", ["<|im_end|>", "<|im_start|>", "<|endoftext|>"])
    for earlier in ({"content": "<think>swap</think>ba"}, {"content": "ba", "reasoning_content": "swap"}):
        chat = {"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", **earlier},
                             {"role": "user", "content": "cd"},
                             {"role": "assistant", "content": "<think>flip</think>dc"}]}
        out = tokenize_example(chat, "chat", tokenizer, 256, completion_only_loss=False)
        text = tokenizer.decode(out["input_ids"])
        assert "swap" not in text and "<|im_start|>assistant\n<think>\nflip\n</think>\n\ndc<|im_end|>" in text
        assert out["reasoning_left_out"] == 1


def test_the_default_chat_template_is_given_for_chat_data_only(tmp_path, capsys):
    demo.write_jsonl(tmp_path / "chat.jsonl", [CHAT] * 4)
    demo.write_jsonl(tmp_path / "pc.jsonl", ROWS)
    for data, expected in [("chat.jsonl", DEFAULT_CHAT_TEMPLATE), ("pc.jsonl", None),
                           ("pc.jsonl,chat.jsonl", DEFAULT_CHAT_TEMPLATE)]:
        tokenizer = demo.build_tokenizer()
        tokenizer.chat_template = None
        build_datasets(cfg(",".join(str(tmp_path / name) for name in data.split(","))), tokenizer)
        assert tokenizer.chat_template == expected
        assert ("data: the tokenizer has no chat template; using the default" in capsys.readouterr().out) == bool(
            expected)
    # Samples through a chat template the run does not have: refused at start, not after training.
    tokenizer.chat_template = None
    with pytest.raises(ConfigError, match=r"^generation_prompts go through the tokenizer's chat template "
                                          r"\(generation_use_chat_template true\), and it has none: .*; set "
                                          r"generation_use_chat_template false to send the prompts as plain text$"):
        build_datasets(cfg(tmp_path / "pc.jsonl", generation_prompts=["a1"], generation_use_chat_template=True),
                       tokenizer)
    build_datasets(cfg(tmp_path / "pc.jsonl", generation_prompts=["a1"], generation_use_chat_template=False),
                   tokenizer)


def test_a_tokenizer_without_an_eos_token_is_refused_where_the_examples_end_with_it(tmp_path):
    demo.write_jsonl(tmp_path / "chat.jsonl", [CHAT] * 4)
    demo.write_jsonl(tmp_path / "pc.jsonl", ROWS)
    for data, template, fmt in [("pc.jsonl", DEFAULT_CHAT_TEMPLATE, "prompt_completion"), ("chat.jsonl", None, "chat")]:
        tokenizer = demo.build_tokenizer()
        tokenizer.eos_token, tokenizer.chat_template = None, template
        with pytest.raises(ConfigError) as error:
            build_datasets(cfg(tmp_path / data), tokenizer)
        assert str(error.value) == (
            f"{tmp_path / data} [train]: the tokenizer has no eos token, which ends every example of {fmt} data (and "
            f"every turn of the default chat template, for a tokenizer without one) so that the model learns to "
            f"stop: use a tokenizer_name_or_path that has one, or save the tokenizer with its eos_token set")
    # A chat template of its own closes the turns as it does.
    tokenizer = demo.build_tokenizer()
    tokenizer.eos_token, tokenizer.chat_template = None, GEMMA2_TEMPLATE
    train, _ = build_datasets(cfg(tmp_path / "chat.jsonl"), tokenizer)
    assert len(train) == 4


def test_samples_are_prompted_as_the_data_were_trained_unless_the_config_says(tmp_path):
    """A model trained on prompt/completion data never saw the chat template, even where its tokenizer has one."""
    demo.write_jsonl(tmp_path / "chat.jsonl", [CHAT] * 4)
    demo.write_jsonl(tmp_path / "pc.jsonl", ROWS)
    demo.write_jsonl(tmp_path / "instruction.jsonl", [{"instruction": "ab", "output": "ba"}] * 4)
    for data, expected in [("pc.jsonl", False), ("chat.jsonl", True), ("instruction.jsonl", True)]:
        run = cfg(tmp_path / data, generation_prompts=["a1"])
        build_datasets(run, demo.build_tokenizer())  # the demo tokenizer has a chat template
        assert run.generation_use_chat_template is expected
    run = cfg(tmp_path / "pc.jsonl", generation_prompts=["a1"], generation_use_chat_template=True)
    build_datasets(run, demo.build_tokenizer())
    assert run.generation_use_chat_template is True
    with pytest.raises(ConfigError, match=r"^generation_prompts: the data sets mix chat or instruction data .* set "
                                          r"generation_use_chat_template true or false"):
        build_datasets(cfg(f"{tmp_path}/pc.jsonl,{tmp_path}/chat.jsonl", generation_prompts=["a1"]),
                       demo.build_tokenizer())


def cfg(dataset_name, **kw) -> TrainConfig:
    return TrainConfig(model_name_or_path="unused", dataset_name=str(dataset_name), **{"max_seq_length": 64, **kw})


ROWS = [{"prompt": f"{'abcdefgh'[i % 8]}{i}", "completion": f" x{i}"} for i in range(40)]


def test_tokenizing_in_several_processes_gives_the_same_examples_and_errors(tmp_path):
    """dataset_num_proc splits the tokenization over processes: the same examples in the same order, and an error
    in a later process's rows names that row and its line."""
    rows = [CHAT if i % 3 else {"messages": [{"role": "user", "content": f"q{i}"},
                                             {"role": "assistant", "content": "a" * (i % 90)}]} for i in range(60)]
    demo.write_jsonl(tmp_path / "chats.jsonl", rows)
    one = build_datasets(cfg(tmp_path / "chats.jsonl", eval_fraction=0.1), TOKENIZER)
    three = build_datasets(cfg(tmp_path / "chats.jsonl", eval_fraction=0.1, dataset_num_proc=3), TOKENIZER)
    for split_one, split_three in zip(one, three):
        assert split_three.to_dict() == split_one.to_dict() and len(split_one) > 0
    demo.write_jsonl(tmp_path / "bad.jsonl", rows[:55] + [{"messages": [{"role": "user"}]}] + rows[56:])
    with pytest.raises(ConfigError, match=r"bad.jsonl \[train\]: row 56 \(line 56\): message 0 needs a string 'role'"):
        build_datasets(cfg(tmp_path / "bad.jsonl", dataset_num_proc=3), TOKENIZER)
    with pytest.raises(ConfigError, match="^dataset_num_proc must be at least 1 or unset, got 0$"):
        cfg(tmp_path / "chats.jsonl", dataset_num_proc=0)


def test_every_source_type_gives_the_same_examples(tmp_path):
    demo.write_jsonl(tmp_path / "d.jsonl", ROWS)
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    table = datasets.Dataset.from_list(ROWS)
    table.to_csv(tmp_path / "d.csv", index=False)
    table.to_parquet(tmp_path / "d.parquet")
    table.save_to_disk(tmp_path / "saved", num_shards=3)
    saved_files = sorted(p.name for p in (tmp_path / "saved").iterdir())
    (tmp_path / "folder").mkdir()
    demo.write_jsonl(tmp_path / "folder" / "part.jsonl", ROWS)
    # A folder of several file types: every file is read (load_dataset would read the jsonl files alone).
    (tmp_path / "mixed" / "more").mkdir(parents=True)
    demo.write_jsonl(tmp_path / "mixed" / "a.jsonl", ROWS[:10])
    datasets.Dataset.from_list(ROWS[10:25]).to_csv(tmp_path / "mixed" / "b.csv", index=False)
    demo.write_jsonl(tmp_path / "mixed" / "c.jsonl", ROWS[25:30])
    datasets.Dataset.from_list(ROWS[30:]).to_parquet(tmp_path / "mixed" / "more" / "d.parquet")
    # Compressed files, alone and in a folder beside an empty part file (as sharded exports write them).
    compressed = {"gz": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress,
                  "zst": zstandard.ZstdCompressor().compress}
    for extension, compress in compressed.items():
        (tmp_path / f"d.jsonl.{extension}").write_bytes(compress((tmp_path / "d.jsonl").read_bytes()))
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "part-0.csv.gz").write_bytes(gzip.compress((tmp_path / "d.csv").read_bytes()))
    (tmp_path / "parts" / "part-1.jsonl").write_text("")
    expected = [tokenize_example(r, "prompt_completion", TOKENIZER, 64)["input_ids"] for r in ROWS]
    for name in ["d.jsonl", "d.json", "d.csv", "d.parquet", "saved", "folder", "mixed", "parts",
                 *(f"d.jsonl.{extension}" for extension in compressed)]:
        train, eval_set = build_datasets(cfg(tmp_path / name), TOKENIZER)
        assert list(train["input_ids"]) == expected, name
        assert eval_set is None
    # The datasets cache holds the tokenized copies: a saved folder may be read-only, and stays as it was.
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == saved_files


def test_the_log_names_the_columns_no_format_reads(tmp_path, capsys):
    """Dolly's columns (instruction, context, response, category) mapped response=output alone: the instruction format
    reads instruction, input and output, and the context would be left out of every prompt without a word."""
    demo.write_jsonl(tmp_path / "dolly.jsonl", [{"instruction": "ab", "context": "cd", "response": "ba",
                                                 "category": "qa"}] * 4)
    build_datasets(cfg(tmp_path / "dolly.jsonl", dataset_column_mapping="response=output"), TOKENIZER)
    assert "dolly.jsonl [train]: 4 examples (instruction; columns not read: context, category), 0 longer" in (
        capsys.readouterr().out)
    build_datasets(cfg(tmp_path / "dolly.jsonl", dataset_column_mapping="response=output,context=input,category=x"),
                   TOKENIZER)
    assert "dolly.jsonl [train]: 4 examples (instruction; columns not read: x), 0 longer" in capsys.readouterr().out
    demo.write_jsonl(tmp_path / "chat.jsonl", [{**CHAT, "tools": None}] * 4)
    build_datasets(cfg(tmp_path / "chat.jsonl"), TOKENIZER)
    assert "chat.jsonl [train]: 4 examples (chat), 0 longer" in capsys.readouterr().out


def test_empty_compressed_parquet_csv_and_json_array_files_are_empty(tmp_path):
    """A compressed file of no rows is not 0 bytes (gzip's header alone is 20), nor is a Parquet file of no rows (its
    schema), a CSV file of a header alone or a JSON file of an empty array: alone each is empty, not a parse error
    ('StopIteration', 'BatchSize must be greater than 0'), and in a folder an empty part file, skipped, as sharded
    exports (Spark's, Dask's, pandas' to_json per partition) write them."""
    (tmp_path / "empty.jsonl.gz").write_bytes(gzip.compress(b""))
    datasets.Dataset.from_list(ROWS).select([]).to_parquet(tmp_path / "empty.parquet")
    (tmp_path / "empty.csv").write_text("prompt,completion\n")
    (tmp_path / "empty.json").write_text(" [\n]\n")
    (tmp_path / "blank.json").write_text("\n")  # no array at all: nothing to index
    (tmp_path / "empty.json.gz").write_bytes(gzip.compress(b"[]"))  # not empty once compressed, nor decompressed
    (tmp_path / "bom.json").write_bytes(codecs.BOM_UTF8 + b"\r\n[\r\n]\r\n")  # as Windows tools write UTF-8
    (tmp_path / "bom.jsonl").write_bytes(codecs.BOM_UTF8)  # 'Unexpected UTF-8 BOM', where a blank line is no row
    (tmp_path / "bom.jsonl.gz").write_bytes(gzip.compress(codecs.BOM_UTF8))
    for name in ("empty.jsonl.gz", "empty.parquet", "empty.csv", "empty.json", "blank.json", "empty.json.gz",
                 "bom.json", "bom.jsonl", "bom.jsonl.gz"):
        with pytest.raises(ConfigError, match=rf"^.*{name} is empty: it holds no examples$"):
            build_datasets(cfg(tmp_path / name), TOKENIZER)
    (tmp_path / "parts").mkdir()
    demo.write_jsonl(tmp_path / "parts" / "part-0.jsonl", ROWS)
    shutil.copy(tmp_path / "empty.jsonl.gz", tmp_path / "parts" / "part-1.jsonl.gz")
    shutil.copy(tmp_path / "empty.parquet", tmp_path / "parts" / "part-2.parquet")
    shutil.copy(tmp_path / "empty.csv", tmp_path / "parts" / "part-3.csv")
    shutil.copy(tmp_path / "empty.json", tmp_path / "parts" / "part-00.json")  # read first: no schema to join
    shutil.copy(tmp_path / "bom.jsonl", tmp_path / "parts" / "part-4.jsonl")
    train, _ = build_datasets(cfg(tmp_path / "parts"), TOKENIZER)
    assert train["input_ids"] == [tokenize_example(r, "prompt_completion", TOKENIZER, 64)["input_ids"] for r in ROWS]
    assert data_sources.folder_summary(str(tmp_path / "parts"), "train", None) == "train: part-0.jsonl"


def test_a_data_folder_joins_parquet_files_of_large_strings_and_lists_with_json_lines(tmp_path):
    # pandas 3 writes a string column as large_string, Polars every string and list as large_string and large_list;
    # JSON lines and CSV are read as string and list.
    (tmp_path / "prompts").mkdir()
    demo.write_jsonl(tmp_path / "prompts" / "a.jsonl", ROWS[:20])
    large = pyarrow.schema([("prompt", pyarrow.large_string()), ("completion", pyarrow.large_string())])
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(ROWS[20:], schema=large), tmp_path / "prompts" / "b.parquet")
    train, _ = build_datasets(cfg(tmp_path / "prompts"), TOKENIZER)
    assert train["input_ids"] == [tokenize_example(r, "prompt_completion", TOKENIZER, 64)["input_ids"] for r in ROWS]
    (tmp_path / "chats").mkdir()
    demo.write_jsonl(tmp_path / "chats" / "a.jsonl", [CHAT])
    message = pyarrow.struct([("role", pyarrow.large_string()), ("content", pyarrow.large_string())])
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist([CHAT], schema=pyarrow.schema(
        [("messages", pyarrow.large_list(message))])), tmp_path / "chats" / "b.parquet")
    train, _ = build_datasets(cfg(tmp_path / "chats"), TOKENIZER)
    assert train["input_ids"] == [tokenize_example(CHAT, "chat", TOKENIZER, 64)["input_ids"]] * 2


def test_a_data_folder_joins_files_whose_columns_come_in_another_order_and_names_a_split_of_empty_files(tmp_path):
    (tmp_path / "parts").mkdir()
    demo.write_jsonl(tmp_path / "parts" / "a.jsonl", ROWS[:1])
    demo.write_jsonl(tmp_path / "parts" / "b.jsonl", [{"completion": "d", "prompt": "c"}])  # as another tool wrote it
    assert list(load_split(str(tmp_path / "parts"), None, "train")) == [ROWS[0], {"prompt": "c", "completion": "d"}]
    # Every part file empty: the first one is named, as a single empty file is.
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "part-0.jsonl").write_text("")
    (tmp_path / "empty" / "part-1.jsonl.gz").write_bytes(gzip.compress(b""))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(tmp_path / 'empty' / 'part-0.jsonl'))} is empty: it holds "
                                          r"no examples$"):
        load_split(str(tmp_path / "empty"), None, "train")


def test_a_json_lines_file_saved_with_a_byte_order_mark_holds_its_rows(tmp_path):
    # Windows tools write UTF-8 with a byte order mark: the mark alone is an empty file, the mark and a row are not.
    (tmp_path / "bom.jsonl").write_bytes(codecs.BOM_UTF8 + json.dumps(ROWS[0]).encode() + b"\n")
    assert list(load_split(str(tmp_path / "bom.jsonl"), None, "train")) == [ROWS[0]]


def test_csv_cells_are_read_as_the_text_they_hold(tmp_path):
    (tmp_path / "d.csv").write_text('prompt,completion\n"what is 7? ","007"\nsay none,None\nsay na,NA\n')
    assert list(load_split(str(tmp_path / "d.csv"), None, "train")) == [
        {"prompt": "what is 7? ", "completion": "007"}, {"prompt": "say none", "completion": "None"},
        {"prompt": "say na", "completion": "NA"}]
    # As pandas writes and reads them: an index column, Excel's byte-order mark, a blank first line.
    for header in [",prompt,completion\n0,", "\ufeffprompt,completion\n", "\nprompt,completion\n"]:
        (tmp_path / "e.csv").write_text(header + "a,7\n", encoding="utf-8")
        assert list(load_split(str(tmp_path / "e.csv"), None, "train"))[0] | {"Unnamed: 0": "0"} == {
            "Unnamed: 0": "0", "prompt": "a", "completion": "7"}
    # In a folder too.
    (tmp_path / "folder").mkdir()
    shutil.copy(tmp_path / "d.csv", tmp_path / "folder" / "part.csv")
    assert list(load_split(str(tmp_path / "folder"), None, "train"))[0] == {"prompt": "what is 7? ",
                                                                           "completion": "007"}
    # A comma left unquoted in the first row: pandas would take its first cell for an index column and shift every
    # row's columns by one; a row with a cell too few would read as an empty completion.
    # A cell longer than the csv module's default limit, a line of spaces, quoted line breaks (Windows' too).
    (tmp_path / "g.csv").write_text("prompt,completion\n" + "a" * 200_000 + ",b\n   \n\"two\r\nlines\",c\r\n")
    assert [len(row["prompt"]) for row in load_split(str(tmp_path / "g.csv"), None, "train")] == [200_000, 10]
    for row, line in [("translate: hello, world,bonjour\nsay hi,hi\n", 2), ("say hi,hi\nsay ho\n", 3),
                      ("say hi,hi\n\"two\nlines\",x,y\n", 3)]:  # the line where the row starts
        (tmp_path / "f.csv").write_text("prompt,completion\n" + row)
        with pytest.raises(ConfigError, match=rf"^cannot parse .*f.csv, line {line}: . fields, the header has 2 "
                                              r"\(quote a cell that holds a comma: \"a, b\"\)$"):
            load_split(str(tmp_path / "f.csv"), None, "train")


def test_json_lines_past_datasets_first_10_mb_keep_their_values_and_types(tmp_path):
    # datasets reads JSON lines in 10 MB pieces, with the column types of the first piece: the rows after it were
    # cast to them (5 to '5', content parts to their JSON text, every string of such a column quoted) or refused.
    long = "a" * 100_000
    first_piece = [{"messages": [{"role": "user", "content": long}, {"role": "assistant", "content": "b"}]}] * 110
    parts = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant",
                                                             "content": [{"type": "text", "text": "hi"}]}]}
    call = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}
    for name, late in [("parts", parts), ("call", call)]:
        demo.write_jsonl(tmp_path / f"{name}.jsonl", first_piece + [late])
        rows = load_split(str(tmp_path / f"{name}.jsonl"), None, "train")
        assert (len(rows), rows[0], rows[-1]) == (111, first_piece[0], late)
    with pytest.raises(ConfigError, match=r"^row 111: message 1 needs a string 'role' and a string 'content'"):
        tokenize_example(load_split(str(tmp_path / "parts.jsonl"), None, "train")[-1], "chat", TOKENIZER, 64, row=111)
    # A column null all through the first piece, a number after it.
    first_piece = [{"instruction": long, "input": None, "output": "b"}] * 110
    late = [{"instruction": "i", "input": "x", "output": "b"}, {"instruction": "i", "input": None, "output": 5}]
    with gzip.open(tmp_path / "late.jsonl.gz", "wt") as f:  # compressed: its size is no guide to the piece
        f.writelines(json.dumps(row) + "\n" for row in first_piece + late)
    rows = load_split(str(tmp_path / "late.jsonl.gz"), None, "train")
    assert (len(rows), rows[0], rows[-2], rows[-1]) == (112, first_piece[0], *late)
    # A local copy of a Hub data set (its card names the config's files) goes through load_dataset(name, config).
    (tmp_path / "copy" / "main").mkdir(parents=True)
    shutil.copy(tmp_path / "parts.jsonl", tmp_path / "copy" / "main" / "train.jsonl")
    (tmp_path / "copy" / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train.jsonl\n---\n")
    assert load_split(str(tmp_path / "copy"), "main", "train")[-1] == parts


def test_a_json_lines_file_over_2_gib_is_read_in_pieces_that_pyarrow_takes(tmp_path):
    # pyarrow's JSON reader takes a piece of at most 2 GiB (an int32 block size): read in one piece, a 2.1 GB file
    # that datasets' 10 MB pieces loaded stopped with "cannot parse <file>, value too large to convert to int32_t".
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:
        f.truncate(2**31 + 1)  # sparse: no disk taken, and only its size is read
    assert data_sources._json_chunksize(str(big)) == 1 << 30
    # datasets' block is the piece and the rest of its last line: well within pyarrow's int32.
    assert pyarrow.json.ReadOptions(block_size=(1 << 30) + (1 << 29)).block_size == 3 << 29
    with gzip.open(tmp_path / "small.jsonl.gz", "wb") as f:
        f.write(b'{"text": "a"}\n' * 1000)
    assert data_sources._json_chunksize(str(tmp_path / "small.jsonl.gz")) == 14_000


def test_a_compressed_files_size_and_a_csv_files_widths_are_found_once_not_on_every_run(tmp_path, monkeypatch):
    # It keys datasets' cache entry, and finding it decompresses up to 1 GiB: remembered per path, size and mtime.
    # (The files' bytes are replaced under the same size and mtime: what is read again would fail.)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "a.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write(b'{"text": "a"}\n' * 1000)
    assert data_sources._json_chunksize(str(path)) == 14_000
    stat = path.stat()
    path.write_bytes(b"\0" * stat.st_size)  # no gzip: decompressed, it would fail
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert data_sources._json_chunksize(str(path)) == 14_000
    with gzip.open(path, "wb") as f:  # written again: another size and modification time
        f.write(b'{"text": "b"}\n' * 10)
    assert data_sources._json_chunksize(str(path)) == 140
    # So is a CSV file's check that each row has the header's fields, a Python read of the whole file.
    csv_path = tmp_path / "a.csv"
    csv_path.write_text("prompt,completion\na,b\n")
    data_sources._csv_as_text(str(csv_path))
    stat = csv_path.stat()
    csv_path.write_text("prompt,completio\na,b,\n")  # a field more in the same size, which the check would refuse
    os.utime(csv_path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    data_sources._csv_as_text(str(csv_path))
    csv_path.write_text("prompt,completion\na,b,\n")
    with pytest.raises(ConfigError, match="line 2: 3 fields, the header has 2"):
        data_sources._csv_as_text(str(csv_path))


def test_a_data_files_remembered_facts_are_its_own_not_those_of_a_file_of_the_same_size_and_time(tmp_path, monkeypatch):
    # Shards unpacked from an archive share their modification time, and CSV files of a few rows often their size.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    (tmp_path / "good").mkdir()
    (tmp_path / "bad").mkdir()
    (tmp_path / "good" / "a.csv").write_text("prompt,completion\na,b\n")
    (tmp_path / "bad" / "a.csv").write_text("prompt,completio\na,b,\n")  # the same size, a field too many
    stat = (tmp_path / "good" / "a.csv").stat()
    os.utime(tmp_path / "bad" / "a.csv", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    data_sources._csv_as_text(str(tmp_path / "good" / "a.csv"))
    with pytest.raises(ConfigError, match="line 2: 3 fields, the header has 2"):
        data_sources._csv_as_text(str(tmp_path / "bad" / "a.csv"))


def test_a_local_copy_of_a_hub_data_set_takes_its_config_name(tmp_path):
    write_multi_config_copy(tmp_path / "copy")
    train, _ = build_datasets(cfg(tmp_path / "copy", dataset_config_name="socratic"), TOKENIZER)
    assert [TOKENIZER.decode(ids) for ids in train["input_ids"]] == [f"<|bos|>s{i}x<|end|>" for i in range(8)]


def test_a_mixture_takes_a_config_name_and_splits_per_data_set(tmp_path):
    write_multi_config_copy(tmp_path / "copy")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:30]),
                          "test": datasets.Dataset.from_list(ROWS[30:])}).save_to_disk(tmp_path / "dict")
    mixture = f"{tmp_path}/dict,{tmp_path}/copy"
    # The Hub copy's config only; the first 4 rows of one and 2 of the other; the held-out split of the first only.
    train, eval_set = build_datasets(cfg(mixture, dataset_config_name=",socratic", dataset_split="train[:4],train[:2]",
                                         eval_split="test,"), TOKENIZER)
    ids = lambda rows: [tokenize_example(r, "prompt_completion", TOKENIZER, 64)["input_ids"] for r in rows]
    socratic = [{"prompt": f"s{i}", "completion": "x"} for i in range(2)]
    assert (list(train["input_ids"]), list(eval_set["input_ids"])) == (ids(ROWS[:4] + socratic), ids(ROWS[30:]))
    for config, message in [
        (cfg(mixture, dataset_config_name="socratic"),
         f"dataset_config_name socratic is for a Hub data set (or a local copy of one); {tmp_path}/dict is a "
         f"save_to_disk folder: remove dataset_config_name, or in a mixture give one per data set, empty for this one "
         f"(such as ',main')"),
        (cfg(mixture, dataset_config_name=",main,main"),
         "dataset_config_name has 3 comma-separated values for 2 data sets in dataset_name: give one for all of them, "
         "or one per data set"),
        (cfg(mixture, dataset_config_name=",main", dataset_split="train,"),
         f"dataset_split gives no split for {tmp_path}/copy: name one for each data set"),
    ]:
        with pytest.raises(ConfigError) as error:
            build_datasets(config, TOKENIZER)
        assert str(error.value) == message


def test_eval_split_given_or_carved_with_a_fixed_seed(tmp_path):
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:30]),
                          "test": datasets.Dataset.from_list(ROWS[30:])}).save_to_disk(tmp_path / "dict")
    train, eval_set = build_datasets(cfg(tmp_path / "dict", eval_split="test"), TOKENIZER)
    assert (len(train), len(eval_set)) == (30, 10)

    demo.write_jsonl(tmp_path / "d.jsonl", ROWS)
    train, eval_set = build_datasets(cfg(tmp_path / "d.jsonl", eval_fraction=0.25), TOKENIZER)
    again_train, again_eval = build_datasets(cfg(tmp_path / "d.jsonl", eval_fraction=0.25), TOKENIZER)
    assert (len(train), len(eval_set)) == (30, 10)
    assert list(eval_set["input_ids"]) == list(again_eval["input_ids"])
    assert list(train["input_ids"]) == list(again_train["input_ids"])
    _, other_eval = build_datasets(cfg(tmp_path / "d.jsonl", eval_fraction=0.25, seed=7), TOKENIZER)
    assert sorted(eval_set["input_ids"]) != sorted(other_eval["input_ids"])  # drawn by the seed
    all_ids = sorted(map(tuple, list(train["input_ids"]) + list(eval_set["input_ids"])))
    assert all_ids == sorted(tuple(tokenize_example(r, "prompt_completion", TOKENIZER, 64)["input_ids"]) for r in ROWS)


def test_eval_fraction_holds_out_the_share_written():
    """In floats 100 x 0.29 is 28.999999999999996 and 100 x 0.57 is 56.99999999999999: one example too few."""
    rows = datasets.Dataset.from_dict({"x": list(range(100))})
    for fraction, held_out in [(0.29, 29), (0.57, 57), (0.05, 5), (0.333, 33), (0.999, 99)]:
        train, eval_set = carve_eval(rows, fraction, 0, "rows")
        assert (len(train), len(eval_set)) == (100 - held_out, held_out)


def test_an_eval_fraction_that_holds_out_no_example_is_refused():
    rows = datasets.Dataset.from_dict({"x": list(range(40))})
    with pytest.raises(ConfigError) as error:
        carve_eval(rows, 0.02, 0, "d.jsonl")  # 0.8 of an example, rounded down
    assert str(error.value) == "eval_fraction=0.02 of the 40 examples of d.jsonl leaves an empty train or eval split"


def test_split_slices_select_rows_of_files_and_saved_folders(tmp_path):
    demo.write_jsonl(tmp_path / "d.jsonl", ROWS)
    datasets.Dataset.from_list(ROWS).save_to_disk(tmp_path / "single")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:30]),
                          "test": datasets.Dataset.from_list(ROWS[30:])}).save_to_disk(tmp_path / "dict")
    ids = lambda rows: [tokenize_example(r, "prompt_completion", TOKENIZER, 64)["input_ids"] for r in rows]
    train, _ = build_datasets(cfg(tmp_path / "d.jsonl", dataset_split="train[:10]"), TOKENIZER)
    assert list(train["input_ids"]) == ids(ROWS[:10])
    train, eval_set = build_datasets(cfg(tmp_path / "d.jsonl", dataset_split="train[:75%]",
                                         eval_split="train[75%:]"), TOKENIZER)
    assert (list(train["input_ids"]), list(eval_set["input_ids"])) == (ids(ROWS[:30]), ids(ROWS[30:]))
    train, _ = build_datasets(cfg(tmp_path / "single", dataset_split="train[:5]+train[-3:]"), TOKENIZER)
    assert list(train["input_ids"]) == ids(ROWS[:5] + ROWS[-3:])
    train, eval_set = build_datasets(cfg(tmp_path / "dict", dataset_split="train[10:20]+test",
                                         eval_split="train[:5]+train[25:]"), TOKENIZER)
    assert (list(train["input_ids"]), list(eval_set["input_ids"])) == (ids(ROWS[10:20] + ROWS[30:]),
                                                                         ids(ROWS[:5] + ROWS[25:30]))
    # Rows the training split also selects are not held out: refused, with the number shared.
    for path, split, eval_split, shared in [("d.jsonl", "train", "train[90%:]", 4),
                                            ("single", "train[:80%]", "train[75%:]", 2),
                                            ("dict", "train[10:20]+test", "test[:50%]", 5),
                                            ("dict", "train", "train", 30),
                                            ("d.jsonl", "train[:50%]+train[:50%]", "train[40%:60%]", 4),
                                            ("d.jsonl", "train[:50%]+train[10%:20%]", "train[40%:60%]", 4)]:
        with pytest.raises(ConfigError) as error:
            build_datasets(cfg(tmp_path / path, dataset_split=split, eval_split=eval_split), TOKENIZER)
        assert str(error.value) == (
            f"{tmp_path / path}: eval_split '{eval_split}' and dataset_split '{split}' share {shared} rows, which the "
            f"evaluation would report as held out: give disjoint slices (dataset_split 'train[:90%]' with eval_split "
            f"'train[90%:]'), or hold out a random share with eval_fraction")
    with pytest.raises(ConfigError, match=r"dict: eval_split 'all' and dataset_split 'train\[:5\]' share rows \('all' "
                                          r"is every split\)"):
        build_datasets(cfg(tmp_path / "dict", dataset_split="train[:5]", eval_split="all"), TOKENIZER)


def test_an_eval_split_that_shares_a_single_row_or_names_all_is_refused(tmp_path):
    """The held-out check counts every shared row: one row, a training slice written after the one it overlaps,
    a split name spaced around '+', and 'all' on either side (every split, the held-out one among them); and it reads
    a Hub copy's splits with its config."""
    demo.write_jsonl(tmp_path / "d.jsonl", ROWS)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:30]),
                          "test": datasets.Dataset.from_list(ROWS[30:])}).save_to_disk(tmp_path / "dict")
    for path, split, eval_split, shared in [("d.jsonl", "train[:21]", "train[20:]", "1 row"),
                                            ("d.jsonl", "train[50%:]+train[:60%]", "train[:10%]", "4 rows"),
                                            ("dict", "train", "test + train[25:]", "5 rows"),
                                            ("dict", "all", "test", "rows ('all' is every split)")]:
        with pytest.raises(ConfigError) as error:
            data_sources.check_held_out(str(tmp_path / path), None, split, eval_split)
        assert str(error.value).startswith(f"{tmp_path / path}: eval_split '{eval_split}' and dataset_split '{split}' "
                                           f"share {shared}, which the evaluation would report as held out"), (
            str(error.value))
    data_sources.check_held_out(str(tmp_path / "d.jsonl"), None, "train[:20]", "train[20:]")  # adjacent: disjoint
    # A local copy of a Hub data set: its splits' lengths are read from the config named.
    write_multi_config_copy(tmp_path / "copy")
    data_sources.check_held_out(str(tmp_path / "copy"), "socratic", "train[:6]", "train[6:]")
    with pytest.raises(ConfigError, match=r"copy: eval_split 'train\[6:\]' and dataset_split 'train' share 2 rows"):
        data_sources.check_held_out(str(tmp_path / "copy"), "socratic", "train", "train[6:]")


def test_only_the_splits_named_are_read(tmp_path):
    """A split the run does not name is not read: a broken test file beside train.jsonl stops only a run that
    evaluates on it."""
    (tmp_path / "folder").mkdir()
    demo.write_jsonl(tmp_path / "folder" / "train.jsonl", ROWS)
    (tmp_path / "folder" / "test.jsonl").write_text('{"prompt": "a", "completion": "b"}\n{"prompt": \n')
    train, _ = build_datasets(cfg(tmp_path / "folder"), TOKENIZER)
    assert len(train) == len(ROWS)
    with pytest.raises(ConfigError, match=r"^cannot parse .*folder/test.jsonl, line 2: Expecting value$"):
        build_datasets(cfg(tmp_path / "folder", eval_split="test"), TOKENIZER)


def test_column_mapping_and_weighted_mixture(tmp_path, capsys):
    demo.write_jsonl(tmp_path / "a.jsonl", [{"text": f"a{i}"} for i in range(20)])
    demo.write_jsonl(tmp_path / "b.jsonl", [{"question": f"b{i}", "answer": "x"} for i in range(10)])
    train, _ = build_datasets(cfg(f"{tmp_path}/a.jsonl,{tmp_path}/b.jsonl", dataset_weights="0.5,2.5",
                                  dataset_column_mapping="question=prompt,answer=completion"), TOKENIZER)
    first = [TOKENIZER.convert_ids_to_tokens(ids[1]) for ids in list(train["input_ids"])]  # after <|bos|>
    assert (first.count("a"), first.count("b")) == (10, 25)
    # The log gives what each data set contributes after its weight.
    assert (f"data: mixture of {tmp_path}/a.jsonl x 0.5: 10 (28.6%), {tmp_path}/b.jsonl x 2.5: 25 (71.4%) training "
            f"examples\n") in capsys.readouterr().out
    b_texts = [TOKENIZER.decode(ids) for ids in train["input_ids"] if TOKENIZER.convert_ids_to_tokens(ids[1]) == "b"]
    assert all(b_texts.count(f"<|bos|>b{i}x<|end|>") in (2, 3) for i in range(10))  # 2 copies + 5 sampled


def test_mapping_weight_and_per_source_values_are_parsed_as_written():
    for mapping in ("question=", "=prompt", "question=prompt=completion", "question"):
        with pytest.raises(ConfigError) as error:
            data_sources.parse_column_mapping(mapping)
        assert str(error.value) == (f"dataset_column_mapping must look like 'question=prompt,answer=completion', "
                                    f"got '{mapping}'")
    assert data_sources.parse_column_mapping(" question = prompt,answer=completion") == {"question": "prompt",
                                                                                        "answer": "completion"}
    with pytest.raises(ConfigError, match=r"^dataset_weights must be positive numbers separated by commas, such as "
                                          r"'1,0.5', got '1,nan'$"):
        data_sources.parse_weights("1,nan")
    # A mixture's per-source values as written after commas: "a.jsonl, b.jsonl" with "train[:4], train[:2]".
    assert data_sources.per_source(" train[:4] , train[:2]", ["a", "b"], "dataset_split") == ["train[:4]", "train[:2]"]
    assert data_sources.per_source(", main", ["a", "b"], "dataset_config_name") == [None, "main"]


def test_a_mixture_holds_out_eval_fraction_of_each_data_set_before_its_weight(tmp_path):
    """README, Data: eval_fraction holds out its share of each data set; the weight then applies to the rest, not to
    the eval split, which holds no example of the training split."""
    demo.write_jsonl(tmp_path / "a.jsonl", [{"text": f"a{i}"} for i in range(20)])
    demo.write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}", "completion": "x"} for i in range(10)])
    train, eval_set = build_datasets(cfg(f"{tmp_path}/a.jsonl,{tmp_path}/b.jsonl", dataset_weights="0.5,3",
                                         eval_fraction=0.2), TOKENIZER)
    source = lambda split: [TOKENIZER.convert_ids_to_tokens(ids[1]) for ids in split["input_ids"]]  # after <|bos|>
    assert (source(train).count("a"), source(train).count("b")) == (8, 24)  # 0.5 x 16 and 3 x 8
    assert (source(eval_set).count("a"), source(eval_set).count("b")) == (4, 2)  # 0.2 x 20 and 0.2 x 10
    assert not {tuple(ids) for ids in train["input_ids"]} & {tuple(ids) for ids in eval_set["input_ids"]}


def test_column_mapping_may_swap_columns_and_renames_the_held_out_split_too(tmp_path):
    swapped = [{"prompt": row["completion"], "completion": row["prompt"]} for row in ROWS]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(swapped[:30]),
                          "test": datasets.Dataset.from_list(swapped[30:])}).save_to_disk(tmp_path / "dict")
    train, eval_set = build_datasets(cfg(tmp_path / "dict", eval_split="test",
                                         dataset_column_mapping="prompt=completion,completion=prompt"), TOKENIZER)
    ids = lambda rows: [tokenize_example(r, "prompt_completion", TOKENIZER, 64)["labels"] for r in rows]
    assert (list(train["labels"]), list(eval_set["labels"])) == (ids(ROWS[:30]), ids(ROWS[30:]))


def test_a_mixture_maps_each_data_sets_own_columns(tmp_path):
    # One mapping for data sets whose columns are named otherwise: each renames the columns it has.
    demo.write_jsonl(tmp_path / "a.jsonl", [{"q": "a0", "a": "x"}])
    demo.write_jsonl(tmp_path / "b.jsonl", [{"question": "b0", "answer": "y"}])
    names = [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    mapping = data_sources.parse_column_mapping("q=prompt,a=completion,question=prompt,answer=completion")
    sources = data_sources.load_sources(names, [None, None], ["train", "train"], [None, None], mapping)
    assert [(list(train), held_out) for train, held_out in sources] == [
        ([{"prompt": "a0", "completion": "x"}], None), ([{"prompt": "b0", "completion": "y"}], None)]


def test_a_weight_below_1_takes_a_subset_of_the_size_written_drawn_by_the_seed(tmp_path):
    demo.write_jsonl(tmp_path / "a.jsonl", [{"text": f"a{i}"} for i in range(20)])

    def kept(seed):  # the numbers of the examples kept, in the order trained
        train, _ = build_datasets(cfg(tmp_path / "a.jsonl", dataset_weights="0.38", seed=seed), TOKENIZER)
        return [int(TOKENIZER.decode(ids[2:-1])) for ids in train["input_ids"]]  # <|bos|>a<digits><|end|>

    subset = kept(seed=1)
    assert len(subset) == len(set(subset)) == 8  # round(0.38 x 20): 7.6 -> 8, none twice
    assert subset == kept(seed=1)
    assert sorted(subset) != sorted(kept(seed=2)) and sorted(subset) != list(range(8))  # drawn, by the seed


def test_each_data_set_of_a_mixture_draws_its_own_subset_and_held_out_examples(tmp_path):
    # Two halves of one file: drawn with one seed, they would keep and hold out the rows at the same positions.
    demo.write_jsonl(tmp_path / "a.jsonl", [{"text": f"a{i}"} for i in range(20)])
    halves = dict(dataset_name=f"{tmp_path}/a.jsonl,{tmp_path}/a.jsonl", dataset_split="train[:10],train[10:]")

    def positions(split):  # the positions in its half of each example of the split, per half
        numbers = [int(TOKENIZER.decode(ids[2:-1])) for ids in split["input_ids"]]  # <|bos|>a<digits><|end|>
        return sorted(x for x in numbers if x < 10), sorted(x - 10 for x in numbers if x >= 10)

    first, second = positions(build_datasets(cfg(**halves, dataset_weights="0.5,0.5"), TOKENIZER)[0])
    assert len(first) == len(second) == 5 and first != second
    first, second = positions(build_datasets(cfg(**halves, eval_fraction=0.3), TOKENIZER)[1])
    assert len(first) == len(second) == 3 and first != second


def test_a_weight_keeps_its_last_sampled_example():
    rows = datasets.Dataset.from_dict({"x": list(range(20))})
    for weight, copies in [(0.05, 0), (1.05, 1), (2.05, 2)]:  # whole copies, and one example drawn
        sampled = data_sources.weighted_sample(rows, weight, 0)["x"]
        assert sorted(sampled.count(x) for x in range(20)) == [copies] * 19 + [copies + 1]


def test_overlong_examples_are_truncated_or_dropped_and_counted(tmp_path, capsys):
    # 14 letters with <|bos|> and <|end|>: max_seq_length tokens exactly, which is not longer.
    demo.write_jsonl(tmp_path / "d.jsonl", [{"text": "a" * n} for n in (3, 10, 14, 30, 40)])
    train, _ = build_datasets(cfg(tmp_path / "d.jsonl", max_seq_length=16), TOKENIZER)
    assert [len(ids) for ids in list(train["input_ids"])] == [5, 12, 16, 16, 16]
    assert "2 longer than max_seq_length=16 (truncated)" in capsys.readouterr().out
    train, _ = build_datasets(cfg(tmp_path / "d.jsonl", max_seq_length=16, overlong_examples="drop"), TOKENIZER)
    assert [len(ids) for ids in list(train["input_ids"])] == [5, 12, 16]
    # Those dropped for their length are not counted again as dropped for having no label tokens.
    assert ("5 examples (text), 2 longer than max_seq_length=16 (dropped), 0 dropped for having no label tokens, "
            "3 kept") in capsys.readouterr().out


def test_the_counts_of_the_tokenized_rows_are_summed_without_reading_a_column_into_python(tmp_path, monkeypatch,
                                                                                          capsys):
    """Every rank, cache hit or not, summed the overlong and reasoning flags of each data set row by row in Python
    (dataset["overlong"]): 5 to 10 s for 300k rows, most of a cached start-up. Arrow sums them."""
    demo.write_jsonl(tmp_path / "d.jsonl", [{"text": "a" * n} for n in (3, 10, 30, 40)])
    columns_read = []
    getitem = datasets.Dataset.__getitem__

    def spy(self, key):
        if isinstance(key, str) and self.format["type"] != "arrow":  # a column as Python values
            columns_read.append(key)
        return getitem(self, key)

    monkeypatch.setattr(datasets.Dataset, "__getitem__", spy)
    build_datasets(cfg(tmp_path / "d.jsonl", max_seq_length=16), TOKENIZER)
    assert columns_read == []
    assert "4 examples (text), 2 longer than max_seq_length=16 (truncated)" in capsys.readouterr().out


def test_tokenization_runs_once_then_comes_from_the_cache(tmp_path, capfd, monkeypatch):
    demo.write_jsonl(tmp_path / "d.jsonl", ROWS)
    first, _ = build_datasets(cfg(tmp_path / "d.jsonl", packing=True), TOKENIZER)
    assert "Tokenizing" in capfd.readouterr().err  # the progress bar
    second, _ = build_datasets(cfg(tmp_path / "d.jsonl", packing=True), TOKENIZER)
    assert "Tokenizing" not in capfd.readouterr().err
    assert first.cache_files == second.cache_files and list(first["input_ids"]) == list(second["input_ids"])
    # Changed data code (another version of the project, an edited copy) does not read the old code's output.
    monkeypatch.setattr(data_module, "DATA_CODE_HASH", "another version")
    third, _ = build_datasets(cfg(tmp_path / "d.jsonl", packing=True), TOKENIZER)
    assert "Tokenizing" in capfd.readouterr().err
    assert first.cache_files != third.cache_files and list(first["input_ids"]) == list(third["input_ids"])


def test_the_tokenization_cache_key_holds_the_tokenizing_libraries_versions():
    """Another transformers, tokenizers or jinja2 (chat templates) may tokenize the same text otherwise."""
    code = b"".join((Path(data_module.__file__).parent / name).read_bytes()
                    for name in ("data.py", "data_formats.py", "data_sources.py"))
    installed = {name: importlib.metadata.version(name) for name in ("transformers", "tokenizers", "jinja2")}
    assert data_module.DATA_CODE_HASH == data_module.data_code_hash(code, installed)
    keys = {data_module.data_code_hash(code, {**installed, name: "0.0.1"}) for name in installed}
    assert len(keys) == 3 and data_module.DATA_CODE_HASH not in keys


def test_the_cache_holds_token_ids_labels_and_positions_as_int32(tmp_path):
    """Arrow typed the labels (and the packed positions) int64 from Python ints: twice the cache they need."""
    demo.write_jsonl(tmp_path / "d.jsonl", ROWS)
    int32_lists = datasets.List(datasets.Value("int32"))
    for packing, columns in ((False, ["input_ids", "labels"]), (True, ["input_ids", "labels", "position_ids"])):
        train, eval_set = build_datasets(cfg(tmp_path / "d.jsonl", packing=packing, eval_fraction=0.25), TOKENIZER)
        assert train.features == datasets.Features({column: int32_lists for column in columns})
        assert eval_set.features == datasets.Features({"input_ids": int32_lists, "labels": int32_lists})
        stored = train.data  # the rows on disk, of which train may be a selection
        tokens = pc.sum(pc.list_value_length(stored.column("input_ids"))).as_py()
        # At most an int32 per token and an int32 offset per row, in each column.
        assert stored.nbytes <= 4 * len(columns) * (tokens + stored.num_rows + 1)


def test_packing_writes_only_the_packed_sequences_into_the_cache(tmp_path):
    """The shuffled examples are packed through the shuffle's indices: flatten_indices first wrote a whole copy of
    the training set into the cache (its size again on disk, and one more pass over it), read only by the packing."""
    rows = [{"prompt": f"{'abcdefgh'[i % 8]}{i}", "completion": " x" * (i % 20)} for i in range(400)]
    demo.write_jsonl(tmp_path / "d.jsonl", rows)
    unpacked, _ = build_datasets(cfg(tmp_path / "d.jsonl"), TOKENIZER)
    folder = os.path.dirname(unpacked.cache_files[0]["filename"])
    before = set(os.listdir(folder))
    packed, _ = build_datasets(cfg(tmp_path / "d.jsonl", packing=True), TOKENIZER)
    written = {name: datasets.Dataset.from_file(os.path.join(folder, name)).column_names
               for name in set(os.listdir(folder)) - before if name.endswith(".arrow")}
    packed_file = os.path.basename(packed.cache_files[0]["filename"])
    # The packed table, and the shuffle's order (an index per example); no table of the examples themselves.
    assert sorted(written.values()) == [["indices"], ["input_ids", "labels", "position_ids"]]
    assert written[packed_file] == ["input_ids", "labels", "position_ids"]
    assert len(packed) < len(unpacked)
    # seed: TrainConfig's default
    expected = pack_examples(unpacked.shuffle(seed=42).with_format("arrow")[:], max_seq_length=64).to_pydict()
    assert [list(packed[key]) for key in expected] == list(expected.values())


@pytest.mark.parametrize("kind", ["file", "saved folder"])
def test_every_spelling_of_a_data_path_reads_the_same_cache(tmp_path, capfd, monkeypatch, kind):
    """datasets keyed its converted copy by the path as written, and the tokenization was keyed by dataset_name:
    ./d.jsonl, an absolute path, or a resume started from another directory converted and tokenized the data again
    (hours for millions of rows) and kept one more copy of them in the cache."""
    demo.write_jsonl(tmp_path / "d.jsonl", ROWS)
    if kind == "saved folder":
        datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "d"))
    name = "d.jsonl" if kind == "file" else "d"
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    first, _ = build_datasets(cfg(name), TOKENIZER)
    assert "Tokenizing" in capfd.readouterr().err
    spellings = [(tmp_path, f"./{name}"), (tmp_path, str(tmp_path / name)), (tmp_path / "sub", f"../{name}"),
                 (tmp_path / "sub", f"../sub/../{name}")]
    for folder, spelling in spellings:
        monkeypatch.chdir(folder)
        again, _ = build_datasets(cfg(spelling), TOKENIZER)
        err = capfd.readouterr().err
        assert "Generating train split" not in err and "Tokenizing" not in err, spelling
        assert again.cache_files == first.cache_files and list(again["input_ids"]) == list(first["input_ids"])


def test_the_same_tokenizer_from_another_path_reads_the_same_cache(tmp_path, capfd, monkeypatch):
    """datasets hashed the tokenizer with the path it was loaded from (name_or_path): the same tokenizer files in a
    copy (a checkpoint's, as a resume with another tokenizer is told to use) or the same folder spelled otherwise
    tokenized the data again. Another tokenizer still does."""
    demo.write_jsonl(tmp_path / "d.jsonl", ROWS)
    for folder in ("model", "copy"):
        TOKENIZER.save_pretrained(tmp_path / folder)
    monkeypatch.chdir(tmp_path)
    first, _ = build_datasets(cfg(tmp_path / "d.jsonl"), AutoTokenizer.from_pretrained("model"))
    assert "Tokenizing" in capfd.readouterr().err
    for path in ("./model", str(tmp_path / "copy")):
        again, _ = build_datasets(cfg(tmp_path / "d.jsonl"), AutoTokenizer.from_pretrained(path))
        assert "Tokenizing" not in capfd.readouterr().err, path
        assert again.cache_files == first.cache_files
    other = AutoTokenizer.from_pretrained("copy")
    other.add_tokens(["ab"])
    build_datasets(cfg(tmp_path / "d.jsonl"), other)
    assert "Tokenizing" in capfd.readouterr().err


def bad_input_cases(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c"\n')
    (tmp_path / "bad.json").write_text('[{"text": "a"},\n {"text": }]\n')
    shutil.copy(tmp_path / "bad.jsonl", tmp_path / "bad_lines.json")  # JSON lines, as Dataset.to_json writes them
    (tmp_path / "extra.json").write_text('[\n {"text": "a"}\n]\n]\n')  # a pretty-printed array, then extra data
    (tmp_path / "empty.jsonl").write_text("")
    # Lines joined from other files: a quoted string, an array; pyarrow says 'changed from object to string in row 0'.
    (tmp_path / "scalar.jsonl").write_text('{"text": "a"}\n\n"b"\n{"text": "c"}\n')
    (tmp_path / "array.jsonl").write_text('{"text": "a"}\n[{"text": "b"}]\n')
    (tmp_path / "bad.csv").write_text("prompt,completion\na,b\nc,d,e\n")
    demo.write_jsonl(tmp_path / "cols.jsonl", [{"question": "a", "answer": "b"}])
    demo.write_jsonl(tmp_path / "msgs.jsonl", [CHAT, {"messages": [{"role": "user", "content": 3}]}])
    demo.write_jsonl(tmp_path / "nolist.jsonl", [{"messages": []}])
    demo.write_jsonl(tmp_path / "sharegpt.jsonl", [{"messages": [{"role": "human", "content": "q"},
                                                                 {"role": "gpt", "content": "a"}]}] * 4)
    demo.write_jsonl(tmp_path / "ok.jsonl", ROWS)
    (tmp_path / "header_only.csv").write_text("prompt,completion\n")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(tmp_path / "dict")
    datasets.Dataset.from_list(ROWS).save_to_disk(tmp_path / "single")
    (tmp_path / "data_folder").mkdir()
    demo.write_jsonl(tmp_path / "data_folder" / "part.jsonl", ROWS)
    for folder in ("bad_folder", "columns_folder", "types_folder", "mixed_folder", "null_first_folder",
                   "text_folder", "empty_folder", "named_folder",
                   "split_folder/train"):
        (tmp_path / folder).mkdir(parents=True)
    demo.write_jsonl(tmp_path / "named_folder" / "train.jsonl", ROWS)
    demo.write_jsonl(tmp_path / "named_folder" / "more.jsonl", ROWS)
    (tmp_path / "named_folder" / "LICENSE").write_text("MIT")  # no data file: not named as left out
    demo.write_jsonl(tmp_path / "split_folder" / "train" / "a.jsonl", ROWS)
    demo.write_jsonl(tmp_path / "split_folder" / "test.jsonl", ROWS)
    demo.write_jsonl(tmp_path / "split_folder" / "validation.jsonl", ROWS)
    demo.write_jsonl(tmp_path / "bad_folder" / "a.jsonl", ROWS)
    shutil.copy(tmp_path / "bad.jsonl", tmp_path / "bad_folder" / "b.jsonl")
    demo.write_jsonl(tmp_path / "columns_folder" / "a.jsonl", ROWS)
    demo.write_jsonl(tmp_path / "columns_folder" / "b.jsonl", [{**CHAT, "id": "c1"}])  # as many columns, others
    demo.write_jsonl(tmp_path / "types_folder" / "a.jsonl", [{"text": "a"}])
    demo.write_jsonl(tmp_path / "types_folder" / "b.jsonl", [{"text": ["a"]}])
    demo.write_jsonl(tmp_path / "mixed_folder" / "a.jsonl", [{"text": "a"}])
    demo.write_jsonl(tmp_path / "mixed_folder" / "b.jsonl", [{"text": "a"}])
    demo.write_jsonl(tmp_path / "mixed_folder" / "c.jsonl", [{"text": "a"}, {"text": 5}])
    # A column null in the first file takes the second file's type: the third conflicts with the second.
    for name, value in [("a", None), ("b", 5), ("c", "x")]:
        demo.write_jsonl(tmp_path / "null_first_folder" / f"{name}.jsonl", [{"text": "a", "tag": value}])
    demo.write_jsonl(tmp_path / "text_folder" / "a.jsonl", ROWS)
    (tmp_path / "text_folder" / "notes.txt").write_text("where the data came from\n")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:0])}
                         ).save_to_disk(tmp_path / "empty_split")
    demo.write_jsonl(tmp_path / "both.jsonl", [{"question": "a", "prompt": "b", "completion": "c"}])
    # Chat data exported to CSV: each cell is text, the messages' JSON.
    (tmp_path / "chat.csv").write_text('messages\n"[{""role"": ""user"", ""content"": ""a""}]"\n')
    (tmp_path / "long_eval").mkdir()
    demo.write_jsonl(tmp_path / "long_eval" / "train.jsonl", ROWS)
    demo.write_jsonl(tmp_path / "long_eval" / "test.jsonl", [{"prompt": "a" * 100, "completion": "b"}])
    # The held-out split has the column the mapping renames onto, the training split not.
    (tmp_path / "eval_both").mkdir()
    demo.write_jsonl(tmp_path / "eval_both" / "train.jsonl", [{"question": "a", "completion": "c"}])
    demo.write_jsonl(tmp_path / "eval_both" / "test.jsonl", [{"question": "a", "prompt": "b", "completion": "c"}])
    # A blank line fails datasets' second reader, after the first failed on the type: each named only its own error.
    for name in ("types_blank.jsonl", "types_blank.json"):
        (tmp_path / name).write_text('{"prompt": "a", "completion": "b"}\n\n{"prompt": null, "completion": "c"}\n'
                                     '{"prompt": 1, "completion": "d"}\n')
    (tmp_path / "latin1.csv").write_bytes("prompt,completion\ncaf\u00e9,x\n".encode("latin-1"))
    # Not UTF-8 on its second line: JSON lines, and a JSON array (which datasets reads too), compressed or not.
    latin1_lines = '{"prompt": "a", "completion": "x"}\n{"prompt": "caf\u00e9", "completion": "x"}\n'.encode("latin-1")
    (tmp_path / "latin1.jsonl").write_bytes(latin1_lines)
    (tmp_path / "latin1.jsonl.gz").write_bytes(gzip.compress(latin1_lines))
    (tmp_path / "latin1.json").write_bytes(b"[" + latin1_lines.replace(b"}\n{", b"},\n{") + b"]")
    write_multi_config_copy(tmp_path / "copy")
    return [
        (cfg(tmp_path / "bad.jsonl"), r"cannot parse .*bad.jsonl, line 3: Expecting ',' delimiter"),
        *[(cfg(tmp_path / name), rf"^cannot parse .*{name}, line {line}: {kind}, not an object: write each row as "
                                 r"a JSON object \(\{\.\.\.\}\) on a line of its own$")
          for name, line, kind in [("scalar.jsonl", 3, "a string"), ("array.jsonl", 2, "a list")]],
        (cfg(tmp_path / "bad.json"), r"cannot parse .*bad.json, line 2: Expecting value"),
        (cfg(tmp_path / "bad_lines.json"), r"cannot parse .*bad_lines.json, line 3: Expecting ',' delimiter"),
        (cfg(tmp_path / "extra.json"), r"cannot parse .*extra.json, line 4: Extra data"),
        (cfg(tmp_path / "bad.csv"), r"cannot parse .*bad.csv, line 3: 3 fields, the header has 2"),
        *[(cfg(tmp_path / name), rf"^cannot parse .*{name}, line 4: 'prompt' is a number, and on line 1 a string: "
                                  r"give the field one type in every row$")
          for name in ("types_blank.jsonl", "types_blank.json")],
        (cfg(tmp_path / "empty.jsonl"), r"empty.jsonl is empty: it holds no examples"),
        (cfg(f"{tmp_path}/ok.jsonl,"), r"^dataset_name '.*/ok.jsonl,' has an empty entry: name the data sets "
                                       r"separated by single commas$"),
        (cfg(tmp_path / "header_only.csv"), r"header_only.csv is empty: it holds no examples"),
        (cfg(tmp_path / "cols.jsonl"), r"cols.jsonl \[train\]: cannot read the data as any format: found the columns "
                                       r"\['question', 'answer'\]; expected chat: messages"),
        (cfg(tmp_path / "msgs.jsonl"), r"msgs.jsonl \[train\]: row 2 \(line 2\): message 0 needs a string 'role' and a string"),
        (cfg(tmp_path / "nolist.jsonl"), r"nolist.jsonl \[train\]: row 1 \(line 1\): 'messages' must be a non-empty list"),
        (cfg(tmp_path / "ok.jsonl", max_seq_length=2, overlong_examples="drop"), r"no example is left"),
        (cfg(tmp_path / "sharegpt.jsonl"), r"sharegpt.jsonl \[train\]: no message has the role assistant \(the roles "
                                           r"are gpt, human\), and the loss is on assistant turns: name the model's "
                                           r"turns assistant \(and the user's user\), or set completion_only_loss false"),
        (cfg(tmp_path / "dict", eval_split="validation"), r"has no split 'validation'; its splits are \['train'\]"),
        (cfg(tmp_path / "empty_split", eval_split="test"), r"empty_split/test holds no examples"),
        (cfg(tmp_path / "ok.jsonl", eval_split="test"),
         r"ok.jsonl has no split 'test'; its splits are \['train'\] \(a single file holds one split: .*eval_fraction"),
        (cfg(tmp_path / "ok.jsonl", dataset_split="validation"), r"ok.jsonl has no split 'validation'"),
        (cfg(tmp_path / "single", eval_split="test"),
         r"single has no split 'test'; its splits are \['train'\] \(a folder saved from a single Dataset"),
        (cfg(tmp_path / "single", dataset_split="validation"), r"single has no split 'validation'"),
        (cfg(tmp_path / "ok.jsonl", dataset_split="train[:x]"), r"cannot read the split 'train\[:x\]'"),
        (cfg(tmp_path / "ok.jsonl", dataset_split="train[:0]"), r"ok.jsonl \(split train\[:0\]\) holds no examples$"),
        (cfg(tmp_path / "data_folder", eval_split="test"), r"data_folder has no split 'test'; its splits are \['train'\]$"),
        (cfg(tmp_path / "data_folder", dataset_config_name="en"),
         r"data_folder is a folder of data files without a dataset card \(README.md\) that names configs"),
        (cfg(tmp_path / "bad_folder"), r"cannot parse .*bad_folder/b.jsonl, line 3: Expecting ',' delimiter"),
        (cfg(tmp_path / "columns_folder"), r"the files of .*columns_folder differ in their columns: .*a.jsonl has "
                                           r"\['prompt', 'completion'\], .*b.jsonl has \['messages', 'id'\]: give every "
                                           r"file the same columns"),
        (cfg(tmp_path / "types_folder"), r"^the files of .*types_folder have columns of other types: 'text' is "
                                         r"Value\('string'\) in .*types_folder/a.jsonl, .* in .*types_folder/b.jsonl: "
                                         r"give every file the same columns"),
        (cfg(tmp_path / "mixed_folder"), r"^the files of .*mixed_folder have columns of other types: 'text' is "
                                         r"Value\('string'\) in .*mixed_folder/a.jsonl, .* in .*mixed_folder/c.jsonl"),
        (cfg(tmp_path / "null_first_folder"), r"^the files of .*null_first_folder have columns of other types: 'tag' "
                                              r"is Value\('int64'\) in .*null_first_folder/b.jsonl, Value\('string'\) in "
                                              r".*null_first_folder/c.jsonl: give every file"),
        (cfg(tmp_path / "text_folder"), r".*text_folder/notes.txt: unsupported file type in the data folder .*, "
                                        r"whose every file is read; use one of .json, .jsonl, .csv, .parquet \(or one "
                                        r"of them compressed: .gz, .bz2, .xz, .zst\), or move"),
        (cfg(tmp_path / "named_folder"), r"^.*named_folder/more.jsonl: in none of the splits \['train'\] of the data "
                                         r"folder .*named_folder, whose every file is read; datasets names a file's "
                                         r"split by a folder name \(train/, test/, validation/, ...\), else by its "
                                         r"file name \(train\*, test\*, ...\), and where none is named every file is "
                                         r"train: rename it or move it into its split's folder, or move it out"),
        (cfg(tmp_path / "split_folder"), r"^.*split_folder/test.jsonl \(and 1 more file\): in none of the splits "),
        (cfg(tmp_path / "empty_folder"), r"empty_folder holds no data files \(json, jsonl, csv or parquet\)"),
        (cfg(tmp_path / "ok.jsonl", dataset_config_name="en"), r"dataset_config_name en is for a Hub data set "
                                                              r"\(or a local copy of one\); .*ok.jsonl is a file"),
        (cfg(tmp_path / "single", dataset_config_name="en"), r"single is a save_to_disk folder"),
        (cfg(tmp_path / "missing.jsonl"), r"dataset_name .*missing.jsonl: no such file or folder"),
        (cfg(tmp_path / "ok.jsonl", dataset_weights="x"), r"dataset_weights must be positive numbers .* got 'x'"),
        (cfg(f"{tmp_path}/ok.jsonl,{tmp_path}/ok.jsonl", dataset_weights="1,-0.5"), r"positive numbers .*'1,-0.5'"),
        (cfg(tmp_path / "ok.jsonl", dataset_weights="0"), r"positive numbers .*got '0'"),
        (cfg(tmp_path / "ok.jsonl", dataset_weights="inf"), r"positive numbers .*got 'inf'"),
        (cfg(tmp_path / "ok.jsonl", dataset_weights="0.01"), r"^dataset weight 0.01 of a data set of 40 examples "
                                                               r"keeps none of them: raise it above 0.0125, or leave "
                                                               r"the data set out$"),
        (cfg(tmp_path / "ok.jsonl", dataset_column_mapping="questoin=prompt"), r"renames 'questoin', which no data"),
        (cfg(tmp_path / "ok.jsonl", dataset_weights="1,2"), r"^dataset_weights has 2 values for 1 data sets in "
                                                            r"dataset_name: give one weight per data set, in "
                                                            r"dataset_name's order$"),
        (cfg(tmp_path / "both.jsonl", dataset_column_mapping="question=prompt"),
         r"renames 'question' to 'prompt', but .*both.jsonl already has a column 'prompt': rename that one too"),
        (cfg(tmp_path / "chat.csv"), r"^.*chat.csv \[train\]: row 1 \(line 2\): 'messages' must be a non-empty list of "
                                     r"\{role, content\}, got a string \('\[\{\"role\": \"user\", \"content\": \"a\"\}\]'\): "
                                     r"give the list, not its JSON text \(a CSV cell holds text alone: write chat data "
                                     r"as JSON lines or Parquet\)$"),
        (cfg(tmp_path / "long_eval", eval_split="test", overlong_examples="drop"),
         r"^.*long_eval \[test\]: no example is left to evaluate on \(see the counts above\)$"),
        (cfg(tmp_path / "eval_both", dataset_column_mapping="question=prompt", eval_split="test"),
         r"renames 'question' to 'prompt', but .*eval_both \[test\] already has a column 'prompt': rename that one too"),
        (cfg(tmp_path / "copy"), r"copy holds several configs: set dataset_config_name\. .*\['main', 'socratic'\]"),
        (cfg("data/chats"), r"dataset_name data/chats: no such file or folder in .*, and the Hub cannot be reached"),
        (cfg(tmp_path / "copy", dataset_config_name="de"), r"copy: dataset_config_name de: BuilderConfig 'de' not "
                                                           r"found. Available: \['main', 'socratic'\]"),
        (cfg(tmp_path / "latin1.csv"), r"^cannot parse .*latin1.csv, line 2: not UTF-8 text \(invalid continuation "
                                       r"byte at byte 3 of the line\): save it as UTF-8$"),
        # pyarrow reads JSON lines that are not UTF-8: the row is refused once read.
        *[(cfg(tmp_path / name), rf"^{re.escape(str(tmp_path / name))} \[train\]: row 2 \(line 2\): not UTF-8 text: "
                                 rf"save the file as UTF-8$")
          for name in ("latin1.jsonl", "latin1.jsonl.gz")],
        (cfg(tmp_path / "latin1.json"), r"^cannot parse .*latin1.json, line 2: not UTF-8 text \(invalid continuation "
                                        r"byte at byte 15 of the line\): save it as UTF-8$"),
        (cfg(tmp_path / "both.jsonl", dataset_column_mapping="question=text,prompt=text"),
         r"renames both 'question' and 'prompt' of .*both.jsonl to 'text': map only one of them"),
        (cfg(tmp_path / "both.jsonl", dataset_column_mapping="question=prompt, question=completion"),
         r"^dataset_column_mapping renames 'question' twice, to 'prompt' and 'completion': map it once$"),
    ]


def write_multi_config_copy(folder) -> None:
    """A local copy of a Hub data set with two configs, as `huggingface-cli download` leaves it."""
    for config in ("main", "socratic"):
        (folder / config).mkdir(parents=True)
        demo.write_jsonl(folder / config / "train.jsonl", [{"prompt": f"{config[0]}{i}", "completion": "x"}
                                                           for i in range(8)])
    (folder / "README.md").write_text("---\nconfigs:\n" + "".join(
        f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train.jsonl\n" for c in ("main", "socratic"))
        + "---\n")


def test_bad_input_gets_a_clear_error(tmp_path, monkeypatch):
    for module in (datasets.config, huggingface_hub.constants):  # as HF_HUB_OFFLINE=1 sets them at import
        monkeypatch.setattr(module, "HF_HUB_OFFLINE", True)
    for config, message in bad_input_cases(tmp_path):
        with pytest.raises(ConfigError, match=message):
            build_datasets(config, TOKENIZER)


def test_a_tokenizer_without_character_offsets_is_refused():
    # Loss masks map characters to tokens through offsets, which Python tokenizers (ByT5's) leave out unasked.
    with pytest.raises(ConfigError, match=r"^ByT5Tokenizer is a Python tokenizer, without the character offsets "
                                          r"of a fast one \(tokenizer.json, from the tokenizers library\) that the loss "
                                          r"masks are built from: set tokenizer_name_or_path to a folder that holds a "
                                          r"tokenizer.json of the same vocabulary$"):
        build_datasets(cfg("unused"), ByT5Tokenizer())


def test_an_unknown_split_of_a_hub_copy_and_a_file_that_is_no_parquet_get_one_clear_line(tmp_path):
    write_multi_config_copy(tmp_path / "copy")
    with pytest.raises(ConfigError) as error:
        load_split(str(tmp_path / "copy"), "main", "validation")
    assert str(error.value) == f"{tmp_path / 'copy'}: Unknown split \"validation\". Should be one of ['train']."
    (tmp_path / "d.parquet").write_bytes(b"prompt,completion\na,b\n")  # a CSV file named .parquet
    with pytest.raises(ConfigError, match=rf"^cannot parse {re.escape(str(tmp_path / 'd.parquet'))}, Parquet magic "
                                          r"bytes not found in footer"):
        load_split(str(tmp_path / "d.parquet"), None, "train")


def test_a_missing_data_file_is_named_missing_not_looked_for_on_the_hub(tmp_path, monkeypatch):
    # 'data/train.jsonl' has the form of a Hub id (namespace/name): its extension says it is a file.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    for name in ("train.jsonl", "data/train.jsonl"):
        with pytest.raises(ConfigError) as error:
            load_split(name, None, "train")
        assert str(error.value) == f"dataset_name {name}: no such file or folder in {tmp_path}"


def test_a_chat_template_that_refuses_a_row_names_the_row(tmp_path):
    tokenizer = demo.build_tokenizer()
    tokenizer.chat_template = GEMMA2_TEMPLATE
    system = {"messages": [{"role": "system", "content": "be brief"}] + CHAT["messages"]}
    demo.write_jsonl(tmp_path / "chats.jsonl", [CHAT, system])
    with pytest.raises(ConfigError, match=r"chats.jsonl \[train\]: row 2 \(line 2\): the tokenizer's chat template refuses this "
                                          r"conversation: System role not supported$"):
        build_datasets(cfg(tmp_path / "chats.jsonl"), tokenizer)
    tokenizer.chat_template = MISTRAL_NEMO_TEMPLATE
    with pytest.raises(ConfigError, match=r"chats.jsonl \[train\]: row 2 \(line 2\): the tokenizer's chat template leaves "
                                          r"message 0 \(system\) out of the conversation"):
        build_datasets(cfg(tmp_path / "chats.jsonl"), tokenizer)


def test_a_bad_row_of_a_data_file_names_the_file_and_its_line(tmp_path):
    """A row's number counts in its split, which joins a folder's files or slices them: the file, and the line where
    the row starts (blank lines and a CSV's header and quoted line breaks counted), say where to fix it."""
    (tmp_path / "folder" / "more").mkdir(parents=True)
    demo.write_jsonl(tmp_path / "folder" / "a.jsonl", ROWS[:3])
    bad = {"prompt": "a", "completion": None}
    (tmp_path / "folder" / "b.jsonl").write_text(f"{json.dumps(ROWS[3])}\n\n{json.dumps(bad)}\n")
    datasets.Dataset.from_list(ROWS[4:6]).to_parquet(tmp_path / "folder" / "more" / "c.parquet")
    datasets.Dataset.from_list([ROWS[0], bad]).to_parquet(tmp_path / "d.parquet")
    (tmp_path / "d.csv").write_text('prompt,completion,tools\na,b,\n\n"two\nlines",c,get_weather\n')
    # One JSON array in a .jsonl file, which datasets reads too: its rows are no lines.
    (tmp_path / "array.jsonl").write_text(json.dumps([ROWS[0], ROWS[1], bad]) + "\n")
    reason = "'completion' must be a string, got None"
    for name, split, where in [("folder", "train", f"row 5 (b.jsonl, line 3): {reason}"),
                               ("folder", "train[-4:]", f"row 2 (b.jsonl, line 3): {reason}"),
                               ("folder", "train[:2]+train[4:]", f"row 3 (b.jsonl, line 3): {reason}"),
                               ("d.parquet", "train[1:]", f"row 1 (row 2): {reason}"),
                               ("array.jsonl", "train", f"row 3 (row 3): {reason}"),
                               ("d.csv", "train", "row 2 (line 4): a 'tools' column is read with chat data")]:
        with pytest.raises(ConfigError) as error:
            build_datasets(cfg(tmp_path / name, dataset_split=split), TOKENIZER)
        assert str(error.value).startswith(f"{tmp_path / name} [{split}]: {where}"), str(error.value)
    # A bad row of a held-out split too: an eval_split of the folder's test files.
    shutil.copytree(tmp_path / "folder", tmp_path / "splits" / "test")
    (tmp_path / "splits" / "train").mkdir()
    demo.write_jsonl(tmp_path / "splits" / "train" / "rows.jsonl", ROWS)
    with pytest.raises(ConfigError, match=rf"^{tmp_path}/splits \[test\[2:\]\]: row 3 \(test/b.jsonl, line 3\): "):
        build_datasets(cfg(tmp_path / "splits", eval_split="test[2:]"), TOKENIZER)


def test_a_row_or_line_at_a_boundary_is_named_where_it_is(tmp_path):
    """The first row of a folder's second file is in that file; the row after a CSV cell's quoted line break starts
    where that break ended; a JSON line that is no object is named past a line of null (a row of nulls); a row of
    a pretty-printed JSON array has its number; a CSV row of empty cells counts; a type conflict is found past a
    null on the same line."""
    (tmp_path / "folder").mkdir()
    demo.write_jsonl(tmp_path / "folder" / "a.jsonl", ROWS[:3])
    (tmp_path / "folder" / "b.jsonl").write_text(f"\n{json.dumps(ROWS[3])}\n")
    assert [data_sources.row_origin(str(tmp_path / "folder"), "train", index) for index in (2, 3)] == [
        "a.jsonl, line 3", "b.jsonl, line 2"]
    (tmp_path / "f.csv").write_text('prompt,completion\n"two\nlines",x\nsay ho\n')
    with pytest.raises(ConfigError, match=r"^cannot parse .*f.csv, line 4: 1 fields, the header has 2 "):
        load_split(str(tmp_path / "f.csv"), None, "train")
    (tmp_path / "null.jsonl").write_text('{"text": "a"}\nnull\n"b"\n')
    with pytest.raises(ConfigError, match=r"^cannot parse .*null.jsonl, line 3: a string, not an object: "):
        load_split(str(tmp_path / "null.jsonl"), None, "train")
    # One JSON array written over several lines in a .jsonl file: its rows are no lines.
    (tmp_path / "array.jsonl").write_text(json.dumps(ROWS[:3], indent=1) + "\n")
    assert data_sources.row_origin(str(tmp_path / "array.jsonl"), "train", 1) == "row 2"
    # A CSV row of empty cells is a row, as pandas reads it; a field null on a line leaves the line's others checked.
    (tmp_path / "e.csv").write_text("prompt,completion\n,\nx,y\n")
    assert data_sources.row_origin(str(tmp_path / "e.csv"), "train", 1) == "line 3"
    (tmp_path / "types.jsonl").write_text('{"prompt": "a", "completion": "b"}\n\n{"prompt": null, "completion": 1}\n')
    with pytest.raises(ConfigError, match=r"^cannot parse .*types.jsonl, line 3: 'completion' is a number, and on "
                                          r"line 1 a string: give the field one type in every row$"):
        load_split(str(tmp_path / "types.jsonl"), None, "train")
    (tmp_path / "flags.jsonl").write_text('{"text": "a", "n": 1}\n\n{"text": "b", "n": true}\n')
    with pytest.raises(ConfigError, match=r"^cannot parse .*flags.jsonl, line 3: 'n' is a boolean, and on line 1 a "
                                          r"number: "):
        load_split(str(tmp_path / "flags.jsonl"), None, "train")


def test_reading_local_files_sends_no_download_count_to_the_hub(tmp_path, monkeypatch):
    """datasets' load_dataset sends a HEAD request to count a download of its json or parquet builder, for a local
    file too: once per file of a folder, on every rank and every run (3 s each where the network drops it). A
    listener stands in for the Hub's S3 bucket and counts the connections made to it."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    monkeypatch.setattr(datasets.config, "S3_DATASETS_BUCKET_PREFIX", f"http://127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS", True)
    (tmp_path / "parts").mkdir()
    demo.write_jsonl(tmp_path / "parts" / "a.jsonl", ROWS[:3])
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(ROWS[3:5]), tmp_path / "parts" / "b.parquet")
    assert len(load_split(str(tmp_path / "parts"), None, "train")) == 5
    connections = []
    with server, contextlib.suppress(TimeoutError):  # accept() times out once no connection is waiting
        while True:
            connections.append(server.accept()[0])
    assert connections == []
    assert datasets.config.HF_UPDATE_DOWNLOAD_COUNTS  # as the run set it, for Hub data sets


def test_a_data_set_name_may_start_with_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    demo.write_jsonl(tmp_path / "home.jsonl", [{"text": f"abc{i}"} for i in range(4)])
    train, _ = build_datasets(cfg(" ~/home.jsonl"), TOKENIZER)  # as the second name of "a.jsonl, ~/home.jsonl"
    assert len(train) == 4


def test_ranks_read_disjoint_equal_parts_in_a_seeded_order():
    # 11 examples on 2 ranks, batch 2, accumulation 2: the odd example is dropped, each rank gets 5 -> 1 step.
    dataset = datasets.Dataset.from_dict({"input_ids": [[i, i] for i in range(11)], "labels": [[i, i] for i in range(11)]})

    def steps(rank, seed=0, n=3):
        loader = build_dataloader(dataset, cfg("unused", per_device_train_batch_size=2, seed=seed), TOKENIZER, rank, 2,
                                  pin_memory=False)
        stream = optimizer_step_batches(loader, accumulation=2)
        return [[mb["input_ids"][:, 0].tolist() for mb in next(stream)] for _ in range(n)]

    rank0, rank1 = steps(0), steps(1)
    assert all(len(step) == 2 and all(len(mb) == 2 for mb in step) for step in rank0 + rank1)
    epoch0 = [i for mb in rank0[0] for i in mb] + [i for mb in rank1[0] for i in mb]
    assert len(set(epoch0)) == 8  # disjoint: 8 different examples in the 2 ranks' first steps
    assert rank0 == steps(0) and rank0 != steps(0, seed=1)  # the order depends on the seed only
    assert rank0[0] != rank0[1]  # reshuffled every epoch


@pytest.mark.parametrize("n_examples, per_epoch", [(12, 12), (11, 8)])
def test_each_rank_reads_its_own_part_of_every_epoch_exactly_once(n_examples, per_epoch):
    # Batch 2 on 2 ranks: 12 examples give each rank 3 micro-batches an epoch; 11 give each 5 examples, 2 batches
    # (drop_last: no example is repeated to even out the ranks).
    ids = [[i, i] for i in range(n_examples)]
    dataset = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})

    def steps(rank, accumulation, n, start_step=0, batch_size=2):
        loader = build_dataloader(dataset, cfg("unused", per_device_train_batch_size=batch_size), TOKENIZER, rank, 2,
                                  pin_memory=False)
        stream = optimizer_step_batches(loader, accumulation, start_step)
        return [[i for mb in next(stream) for i in mb["input_ids"][:, 0].tolist()] for _ in range(n)]

    steps_per_epoch = per_epoch // 4  # accumulation 1: a step is a micro-batch of 2 on each of the 2 ranks
    rank0, rank1 = steps(0, 1, 2 * steps_per_epoch), steps(1, 1, 2 * steps_per_epoch)
    for epoch in (slice(0, steps_per_epoch), slice(steps_per_epoch, None)):
        part0, part1 = sum(rank0[epoch], []), sum(rank1[epoch], [])
        assert len(part0) == len(part1) == per_epoch // 2
        assert len(set(part0 + part1)) == per_epoch  # disjoint parts, no example twice
    assert sum(rank0[:steps_per_epoch], []) != sum(rank0[steps_per_epoch:], [])  # each epoch in its own order
    if n_examples == 12:
        assert sorted(sum(rank0[:3] + rank1[:3], [])) == list(range(12))
        # accumulation 2: 1 step an epoch, the third micro-batch dropped; a resume at step 2 starts epoch 2.
        full = steps(0, 2, 3)
        assert [len(step) for step in full] == [4, 4, 4]
        assert steps(0, 2, 1, start_step=2) == full[2:]
        assert steps(0, 1, 2, start_step=4) == rank0[4:6]  # mid-epoch: the rest of epoch 1
        # batch 1, accumulation 2: 3 steps an epoch; a resume at step 4 skips 2 micro-batches of epoch 1.
        assert steps(0, 2, 2, start_step=4, batch_size=1) == steps(0, 2, 6, batch_size=1)[4:]


def test_examples_hold_the_tokenizers_bos_and_eos_and_are_padded_with_its_pad_token(tmp_path):
    # Llama 3's tokenizer has no pad token: load_tokenizer gives it its EOS, which the exported tokenizer names
    # as the one training padded with; so the batches must be padded with that id, not with a fixed one.
    source = demo.build_tokenizer()
    source.pad_token = None
    source.save_pretrained(tmp_path / "tokenizer")
    demo.write_jsonl(tmp_path / "text.jsonl", [{"text": "abcdef"}])
    demo.write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "ab", "completion": "c"}])
    config = cfg(f"{tmp_path}/text.jsonl,{tmp_path}/pc.jsonl", tokenizer_name_or_path=str(tmp_path / "tokenizer"),
                 per_device_train_batch_size=2)
    tokenizer = load_tokenizer(config)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 4, 4)
    train, _ = build_datasets(config, tokenizer)
    batch = next(iter(build_dataloader(train, config, tokenizer, rank=0, world_size=1, pin_memory=False)))
    lengths = batch["attention_mask"].sum(1).tolist()
    assert sorted(lengths) == [5, 8]  # <|bos|>abc<|end|>, <|bos|>abcdef<|end|>
    for ids, n in zip(batch["input_ids"].tolist(), lengths):
        assert ids[0] == tokenizer.bos_token_id and ids[n - 1] == tokenizer.eos_token_id
        assert ids[n:] == [tokenizer.pad_token_id] * (8 - n)


def test_recipe_trains_a_packed_mixture_with_eval_split_on_two_ranks(tiny, tmp_path):
    train = tmp_path / "train.jsonl"  # a fresh path: other tests may have cached the tokenization of tiny["data"]
    shutil.copy(tiny["data"], train)
    demo.write_jsonl(tmp_path / "extra.jsonl", [{"instruction": "reverse", "input": f"ab{i % 10}", "output": "ba"}
                                                for i in range(37)])
    proc = torchrun("recipes/llama_sft.py", "--config", "recipes/configs/llama_sft.yaml",
                    "--model_name_or_path", tiny["model"], "--dataset_name", f"{train},{tmp_path}/extra.jsonl",
                    "--dataset_weights", "0.5,1", "--eval_fraction", "0.1", "--packing", "true",
                    "--max_seq_length", "64", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
                    "--max_steps", "6", "--logging_steps", "3", "--output_dir", tmp_path / "out")
    # 256 - 25 held out = 231 x 0.5 = 116 (rounded), 37 - 3 held out = 34: 150 examples packed.
    assert "packed 150 examples into" in proc.stdout and "eval 28 examples" in proc.stdout
    # The sequences that do not fill a global batch (2 ranks x 2 x 2) are left out of each epoch, and it says so.
    rows = int(re.search(r"packed 150 examples into (\d+) sequences", proc.stdout).group(1))
    assert rows % 8 and (f"an epoch trains {rows - rows % 8} of its {rows} sequences (the {rows % 8} that do not fill "
                         f"a global batch of 8 are left out, others each epoch)") in proc.stdout
    assert "Tokenizing" not in proc.stderr  # not a terminal: log lines, no progress bars (test_metrics.py: a pty)
    metrics = [m for m in read_metrics(tmp_path / "out" / "metrics.jsonl") if "loss" in m]  # not the eval line
    assert [m["step"] for m in metrics] == [3, 6]
    for m in metrics:
        assert 0.5 < m["real_token_share"] <= 1 and m["input_tokens"] <= 4 * 2 * 64


def test_a_packed_fsdp2_run_trains_every_weight_saves_and_resumes_exactly(tiny, tmp_path):
    """The packing check runs forwards before the optimizer is built; FSDP2 keeps units it gathered for them
    (the root; every unit without resharding after forward) holding plain tensors until resharded, and an optimizer
    built on those would train nothing there and fail to save."""
    args = ["recipes/llama_sft.py", "--config", "recipes/configs/llama_sft.yaml", "--model_name_or_path",
            tiny["model"], "--dataset_name", tiny["data"], "--packing", "true", "--fsdp_reshard_after_forward",
            "false", "--max_seq_length", "64", "--per_device_train_batch_size", "2", "--max_steps", "4",
            "--learning_rate", "1e-3", "--save_steps", "2", "--save_dtype", "float32"]
    torchrun(*args, "--output_dir", tmp_path / "run")
    initial = AutoModelForCausalLM.from_pretrained(tiny["model"]).state_dict()
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final").state_dict()
    assert [name for name in initial if torch.equal(initial[name], trained[name])] == []
    torchrun(*args, "--output_dir", tmp_path / "resumed", "--resume_from_checkpoint", tmp_path / "run" / "checkpoint-2")
    resumed = AutoModelForCausalLM.from_pretrained(tmp_path / "resumed" / "final").state_dict()
    assert all(torch.equal(trained[name], resumed[name]) for name in trained)


def test_ranks_wait_for_a_slow_build_or_rank0s_work_on_the_long_timeout_group():
    proc = torchrun("tests/drivers/rank0_first.py", "4", "2", timeout=120)
    for rank in (0, 1):  # the two ranks' lines may interleave in the launcher's output
        assert f"rank {rank}: built by rank {rank}, past the training group's barrier" in proc.stdout, proc.stdout
    assert "rank 0: written by rank 0, past the training group's barrier" in proc.stdout, proc.stdout
    assert "rank 1: None by rank 0, past the training group's barrier" in proc.stdout, proc.stdout
    assert "rank 0: ZeroDivisionError: division by zero" in proc.stdout
    # Not a config error: rank 1 says where the failure was, and exits 1 as rank 0 does (cli.run_main), not 2.
    assert "rank 1: FailedOnRank0: rank 0 failed to divide: ZeroDivisionError('division by zero')" in proc.stdout
    assert "rank 0: stopped when rank 1 died: " in proc.stdout  # not a day's wait for a rank that is gone
    # Under a recipe's entry point: exit 1 on both ranks (2 is a config error's), rank 0 with its traceback.
    proc = torchrun("tests/drivers/rank0_fails.py", expect_rc=1, timeout=120)
    assert proc.stderr.count("ZeroDivisionError: division by zero") == 1
    assert "error: rank 0 failed to divide: ZeroDivisionError('division by zero')" in proc.stderr
    assert "exitcode  : 2" not in proc.stderr


def two_ranks(*args: str) -> list[subprocess.Popen]:
    """`args` started as ranks 0 and 1 without a launcher, which would stop the other rank once one exits."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return [subprocess.Popen([sys.executable, *args], cwd=REPO, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=subprocess_env(RANK=str(rank), WORLD_SIZE="2",
                                                                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
            for rank in (0, 1)]


def test_a_config_error_in_rank0s_work_stops_every_rank_with_its_line_and_exit_code_2():
    """Rank 0's work alone (reading the data or the weights) finds a config error: every rank prints its line and
    exits 2, as for one every rank finds."""
    procs = two_ranks("tests/drivers/rank0_fails.py", "config")
    errors = [proc.communicate(timeout=120)[1] for proc in procs]
    assert [proc.returncode for proc in procs] == [2, 2], errors
    assert [error.strip().splitlines()[-1] for error in errors] == ["error: the work's config error: change it"] * 2


def test_a_rank_gone_before_the_first_long_wait_stops_rank0_at_once():
    """The long-wait group is made while every rank is there, at init: one made at the first wait waits there for a
    rank that left before it (still waiting after 2 minutes, measured)."""
    procs = two_ranks("tests/drivers/rank1_gone.py")
    try:
        outputs = [proc.communicate(timeout=60) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert re.fullmatch(r"rank 0 stopped after [0-9]+ s: RuntimeError\n", outputs[0][0]), outputs


def test_each_node_builds_the_data_once_after_rank0(tmp_path):
    """With a datasets cache on each node's own disk, every process of the other nodes tokenized again at once:
    now the first process of each node builds (after rank 0), and its node's others read its cache."""
    with socket.socket() as probe:  # a free port for the two launchers' static rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tmp_path / "builds.jsonl"
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank",
                               str(node), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
                               str(port), "tests/drivers/node_first.py", log], cwd=REPO, env=subprocess_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node in (0, 1)]
    try:
        outputs = [node.communicate(timeout=120)[0] for node in nodes]
    finally:  # a launcher still running (a timeout) stops its workers on SIGTERM, as conftest's run does
        for node in nodes:
            node.terminate()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    builds = sorted((json.loads(line) for line in log.read_text().splitlines()), key=lambda b: b["start"])
    assert [(b["rank"], b["local_rank"]) for b in builds[:2]] == [(0, 0), (2, 0)]
    assert sorted(b["rank"] for b in builds[2:]) == [1, 3]
    # Each turn starts once the one before it has ended.
    assert builds[0]["end"] <= builds[1]["start"] and builds[1]["end"] <= min(b["start"] for b in builds[2:])


def test_bad_data_stops_every_rank_with_one_clear_line(tiny, tmp_path):
    demo.write_jsonl(tmp_path / "msgs.jsonl", [CHAT, CHAT, {"messages": [{"role": "user"}]}])
    proc = torchrun("recipes/llama_sft.py", "--model_name_or_path", tiny["model"], "--dataset_name",
                    tmp_path / "msgs.jsonl", "--output_dir", tmp_path / "out", expect_rc=1)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {tmp_path}/msgs.jsonl [train]: row 3 (line 3): message 0 needs a string 'role' and a string "
                      "'content' (which an assistant message with tool_calls may leave out), got "
                      "{'role': 'user'}"] * 2, proc.stderr
    assert "[rank" not in proc.stderr  # no rank died with a traceback (e.g. in a barrier)


def test_a_token_the_model_cannot_embed_stops_the_run_before_training(tiny, tmp_path):
    tokenizer = demo.build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})  # one id past the model's table
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    demo.write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ab", "completion": "<|tool|>"}] * 8)
    proc = torchrun("recipes/llama_sft.py", "--model_name_or_path", tiny["model"], "--tokenizer_name_or_path",
                    tmp_path / "tokenizer", "--dataset_name", tmp_path / "d.jsonl", "--output_dir", tmp_path / "out",
                    "--mixed_precision", "no", nproc=1, expect_rc=1)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: the data holds token id {len(tokenizer) - 1}, and the model's embedding table has "
                      f"{len(tokenizer) - 1} rows: use the model's own tokenizer (tokenizer_name_or_path), or save "
                      "the model with its embeddings resized to the tokenizer first (resize_token_embeddings)"]
    assert "training:" not in proc.stdout


class CachedRotaryEmbedding(torch.nn.Module):
    """The rotary embedding of transformers 4.36's Llama as remote code copies it (InternLM2's, DeepSeek-V2's): cos and
    sin cached in 2-D buffers of max_position_embeddings rows, rebuilt for a longer input."""

    def __init__(self, dim: int, max_position_embeddings: int):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)
        self._set_cos_sin_cache(max_position_embeddings)

    def _set_cos_sin_cache(self, seq_len: int):
        self.max_seq_len_cached = seq_len
        freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), self.inv_freq)
        self.register_buffer("cos_cached", torch.cat((freqs, freqs), dim=-1).cos(), persistent=False)
        self.register_buffer("sin_cached", torch.cat((freqs, freqs), dim=-1).sin(), persistent=False)

    def forward(self, x, seq_len: int):
        if seq_len > self.max_seq_len_cached:
            self._set_cos_sin_cache(seq_len)
        return self.cos_cached[:seq_len], self.sin_cached[:seq_len]


def test_a_rotary_cache_that_grows_sets_no_limit(capsys):
    """Remote code's rotary caches are 2-D buffers of max_position_embeddings rows, as GPT-J's fixed table, but grow
    with the input: a longer max_seq_length extends the context (a warning), as for transformers' own rotary models."""
    tokenizer = demo.build_tokenizer()
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=64))
    rotary = model.model.layers[0].self_attn.rotary_emb = CachedRotaryEmbedding(8, 64)
    assert rotary.cos_cached.shape == (64, 8)
    check_model_reads_data(model, tokenizer, 128, datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]]}))
    assert capsys.readouterr().out.startswith("warning: max_seq_length 128 is longer than the 64 positions the model "
                                              "was trained for")
    assert rotary(None, 128)[0].shape == (128, 8)


def test_a_pad_token_or_a_length_the_model_has_no_row_for_is_refused(capsys):
    tokenizer = demo.build_tokenizer()
    data = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]]})
    tiny = dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=64)
    llama = LlamaForCausalLM(LlamaConfig(**tiny))
    check_model_reads_data(llama, tokenizer, 64, data)
    # An id one past the embedding table, in any split (here the eval split's).
    beyond = datasets.Dataset.from_dict({"input_ids": [[len(tokenizer)]]})
    with pytest.raises(ConfigError, match=f"^the data holds token id {len(tokenizer)}, and the model's embedding table "
                                          f"has {len(tokenizer)} rows: use the model's own tokenizer"):
        check_model_reads_data(llama, tokenizer, 64, data, beyond)
    # GPT-2's learned position embeddings (n_positions) have no row beyond: refused.
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2, n_positions=16))
    check_model_reads_data(gpt2, tokenizer, 16, data)
    with pytest.raises(ConfigError) as error:
        check_model_reads_data(gpt2, tokenizer, 17, data)
    assert str(error.value) == ("max_seq_length 17 is longer than the model's position table (16 "
                                "positions): set max_seq_length 16 or less")
    # OPT's table holds 2 rows more than max_position_embeddings (an offset): 16 positions all the same.
    opt = OPTForCausalLM(OPTConfig(vocab_size=len(tokenizer), hidden_size=16, ffn_dim=32, num_hidden_layers=1,
                                   num_attention_heads=2, max_position_embeddings=16, word_embed_proj_dim=16))
    with pytest.raises(ConfigError, match=r"^max_seq_length 17 is longer than the model's position table "
                                          r"\(16 positions\)"):
        check_model_reads_data(opt, tokenizer, 17, data)
    with pytest.raises(IndexError):
        opt(torch.zeros(1, 17, dtype=torch.long))
    # Fixed tables in a buffer, not an embedding: CTRL's sinusoids, GPT-J's rotary sines (n_positions rows).
    ctrl = CTRLLMHeadModel(CTRLConfig(vocab_size=len(tokenizer), n_embd=16, dff=32, n_layer=1, n_head=2,
                                      n_positions=64))
    gptj = GPTJForCausalLM(GPTJConfig(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2, rotary_dim=4,
                                      n_positions=64, bos_token_id=0, eos_token_id=0))
    for model in (ctrl, gptj):
        check_model_reads_data(model, tokenizer, 64, data)
        assert model(torch.zeros(1, 64, dtype=torch.long)).logits.shape == (1, 64, len(tokenizer))
        with pytest.raises(ConfigError) as error:
            check_model_reads_data(model, tokenizer, 128, data)
        assert str(error.value) == ("max_seq_length 128 is longer than the model's position table (64 positions): "
                                    "set max_seq_length 64 or less")
        # IndexError, or for GPT-J on transformers 5.17 a RuntimeError from its gather.
        with pytest.raises((IndexError, RuntimeError), match="index 64 is out of bounds for dimension . with size 64"):
            model(torch.zeros(1, 128, dtype=torch.long))
    # Positions computed as needed (XGLM's sinusoids) or none at all (RWKV): any length, and they do run it.
    xglm = XGLMForCausalLM(XGLMConfig(vocab_size=len(tokenizer), d_model=16, ffn_dim=32, num_layers=1,
                                      attention_heads=2, max_position_embeddings=16))
    rwkv = RwkvForCausalLM(RwkvConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=2,
                                      attention_hidden_size=16, intermediate_size=32, context_length=16))
    for model in (xglm, rwkv):
        check_model_reads_data(model, tokenizer, 64, data)
        assert model(torch.zeros(1, 64, dtype=torch.long)).logits.shape == (1, 64, len(tokenizer))
    assert capsys.readouterr().out == ""
    # Rotary positions: beyond the trained context (with YaRN's factor 4, four times it) is a warning.
    yarn = Qwen2ForCausalLM(Qwen2Config(**tiny, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                              "original_max_position_embeddings": 64}))
    check_model_reads_data(yarn, tokenizer, 256, data)
    assert capsys.readouterr().out == ""
    # Llama 3.2's rope: its factor (32) scales frequencies; max_position_embeddings is the context (64, not 8 x 32).
    llama3 = LlamaForCausalLM(LlamaConfig(**tiny, rope_scaling={
        "rope_type": "llama3", "factor": 32.0, "original_max_position_embeddings": 8, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0}))
    # An embedding table with as many rows as positions (Mistral 7B v0.3's 32768) is no position table.
    square = LlamaForCausalLM(LlamaConfig(**{**tiny, "vocab_size": 64}))
    for model, length, context in [(llama, 65, 64), (yarn, 257, 256), (llama3, 65, 64), (square, 65, 64)]:
        check_model_reads_data(model, tokenizer, length, data)
        assert capsys.readouterr().out == (
            f"warning: max_seq_length {length} is longer than the {context} positions the model was trained for "
            f"(max_position_embeddings, with its rope scaling): it has never seen the positions beyond; to extend "
            f"its context, add rope scaling (e.g. YaRN) to its config.json\n")
    # A pad token added to the tokenizer, not to the model: every padded batch would embed it.
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    with pytest.raises(ConfigError) as error:
        check_model_reads_data(llama, tokenizer, 64, data)
    assert str(error.value) == (
        f"the tokenizer's pad token '[PAD]' has id {len(tokenizer) - 1}, and the model's embedding table has "
        f"{len(tokenizer) - 1} rows: save the tokenizer with a pad token the model has (e.g. its eos token), or save "
        f"the model with its embeddings resized to the tokenizer first (resize_token_embeddings)")
    # None left by load_tokenizer: no pad token and no eos token.
    tokenizer.pad_token = None
    with pytest.raises(ConfigError, match="^the tokenizer has no pad token, nor an eos token to pad with: save the "
                                          "tokenizer with a pad token the model has$"):
        check_model_reads_data(llama, tokenizer, 64, data)


def test_readme_data_example_is_a_valid_config(tmp_path):
    text = (REPO / "README.md").read_text()
    [block] = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    (tmp_path / "data.yaml").write_text(block)
    config = parse_config(["--config", str(tmp_path / "data.yaml"), "--model_name_or_path", "m"])
    assert config.dataset_name == "chats.jsonl,my_org/instructions" and config.dataset_weights == "1,0.5"
    assert (config.eval_fraction, config.packing, config.overlong_examples) == (0.05, False, "truncate")
    # "all keys shown": every key of the config's Data group, in its order.
    group = inspect.getsource(TrainConfig).split("# Data (see README")[1].split("# Optimisation.")[0]
    assert list(yaml.safe_load(block)) == re.findall(r"^    (\w+):", group, flags=re.M)


def test_readme_data_example_names_the_default_where_its_value_is_another():
    """Most of the example's values are the defaults: one that is not (max_seq_length 2048, where the default is 1024)
    says the default in its comment, or a reader takes it for one."""
    text = (REPO / "README.md").read_text()
    [block] = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    checked = 0
    for key, value, comment in re.findall(r"^(\w+): (.*?)(?:\s+#\s*(.*))?$", block, flags=re.M):
        default = defaults[key]
        if default is not None and yaml.safe_load(value) != default:
            assert re.search(rf"\bdefault {default:g}\b", comment), (key, comment)
            checked += 1
    assert checked == 2  # eval_fraction and max_seq_length


def test_eval_settings_are_checked():
    with pytest.raises(ConfigError, match=r"eval_fraction must be in \[0, 1\), got 1.5"):
        cfg("d.jsonl", eval_fraction=1.5)
    with pytest.raises(ConfigError, match="set eval_split or eval_fraction, not both"):
        cfg("d.jsonl", eval_fraction=0.1, eval_split="test")


@pytest.mark.parametrize("template, closing", [(LLAMA32_TEMPLATE, "<|eot_id|>"), (GEMMA2_TEMPLATE, "<end_of_turn>"),
                                               (PHI35_TEMPLATE, "<|end|>"), (QWEN25_TEMPLATE, "<|im_end|>"),
                                               (MISTRAL_NEMO_TEMPLATE, "<|endoftext|>"),
                                               (DEFAULT_CHAT_TEMPLATE, "<|endoftext|>"),
                                               (QWEN3_TEMPLATE, "<|im_end|>")])
def test_the_token_that_closes_an_assistant_turn_is_found(template, closing):
    # <think> and </think> special here: Qwen3's turn opens with them, before the answer, and they close nothing.
    special = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<end_of_turn>",
               "<start_of_turn>", "<|end|>", "<|user|>", "<|assistant|>", "<|im_start|>", "<|im_end|>",
               "[INST]", "[/INST]", "<|endoftext|>", "<bos>", "<think>", "</think>"]
    tokenizer = char_tokenizer(template, "<bos>", "<|endoftext|>", special)
    assert tokenizer.convert_ids_to_tokens(turn_closing_token_id(tokenizer)) == closing


def test_a_tokenizer_without_a_chat_template_closes_no_turn():
    # Trained on prompt/completion or text data alone, it is exported without one: generation stops at its EOS alone.
    assert turn_closing_token_id(char_tokenizer(None, None, "</s>", ["</s>"])) is None


# Beside the data of a clone of a Hub data set's repository, or a colleague's folder: no data by datasets' rules.
NO_DATA = {"LICENSE": "MIT", "NOTICE": "Copyright", "LICENSE.md": "MIT", "README.md": "# Data\n",
           ".gitattributes": "*.jsonl filter=lfs", "dataset_infos.json": '{"default": {}}'}


@pytest.mark.parametrize("data_files", [("train.jsonl", "test.jsonl"), ("data_a.jsonl", "data_b.jsonl")])
def test_a_data_folder_may_hold_files_that_are_no_data_beside_its_splits(tmp_path, capsys, data_files):
    """Read as load_dataset reads the folder: its card, hidden files and files of no data type are no data, with or
    without split names; the log names the files read and those left out."""
    demo.write_jsonl(tmp_path / data_files[0], ROWS)
    demo.write_jsonl(tmp_path / data_files[1], ROWS[:2])
    for name, text in NO_DATA.items():
        (tmp_path / name).write_text(text)
    split_names = data_files[0] == "train.jsonl"
    train, eval_set = build_datasets(cfg(tmp_path, eval_split="test" if split_names else None), TOKENIZER)
    assert (len(train), eval_set and len(eval_set)) == ((len(ROWS), 2) if split_names else (len(ROWS) + 2, None))
    assert datasets.load_dataset(str(tmp_path), split="train").num_rows == len(train)
    splits = "train: train.jsonl; test: test.jsonl" if split_names else "train: data_a.jsonl, data_b.jsonl"
    assert f"data: {tmp_path}: {splits}; left out: LICENSE, LICENSE.md, NOTICE\n" in capsys.readouterr().out


def test_the_data_log_marks_the_splits_of_a_folder_that_the_run_does_not_read(tmp_path, capsys):
    # eval_fraction holds out part of train: the folder's validation split, evaluated by nobody, says so.
    for split, rows in [("train", ROWS), ("validation", ROWS[:4]), ("test", ROWS[4:6])]:
        demo.write_jsonl(tmp_path / f"{split}.jsonl", rows)
    for eval_split, eval_fraction, marks in [
            (None, 0.1, "train: train.jsonl; validation: validation.jsonl (not read: eval_split validation evaluates "
                        "on it); test: test.jsonl (not read: eval_split test evaluates on it)"),
            ("validation", 0.0, "train: train.jsonl; validation: validation.jsonl; test: test.jsonl (not read)"),
            ("test[:1]+validation", 0.0, "train: train.jsonl; validation: validation.jsonl; test: test.jsonl")]:
        train, eval_set = build_datasets(cfg(tmp_path, eval_split=eval_split, eval_fraction=eval_fraction), TOKENIZER)
        assert len(eval_set) == {None: 4, "validation": 4, "test[:1]+validation": 5}[eval_split]
        assert f"data: {tmp_path}: {marks}\n" in capsys.readouterr().out


def test_a_data_folder_of_no_data_files_or_of_an_unread_data_type_is_refused(tmp_path):
    """A file of a data type load_dataset reads and this project does not (.txt, .tsv) may be data: an error, not
    left out; a folder of nothing but files of no data type holds no data."""
    for name, text in NO_DATA.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=f"^{re.escape(str(tmp_path))} holds no data files \\(json, jsonl, csv or "
                                          f"parquet\\)$"):
        load_split(str(tmp_path), None, "train")
    demo.write_jsonl(tmp_path / "data_a.jsonl", ROWS)
    (tmp_path / "data_b.tsv").write_text("prompt\tcompletion\na\tb\n")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(tmp_path / 'data_b.tsv'))}: unsupported file type in "
                                          f"the data folder"):
        load_split(str(tmp_path), None, "train")


def test_a_full_datasets_cache_is_named_with_what_to_do(tmp_path, monkeypatch):
    # Tokenizing onto a full disk showed OSError alone (No space left on device), naming neither the cache nor a remedy.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    demo.write_jsonl(tmp_path / "d.jsonl", ROWS)
    with file_size_limit(4096), pytest.raises(ConfigError) as error:
        build_datasets(cfg(tmp_path / "d.jsonl"), TOKENIZER)
    assert re.fullmatch(f"writing the tokenized data into the datasets cache failed \\(OSError: \\[Errno 27\\] File "
                        f"too large\\), with [0-9.,]+ MiB free on the file system of {tmp_path}/cache: make room "
                        f"there, or set HF_DATASETS_CACHE \\(or HF_HOME\\) to a folder on a file system with room",
                        str(error.value)), str(error.value)
