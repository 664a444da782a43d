"""Formats: detect one from the columns, render an example to text, tokenize it with its loss mask."""

from __future__ import annotations

import json
from typing import Optional

import jinja2
import numpy as np

from .config import ConfigError

IGNORE_INDEX = -100  # label of a token that carries no loss (prompt, padding)

FORMATS = {
    "chat": ["messages"],
    "instruction": ["instruction", "output"],
    "prompt_completion": ["prompt", "completion"],
    "text": ["text"],
}
# Columns a format reads beside those it needs.
OPTIONAL_COLUMNS = {"chat": ["tools"], "instruction": ["input"]}

# For a tokenizer without a chat template: the tokenizer's BOS (if any), as plain text gets, then ChatML's layout,
# each turn closed by the tokenizer's own EOS so that generation stops there. It is saved with the model, so
# inference renders prompts the same way.
DEFAULT_CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Llama 3.x's chat templates write "Today Date: <date_string>", today's date unless date_string is given. Pinned to
# the templates' own fallback, so that the tokens do not change with the day: a resume on another day, or a second
# run of the same config, tokenizes the same data.
CHAT_TEMPLATE_DATE_STRING = "26 Jul 2024"


def detect_format(columns: list[str], forced: str = "auto") -> str:
    """The first format whose columns are all present, or `forced`; either way its columns must exist."""
    candidates = FORMATS if forced == "auto" else {forced: FORMATS[forced]}
    for fmt, needed in candidates.items():
        if all(c in columns for c in needed):
            return fmt
    expected = "; ".join(f"{fmt}: {', '.join(cols)}" for fmt, cols in candidates.items())
    raise ConfigError(f"cannot read the data as {'any format' if forced == 'auto' else forced}: found the columns "
                      f"{columns}; expected {expected} (rename with dataset_column_mapping)")


def check_messages(messages, row: int) -> None:
    if isinstance(messages, str):  # a CSV export of chat data, or JSON lines with the list written as its JSON
        raise ConfigError(f"row {row}: 'messages' must be a non-empty list of {{role, content}}, got a string "
                          f"({messages!r}): give the list, not its JSON text (a CSV cell holds text alone: write chat "
                          f"data as JSON lines or Parquet)")
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"row {row}: 'messages' must be a non-empty list of {{role, content}}, got {messages!r}")
    for i, message in enumerate(messages):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if calls:  # an empty list is no call (JSON exports give every message one)
            check_tool_calls(message, f"row {row}: message {i}")
        if isinstance(message, dict) and not isinstance(message.get("reasoning_content", ""), (str, type(None))):
            raise ConfigError(f"row {row}: message {i}: 'reasoning_content' must be a string, got {message!r}")
        content = message.get("content") if isinstance(message, dict) else None
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and (isinstance(content, str) or (content is None and calls))):
            raise ConfigError(f"row {row}: message {i} needs a string 'role' and a string 'content' (which an "
                              f"assistant message with tool_calls may leave out), got {message!r}")


def check_tool_calls(message: dict, where: str) -> None:
    """An assistant message's `tool_calls`: a list of {function: {name, arguments}} (or of {name, arguments})."""
    calls = message["tool_calls"] if isinstance(message["tool_calls"], list) else [None]
    functions = [call.get("function", call) if isinstance(call, dict) else None for call in calls]
    if message.get("role") != "assistant" or not all(
            isinstance(function, dict) and isinstance(function.get("name"), str) for function in functions):
        raise ConfigError(f"{where}: 'tool_calls' must be a list of calls ({{function: {{name, arguments}}}}) of an "
                          f"assistant message, got {message!r}")


def check_tools(tools, row: int) -> None:
    """A row's `tools`, as apply_chat_template takes them: a list of function definitions (JSON schemas), or null."""
    if tools is not None and not (isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools)):
        raise ConfigError(f"row {row}: 'tools' must be a list of function definitions ({{type, function}}) or null, "
                          f"got {tools!r}")


