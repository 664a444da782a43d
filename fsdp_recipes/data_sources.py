"""Where the raw examples come from: a hub id, a local file or a saved folder; splits, column renames, mixtures."""

from __future__ import annotations

import json
import os
from typing import Optional

import datasets

from .config import ConfigError

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def _is_saved_folder(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, f)) for f in ("dataset_info.json", "dataset_dict.json"))


def _first_bad_json_line(path: str) -> Optional[str]:
    """'line N: reason' for the first line of a JSON-lines file that is not valid JSON, else None."""
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                try:
                    json.loads(line)
                except json.JSONDecodeError as error:
                    return f"line {number}: {error.msg}"
    return None


def _parse_error(path: str, error: Exception) -> ConfigError:
    """Name the file and, where it can be found, the line: datasets' own message names neither."""
    where = None
    if path.endswith(".jsonl"):
        where = _first_bad_json_line(path)
    elif path.endswith(".json"):
        try:
            with open(path) as f:
                json.load(f)
        except json.JSONDecodeError as decode_error:
            where = f"line {decode_error.lineno}: {decode_error.msg}"
    if where is None:
        cause = error
        while cause.__cause__ is not None:
            cause = cause.__cause__
        where = str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__
    return ConfigError(f"cannot parse {path}, {where}")


def load_split(name: str, config_name: Optional[str], split: str) -> datasets.Dataset:
    """One split of a hub data set, a local json/jsonl/csv/parquet file (its only split), or a saved folder."""
    if os.path.isfile(name):
        builder = _FILE_BUILDERS.get(os.path.splitext(name)[1])
        if builder is None:
            raise ConfigError(f"{name}: unsupported file type; use one of {', '.join(_FILE_BUILDERS)}")
        if os.path.getsize(name) == 0:
            raise ConfigError(f"{name} is empty: it holds no examples")
        try:
            dataset = datasets.load_dataset(builder, data_files={"train": name}, split="train")
        except Exception as error:  # the json/csv/parquet readers raise many types, none naming the line
            if "corresponds to no data" in str(error):  # datasets' words for a file that yields no rows
                raise ConfigError(f"{name} holds no examples") from None
            raise _parse_error(name, error) from error
    elif os.path.isdir(name) and _is_saved_folder(name):
        dataset = _load_saved_folder(name, split)
    else:
        dataset = datasets.load_dataset(name, config_name, split=split)
    if len(dataset) == 0:
        raise ConfigError(f"{name} (split {split}) holds no examples")
    return dataset


def _load_saved_folder(name: str, split: str) -> datasets.Dataset:
    """A `save_to_disk` folder: a Dataset, or the one split wanted of a DatasetDict, read alone so that another
    split cannot break the load."""
    path = name
    dict_file = os.path.join(name, "dataset_dict.json")
    if os.path.isfile(dict_file):
        with open(dict_file) as f:
            splits = json.load(f)["splits"]
        if split not in splits:
            raise ConfigError(f"{name} has no split '{split}'; its splits are {splits}")
        path = os.path.join(name, split)
    try:
        return datasets.load_from_disk(path)
    except IndexError:  # datasets cannot read back a split saved with no rows
        raise ConfigError(f"{path} holds no examples") from None


def parse_column_mapping(mapping: Optional[str]) -> dict[str, str]:
    """'question=prompt,answer=completion' -> {'question': 'prompt', 'answer': 'completion'}."""
    if not mapping:
        return {}
    pairs = [item.split("=") for item in mapping.split(",")]
    if any(len(pair) != 2 or not all(p.strip() for p in pair) for pair in pairs):
        raise ConfigError(f"dataset_column_mapping must look like 'question=prompt,answer=completion', got '{mapping}'")
    return {source.strip(): target.strip() for source, target in pairs}


def rename_columns(dataset: datasets.Dataset, mapping: dict[str, str]) -> datasets.Dataset:
    present = {source: target for source, target in mapping.items() if source in dataset.column_names}
    return dataset.rename_columns(present) if present else dataset


def load_sources(names: list[str], config_name: Optional[str], split: str, eval_split: Optional[str],
                 column_mapping: dict[str, str]) -> list[tuple[datasets.Dataset, Optional[datasets.Dataset]]]:
    """(train, given eval split or None) per source, with columns renamed."""
    sources = []
    for name in names:
        train = load_split(name, config_name, split)
        held_out = None
        if eval_split:
            if os.path.isfile(name):
                raise ConfigError(f"{name} is a single file with one split: use eval_fraction instead of eval_split")
            held_out = load_split(name, config_name, eval_split)
        sources.append((train, held_out))
    found = sorted({c for train, _ in sources for c in train.column_names})
    for source in column_mapping:
        if source not in found:
            raise ConfigError(f"dataset_column_mapping renames '{source}', which no data set has; "
                              f"columns found: {found}")
    rename = lambda dataset: None if dataset is None else rename_columns(dataset, column_mapping)
    return [(rename(train), rename(held_out)) for train, held_out in sources]


def carve_eval(dataset: datasets.Dataset, fraction: float, seed: int, name: str):
    """(train, eval): a seeded random `fraction` of the examples held out for evaluation."""
    n_eval = int(len(dataset) * fraction)
    if n_eval == 0 or n_eval == len(dataset):
        raise ConfigError(f"eval_fraction={fraction} of the {len(dataset)} examples of {name} leaves an empty train "
                          "or eval split")
    parts = dataset.train_test_split(test_size=n_eval, seed=seed)
    return parts["train"], parts["test"]


def weighted_sample(dataset: datasets.Dataset, weight: float, seed: int) -> datasets.Dataset:
    """round(weight x len) examples: whole copies for the integer part, a seeded random subset for the rest."""
    n = round(weight * len(dataset))
    if n == 0:
        raise ConfigError(f"dataset weight {weight} of a data set of {len(dataset)} examples keeps none of them")
    copies, rest = divmod(n, len(dataset))
    parts = [dataset] * copies
    if rest:
        parts.append(dataset.shuffle(seed=seed).select(range(rest)))
    return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
