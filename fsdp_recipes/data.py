"""Data: load a data set, render each example to text, tokenize it with a loss mask, and batch it per rank."""

from __future__ import annotations

import os
from typing import Iterator, Optional

import datasets
import torch
from torch.utils.data import DataLoader, DistributedSampler

from .config import ConfigError, TrainConfig
from .distributed import main_process_first, print_rank0

IGNORE_INDEX = -100  # label of a token that carries no loss (prompt, padding)

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
_FORMATS = {
    "chat": ["messages"],
    "instruction": ["instruction", "output"],
    "prompt_completion": ["prompt", "completion"],
    "text": ["text"],
}


def load_raw_dataset(name: str, config_name: Optional[str] = None, split: str = "train") -> datasets.Dataset:
    """A hub id, a local data file, or a folder written by `Dataset.save_to_disk`."""
    if os.path.isfile(name):
        builder = _FILE_BUILDERS.get(os.path.splitext(name)[1])
        if builder is None:
            raise ConfigError(f"{name}: unsupported file type; use one of {', '.join(_FILE_BUILDERS)}")
        dataset = datasets.load_dataset(builder, data_files={split: name}, split=split)
    elif os.path.isdir(name) and os.path.exists(os.path.join(name, "dataset_info.json")):
        dataset = datasets.load_from_disk(name)
        if isinstance(dataset, datasets.DatasetDict):
            dataset = dataset[split]
    else:
        dataset = datasets.load_dataset(name, config_name, split=split)
    if len(dataset) == 0:
        raise ConfigError(f"{name} (split {split}) holds no examples")
    return dataset


def detect_format(columns: list[str]) -> str:
    for fmt, needed in _FORMATS.items():
        if all(c in columns for c in needed):
            return fmt
    expected = "; ".join(f"{fmt}: {', '.join(cols)}" for fmt, cols in _FORMATS.items())
    raise ConfigError(f"cannot tell the data format from the columns {columns}; expected one of: {expected}")


def _to_messages(example: dict, fmt: str) -> list[dict]:
    if fmt == "chat":
        return example["messages"]
    user = example["instruction"]
    if example.get("input"):
        user = f"{user}\n\n{example['input']}"
    return [{"role": "user", "content": user}, {"role": "assistant", "content": example["output"]}]


def _render_with_loss_spans(example: dict, fmt: str, tokenizer) -> tuple[str, list[tuple[int, int]]]:
    """The example as one string, and the character spans that carry loss (assistant turns, completions)."""
    if fmt == "text":
        text = example["text"] + tokenizer.eos_token
        return text, [(0, len(text))]
    if fmt == "prompt_completion":
        text = example["prompt"] + example["completion"] + tokenizer.eos_token
        return text, [(len(example["prompt"]), len(text))]
    messages = _to_messages(example, fmt)
    render = lambda msgs, gen: tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    text = render(messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt, turn = render(messages[:i], True), render(messages[: i + 1], False)
        if not (text.startswith(prompt) and text.startswith(turn)):
            raise ConfigError("the tokenizer's chat template renders a conversation differently from its prefixes")
        spans.append((len(prompt), len(turn)))
    return text, spans


def tokenize_example(example: dict, fmt: str, tokenizer, max_seq_length: int) -> dict:
    """input_ids and labels of one example; labels are IGNORE_INDEX where no loss is taken."""
    text, spans = _render_with_loss_spans(example, fmt, tokenizer)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = encoded["input_ids"][:max_seq_length]
    labels = [
        token if any(start <= char_start < end for start, end in spans) else IGNORE_INDEX
        for token, (char_start, _) in zip(input_ids, encoded["offset_mapping"])
    ]
    return {"input_ids": input_ids, "labels": labels}


def build_train_dataset(cfg: TrainConfig, tokenizer) -> datasets.Dataset:
    """Tokenized training set. Rank 0 tokenizes first and fills the datasets cache; the others read it."""
    with main_process_first():
        raw = load_raw_dataset(cfg.dataset_name, cfg.dataset_config_name, cfg.dataset_split)
        fmt = detect_format(raw.column_names)
        tokenized = raw.map(
            tokenize_example,
            fn_kwargs={"fmt": fmt, "tokenizer": tokenizer, "max_seq_length": cfg.max_seq_length},
            remove_columns=raw.column_names,
            desc="Tokenizing",
        )
        # An example whose answer was cut off entirely by truncation teaches nothing.
        tokenized = tokenized.filter(lambda ex: any(label != IGNORE_INDEX for label in ex["labels"][1:]))
    dropped = len(raw) - len(tokenized)
    print_rank0(f"data: {len(tokenized)} examples ({fmt} format), {dropped} dropped for having no label tokens")
    return tokenized


def collate(examples: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Pad to the longest sequence of the batch, not to max_seq_length."""
    length = max(len(ex["input_ids"]) for ex in examples)
    input_ids = torch.full((len(examples), length), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    for i, ex in enumerate(examples):
        n = len(ex["input_ids"])
        input_ids[i, :n] = torch.tensor(ex["input_ids"])
        labels[i, :n] = torch.tensor(ex["labels"])
        attention_mask[i, :n] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def build_dataloader(dataset, cfg: TrainConfig, tokenizer, rank: int, world_size: int) -> DataLoader:
    """Each rank reads a disjoint, equally long part of the data (drop_last), so no rank waits on another."""
    if len(dataset) < world_size * cfg.per_device_train_batch_size:
        raise ConfigError(
            f"{len(dataset)} examples cannot fill one batch of {cfg.per_device_train_batch_size} on each of "
            f"{world_size} ranks: lower per_device_train_batch_size or add data"
        )
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True)
    return DataLoader(
        dataset.with_format(None),
        batch_size=cfg.per_device_train_batch_size,
        sampler=sampler,
        collate_fn=lambda examples: collate(examples, tokenizer.pad_token_id),
        drop_last=True,
    )


def optimizer_step_batches(loader: DataLoader, accumulation: int, start_step: int = 0) -> Iterator[list[dict]]:
    """Endless stream of optimizer steps, each a list of `accumulation` micro-batches, reshuffled every epoch.

    Micro-batches left over at the end of an epoch (fewer than `accumulation`) are dropped, so every step has
    the same shape on every rank. `start_step` skips that many steps (on resume): the epoch and the sampler order
    are the same as in an uninterrupted run, and skipped batches are never loaded.
    """
    steps_per_epoch = len(loader) // accumulation
    epoch, skip = divmod(start_step, steps_per_epoch)
    while True:
        loader.sampler.set_epoch(epoch)
        epoch_loader = loader
        if skip:
            # Drop the first batches' indices only; the sampler order is that of set_epoch(epoch).
            batches = list(loader.batch_sampler)[skip * accumulation:]
            epoch_loader = DataLoader(loader.dataset, batch_sampler=batches, collate_fn=loader.collate_fn)
            skip = 0
        step: list[dict] = []
        for batch in epoch_loader:
            step.append(batch)
            if len(step) == accumulation:
                yield step
                step = []
        epoch += 1