def _without_none(value):
    """`value` without the None entries of its dicts, at every depth. A data set read into Arrow columns gives every
    message every key of the schema, None where the message has none (a `tool_calls` on every message, a missing
    argument on every call), and templates test whether a key is there: None stands for absent."""
    if isinstance(value, dict):
        return {key: _without_none(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_none(item) for item in value]
    return value


def _chat_messages(messages: list[dict]) -> list[dict]:
    """The messages as chat templates expect them: no None entries, no empty `tool_calls`, a tool call's
    arguments as a dict (OpenAI's format gives them as a JSON string, which templates would write escaped:
    Llama 3's and Qwen2.5's write `arguments | tojson`), and content "" for a tool call without text."""
    normalized = []
    for i, message in enumerate(_without_none(messages)):
        if not message.get("tool_calls"):
            message.pop("tool_calls", None)
        message.setdefault("content", "")
        for call in message.get("tool_calls", []):
            function = call.get("function", call)
            if isinstance(function.get("arguments"), str):
                try:  # None entries dropped as from an object, for the same text either way
                    function["arguments"] = _without_none(json.loads(function["arguments"]))
                except json.JSONDecodeError as error:
                    raise ConfigError(f"message {i}: the arguments of tool call {function.get('name')!r} are a string "
                                      f"that is not JSON ({error.msg}): give them as an object, or as a JSON string "
                                      "of one") from None
        normalized.append(message)
    return normalized


def _to_messages(example: dict, fmt: str) -> list[dict]:
    if fmt == "chat":
        return _chat_messages(example["messages"])
    user = example["instruction"]
    if example.get("input"):
        user = f"{user}\n\n{example['input']}"
    return [{"role": "user", "content": user}, {"role": "assistant", "content": example["output"]}]


_STAND_IN = "\x00"  # content no real message holds, to find where a template puts a message's content


def _check_nothing_left_out(messages: list[dict], tools: Optional[list], text: str, render) -> None:
    """Stop where the template leaves part of the conversation out of its rendering `text`: the model would be
    trained without it. A user, system or tool message (Mistral's templates write the system message only when a
    user message ends the conversation), the tool calls of an assistant message or the text beside them (Llama 3's
    template drops that text), or the row's tools (a template without tool support drops them). Not the content of
    other assistant messages: Qwen3's template drops an earlier turn's reasoning, which the run counts as left out."""
    checked = [i for i, m in enumerate(messages) if m["role"] != "assistant" or (m.get("tool_calls") and m["content"])]
    unseen = [i for i in checked if messages[i]["content"].strip() not in text]
    calls = [(i, j) for i, m in enumerate(messages) for j in range(len(m.get("tool_calls", [])))]
    if unseen or calls:
        # Content found as written is there, but it may also be written escaped (Llama 3 writes a tool result as a
        # JSON string), and a call's name may stand elsewhere (in the tools): these are replaced by markers, which
        # JSON and trimming leave as they are, and looked for.
        marked = render([_with_markers(m, i, i in unseen) for i, m in enumerate(messages)])
        missing = next((i for i in unseen if f"[message {i}]" not in marked), None)
        if missing is not None:
            role = messages[missing]["role"]
            raise ConfigError(f"the tokenizer's chat template leaves message {missing} ({role}) out of the "
                              f"conversation: {_LEFT_OUT_ADVICE.get(role, _LEFT_OUT_ADVICE['user'])}")
        dropped = next((i for i, j in calls if f"[call {i}.{j}]" not in marked), None)
        if dropped is not None:
            raise ConfigError(f"the tokenizer's chat template leaves the tool calls of message {dropped} out of the "
                              f"conversation: {_USE_A_TOOL_TEMPLATE}")
    if tools and render(messages, tools=None) == text:
        raise ConfigError(f"the tokenizer's chat template leaves the row's tools out of the conversation: "
                          f"{_USE_A_TOOL_TEMPLATE}")


# What to do about a message of each role that the template leaves out (a role not named here: as a user message).
_LEFT_OUT_ADVICE = {
    "user": "move its content into a message the template keeps, or use a tokenizer_name_or_path whose chat template "
            "keeps it",
    "system": "move its content into a message the template keeps (the first user message), or use a "
              "tokenizer_name_or_path whose chat template keeps it",
    "tool": "use a tokenizer_name_or_path whose chat template writes tool messages",
    "assistant": "leave out the text beside its tool calls, or use a tokenizer_name_or_path whose chat template "
                 "writes it",
}
_USE_A_TOOL_TEMPLATE = ("use a tokenizer_name_or_path whose chat template writes tools and tool calls (the default "
                        "template, for a tokenizer without one, writes neither)")


def _with_markers(message: dict, i: int, mark_content: bool) -> dict:
    """The message with its content (if `mark_content`) and the names of its tool calls replaced by markers."""
    marked = {**message, "content": f"[message {i}]"} if mark_content else {**message}
    if message.get("tool_calls"):
        marked["tool_calls"] = [{**call, "function": {**call["function"], "name": f"[call {i}.{j}]"}}
                                if "function" in call else {**call, "name": f"[call {i}.{j}]"}
                                for j, call in enumerate(message["tool_calls"])]
    return marked


def render_with_loss_spans(example: dict, fmt: str, tokenizer, locate_turns: bool = True
                           ) -> tuple[str, list[tuple[int, int]]]:
    """The example as one string, and the character spans of the assistant turns or the completion (none for chat
    without `locate_turns`)."""
    bos = tokenizer.bos_token or ""  # chat templates add their own BOS; plain text gets it here
    if fmt == "text":
        text = bos + example["text"] + tokenizer.eos_token
        return text, []
    if fmt == "prompt_completion":
        text = bos + example["prompt"] + example["completion"] + tokenizer.eos_token
        return text, [(len(bos) + len(example["prompt"]), len(text))]
    messages = _to_messages(example, fmt)
    tools = _without_none(example.get("tools")) or None  # [] too: Llama 3's template writes a tool header for []
    render = lambda msgs, gen=False, tools=tools: tokenizer.apply_chat_template(
        msgs, tools=tools, tokenize=False, add_generation_prompt=gen, date_string=CHAT_TEMPLATE_DATE_STRING)
    text = render(messages)
    _check_nothing_left_out(messages, tools, text, render)
    last_answer = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages) - 1)
    if last_answer < len(messages) - 1:
        # The conversation up to its last answer too: Mistral's templates write the system message into the last user
        # message, so a conversation ending with one would hold it after the answers, which never saw it.
        answered = messages[: last_answer + 1]
        _check_nothing_left_out(answered, tools, render(answered), render)
    if not locate_turns:
        return text, []
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        turn = render(messages[: i + 1])
        if i:
            prompt = render(messages[:i], True)
        else:  # no conversation renders empty: an opening assistant turn starts where a stand-in content does
            header = render([{**message, "content": _STAND_IN}])
            prompt = header[: header.index(_STAND_IN)] if _STAND_IN in header else None
        if prompt is None:
            start = None
        else:
            start = len(prompt) if text.startswith(prompt) else _prompt_end(text, prompt, spans)
        if start is None:
            end = None
        elif text.startswith(turn):
            end = len(turn)
        else:  # the first of these ends whose turn holds the whole assistant message
            ends = (_turn_end_before_closing(text, turn, tokenizer),
                    _earlier_turn_end(text, turn, start))
            end = next((end for end in ends if end is not None and start < end
                        and _holds(text[start:end], message)), None)
        if end is None:
            raise ConfigError("the tokenizer's chat template renders a conversation differently from its prefixes, "
                              "so assistant turns cannot be located: set completion_only_loss false")
        spans.append((start, end))
    return text, spans


