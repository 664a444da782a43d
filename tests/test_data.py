"""Tokenization with loss masks, and batching."""

import torch

from fsdp_recipes import demo
from fsdp_recipes.data import IGNORE_INDEX, collate, detect_format, tokenize_example


def test_chat_example_takes_loss_on_the_assistant_turn_only():
    tokenizer = demo.build_tokenizer()
    example = {"messages": [{"role": "user", "content": "reverse: abc"}, {"role": "assistant", "content": "cba"}]}
    out = tokenize_example(example, "chat", tokenizer, max_seq_length=64)
    assert tokenizer.decode(out["input_ids"]) == "<|user|>reverse: abc<|end|><|assistant|>cba<|end|>"
    loss_tokens = [t for t, label in zip(out["input_ids"], out["labels"]) if label != IGNORE_INDEX]
    assert tokenizer.convert_ids_to_tokens(loss_tokens) == ["c", "b", "a", "<|end|>"]
    assert [label for label in out["labels"] if label != IGNORE_INDEX] == loss_tokens


def test_truncation_keeps_the_first_tokens():
    tokenizer = demo.build_tokenizer()
    example = {"prompt": "abc", "completion": "defg"}
    out = tokenize_example(example, "prompt_completion", tokenizer, max_seq_length=5)
    assert tokenizer.convert_ids_to_tokens(out["input_ids"]) == ["a", "b", "c", "d", "e"]
    assert out["labels"][:3] == [IGNORE_INDEX] * 3 and out["labels"][3:] == out["input_ids"][3:]


def test_formats_are_detected_from_columns():
    assert detect_format(["messages", "id"]) == "chat"
    assert detect_format(["instruction", "input", "output"]) == "instruction"
    assert detect_format(["prompt", "completion"]) == "prompt_completion"
    assert detect_format(["text"]) == "text"


def test_collate_pads_to_the_longest_in_the_batch():
    batch = collate([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}], 0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["input_ids"].dtype == torch.long