def _prompt_end(text: str, prompt: str, spans: list[tuple[int, int]]):
    """Where `prompt`, a turn's generation prompt, ends in `text`, the whole conversation's, when the two render
    earlier assistant turns differently; None if they differ elsewhere. Qwen3 writes a <think> block into an assistant
    turn after the last user message (an empty one into the last message), so the prompt after a tool result or an
    answer holds blocks that the whole chat drops: from turns before a later user message, and from an answer without
    reasoning that is not the last message. `spans`, the earlier turns located in `text`: the prompt must hold the text
    between them as it is, each of them (after what the prompt writes there and the whole chat does not: that block),
    and after the last of them what `text` holds there."""
    position, previous_end = 0, 0
    for start, end in spans:
        between = text[previous_end:start]
        if not prompt.startswith(between, position):
            return None
        found = prompt.find(text[start:end], position + len(between))
        if found == -1:
            return None
        position, previous_end = found + end - start, end
    tail = prompt[position:]  # the messages after the last earlier turn and the generation prompt
    return previous_end + len(tail) if spans and text.startswith(tail, previous_end) else None


def _holds(turn_text: str, message: dict) -> bool:
    """Whether the rendered `turn_text` holds the assistant message's answer (its content after a <think> block) and
    the names of its tool calls. Not its reasoning: Qwen3's template drops that (a reasoning_content, or the <think>
    block of the content) from turns before the last user message; the run counts it as left out."""
    names = [call.get("function", call)["name"] for call in message.get("tool_calls", [])]
    return all(part in turn_text for part in [message["content"].split("</think>")[-1].strip(), *names])


def _turn_end_before_closing(text: str, turn: str, tokenizer):
    """Where the rendering `turn` of a conversation's first messages ends inside `text`, the whole conversation's,
    when `turn` is a prefix of `text` followed by what the template puts at the end of every conversation (Phi-3's
    EOS after the last turn), which `text` then ends with too; None otherwise.

    Compared in tokens, so that the turn cannot end inside a special token (`<|end|>` and `<|endoftext|>` share
    their first characters).
    """
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    text_ids, turn_ids = encoded["input_ids"], tokenizer(turn, add_special_tokens=False)["input_ids"]
    shared = 0
    while shared < min(len(text_ids), len(turn_ids)) and text_ids[shared] == turn_ids[shared]:
        shared += 1
    closing = turn_ids[shared:]
    if not closing or shared == len(text_ids) or text_ids[-len(closing):] != closing:
        return None
    return encoded["offset_mapping"][shared][0]


def _earlier_turn_end(text: str, turn: str, start: int):
    """Where an earlier assistant turn ends in `text` when the template renders the last turn differently (Qwen3
    writes an empty <think> block only into the last turn): the end of the longest tail of `turn` (the turn rendered
    as the last message) that `text` holds right at `start`, after the generation prompt; None if none does. The
    tail is the turn's content, or its tool calls, and what closes it (Qwen3's `<|im_end|>\n`); one of whitespace
    alone holds neither."""
    if start >= len(text):
        return None
    # Only tails that start with the character `text` has at `start` can match; the first found is the longest.
    tail_start = turn.find(text[start], start)
    while tail_start != -1:
        if text.startswith(turn[tail_start:], start):
            return start + len(turn) - tail_start if turn[tail_start:].strip() else None
        tail_start = turn.find(text[start], tail_start + 1)
    return None


def turn_closing_token_id(tokenizer) -> Optional[int]:
    """The special token that closes an assistant turn in the tokenizer's chat template, where it has one: a base
    model's template may close turns with a token other than its EOS (Qwen's <|im_end|>, Llama 3's <|eot_id|>)."""
    if tokenizer.chat_template is None:
        return None
    probe = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}
    try:
        text, [(start, end)] = render_with_loss_spans(probe, "chat", tokenizer)
    except (ConfigError, jinja2.TemplateError):
        return None
    after_answer = text.find("y", start, end) + 1  # the turn may open with template text (Qwen3's <think> block)
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return next((token for token, (char_start, _) in zip(encoded["input_ids"], encoded["offset_mapping"])
                 if after_answer <= char_start < end and token in special), None)


def overlaps_a_span(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """Whether each token, by its (char_start, char_end), overlaps one of the character spans that carry loss:
    byte-level BPE joins a prompt's trailing space to the answer's first word (' yes'), which must still be learnt.
    Zero-width tokens count where they start.

    A token overlaps a span that starts before the token ends and ends after it starts: with the spans sorted by
    start, the largest end among those that start before the token ends says it, found by bisection. Each token
    against each span took most of a long chat's time (0.4 s for a 50-turn chat of 12,000 tokens)."""
    tokens = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    if not spans:
        return np.zeros(len(tokens), dtype=bool)
    starts, ends = np.asarray(sorted(spans), dtype=np.int64).T
    token_ends = np.maximum(tokens[:, 1], tokens[:, 0] + 1)
    started = np.searchsorted(starts, token_ends, side="left")  # spans that start before each token ends
    largest_end = np.maximum.accumulate(ends)[np.maximum(started - 1, 0)]
    return (started > 0) & (largest_end > tokens[:, 0])


def _reasoning(message: dict) -> str:
    """An assistant message's reasoning: its reasoning_content, else the <think> block of its content, which Qwen3's
    template takes out of the content as it takes reasoning_content (and drops before the last user message)."""
    if isinstance(message.get("reasoning_content"), str):
        return message["reasoning_content"].strip()
    content = message.get("content") or ""
    return content.split("</think>")[0].split("<think>")[-1].strip() if "</think>" in content else ""


def tokenize_example(example: dict, fmt: str, tokenizer, max_seq_length: int, completion_only_loss: bool = True,
                     row: int = 1) -> dict:
    """input_ids and labels (IGNORE_INDEX where no loss is taken), cut to max_seq_length; `has_labels` if a token
    after the first carries loss; `overlong` if it was cut; `reasoning_left_out`: how many assistant messages'
    reasoning (see _reasoning) the chat template does not write.

    With completion_only_loss, loss is on assistant turns and completions (on every token of plain text);
    without it, on every token. `row`, the example's number in its split counting from 1, names it in errors.
    """
    if fmt == "chat":
        check_messages(example["messages"], row)
        check_tools(example.get("tools"), row)
    elif example.get("tools"):
        raise ConfigError(f"row {row}: a 'tools' column is read with chat data (a 'messages' column) only, and this "
                          f"data set is read as {fmt}: write the rows as messages, or remove the column")
    # An instruction row's optional `input` too: a number would be written into the prompt as its text.
    columns = FORMATS[fmt] + (["input"] if fmt == "instruction" and example.get("input") is not None else [])
    for column in columns:
        if fmt != "chat" and not isinstance(example[column], str):
            conversational = fmt == "prompt_completion" and isinstance(example[column], list)
            hint = ("; a prompt and a completion as lists of messages (TRL's conversational format) are not read: "
                    "write each row's prompt messages, then its completion messages, as one 'messages' list"
                    ) if conversational else ""
            raise ConfigError(f"row {row}: '{column}' must be a string, got {example[column]!r}{hint}")
    try:
        text, spans = render_with_loss_spans(example, fmt, tokenizer, locate_turns=completion_only_loss)
    except jinja2.TemplateError as error:  # e.g. raise_exception('System role not supported') in the template
        raise ConfigError(f"row {row}: the tokenizer's chat template refuses this conversation: {error}") from None
    except ConfigError as error:
        raise ConfigError(f"row {row}: {error}") from None
    if not completion_only_loss or fmt == "text":
        spans = [(0, len(text))]
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = encoded["input_ids"]
    labels = np.where(overlaps_a_span(encoded["offset_mapping"], spans), input_ids, IGNORE_INDEX).tolist()
    # Reasoning the template does not write (Llama's, Qwen2.5's; Qwen3's before the last user message) is trained
    # without: counted, so that the run says so.
    reasoning = [_reasoning(m) for m in example.get("messages") or []
                 if m.get("role") == "assistant"] if fmt == "chat" else []
    labels = labels[:max_seq_length]
    return {"input_ids": input_ids[:max_seq_length], "labels": labels,
            # The first token is never predicted, so a label there alone teaches nothing.
            "has_labels": any(label != IGNORE_INDEX for label in labels[1:]),
            "overlong": len(input_ids) > max_seq_length,
            "reasoning_left_out": sum(1 for r in reasoning if r and r not in text)}
