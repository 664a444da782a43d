"""Where the raw examples come from: a hub id, a local file or a saved folder; splits, column renames, mixtures."""

from __future__ import annotations

import contextlib
import csv
import fractions
import functools
import hashlib
import itertools
import json
import math
import os
from typing import Callable, Iterator, Optional

import datasets
import fsspec
import pandas
import pyarrow
import pyarrow.parquet
from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns
from datasets.packaged_modules import _EXTENSION_TO_MODULE
from datasets.packaged_modules.json.json import Json
from huggingface_hub import metadata_load

from .config import ConfigError, is_local_path, looked_in

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
# Compressions datasets' readers undo: data.jsonl.gz is read as data.jsonl.
_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
# The file types load_dataset takes a folder's files for data by (and zip archives, which it looks into). Harbor's
# .md and .toml describe agent tasks (datasets 5): beside data files they are documentation, a LICENSE.md.
_DATA_TYPES = {ext.lower() for ext, (module, _) in _EXTENSION_TO_MODULE.items() if module != "harbor"} | {".zip"}


def _file_type(path: str) -> str:
    """The extension that names a data file's reader: '.jsonl' for data.jsonl, data.JSONL and data.jsonl.gz."""
    stem, extension = os.path.splitext(path.lower())
    return os.path.splitext(stem)[1] if extension in _COMPRESSIONS else extension


def _open_text(path: str):
    """A data file as text, decompressed as its extension says (fsspec, as datasets opens it). Bytes that are not
    UTF-8 are replaced: they do not move lines, and the error for them names their line (_first_line_not_utf8)."""
    return fsspec.open(path, "rt", compression="infer", encoding="utf-8", errors="replace", newline="")


def _is_empty(path: str) -> bool:
    """Whether a data file holds no rows: 0 bytes, decompressed (an empty file compressed is gzip's header), a JSON
    Lines file of a byte order mark alone, a CSV file of a header alone (pandas' and Dask's empty partitions), a JSON
    file of an empty array (pandas' to_json(orient="records") of an empty partition), or a Parquet file of no rows
    (its schema alone), which datasets' reader fails on ('BatchSize must be greater than 0')."""
    if _file_type(path) == ".csv":
        return next(itertools.islice(_csv_rows(path), 1, None), None) is None
    if _file_type(path) == ".json":
        with _open_text(path) as f:
            head = f.read(4096).lstrip("\ufeff").lstrip()  # a byte order mark, which datasets' reader skips
        return not head or (head[0] == "[" and head[1:].lstrip()[:1] == "]")
    if _file_type(path) == ".jsonl":  # a byte order mark alone (an empty export in UTF-8-sig) is a parse error there
        with _open_text(path) as f:
            return not f.read(2).lstrip("\ufeff")
    if path.lower().endswith(_COMPRESSIONS):
        with fsspec.open(path, "rb", compression="infer") as f:
            return not f.read(1)
    if os.path.getsize(path) == 0:
        return True
    if _file_type(path) != ".parquet":
        return False
    try:
        return pyarrow.parquet.read_metadata(path).num_rows == 0
    except pyarrow.ArrowException:  # not Parquet: the reader's error names it
        return False


def cache_path(name: str) -> str:
    """A local file or folder as an absolute, normalised path, else `name` (a Hub id): what datasets is given, and
    what keys the tokenization's cache. datasets keys its converted copy by the path as written, so data.jsonl,
    ./data.jsonl, an absolute path and a run from another working directory would each convert and tokenize the
    data again, and keep one more copy of it in the cache."""
    return os.path.abspath(name) if os.path.exists(name) else name


def _is_saved_folder(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, f)) for f in ("dataset_info.json", "dataset_dict.json"))


def _is_files_folder(path: str) -> bool:
    """A folder of data files, not saved with save_to_disk, and without a dataset card that names its configs (a
    local copy of a Hub data set, which load_dataset reads as the Hub would)."""
    if not os.path.isdir(path) or _is_saved_folder(path):
        return False
    card = os.path.join(path, "README.md")
    return not (os.path.isfile(card) and (metadata_load(card) or {}).get("configs"))


def _first_line_not_utf8(path: str) -> Optional[str]:
    """'line N: reason' for the first line of a text data file that is not UTF-8, else None."""
    with fsspec.open(path, "rb", compression="infer") as f:
        for number, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as error:
                return (f"line {number}: not UTF-8 text ({error.reason} at byte {error.start} of the line): save it "
                        f"as UTF-8")
    return None


def _first_bad_json_line(path: str) -> Optional[str]:
    """'line N: reason' for the first line of a JSON-lines file that is not valid JSON, else None."""
    with _open_text(path) as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                try:
                    json.loads(line)
                except json.JSONDecodeError as error:
                    return f"line {number}: {error.msg}"
    return None


def _first_line_not_an_object(path: str) -> Optional[str]:
    """'line N: ...' for the first line of a JSON-lines file whose value is not an object (a string, a list: lines
    joined from other files), else None; None too for a file whose first value is no object (one JSON array)."""
    with _open_text(path) as f:
        values = ((number, json.loads(line)) for number, line in enumerate(f, start=1) if line.strip())
        first = next(values, None)
        if first is None or not isinstance(first[1], dict):
            return None
        for number, value in itertools.chain([first], values):
            if not isinstance(value, (dict, type(None))):  # null is read as a row of nulls
                return (f"line {number}: {_json_kind(value)}, not an object: write each row as a JSON object "
                        f"({{...}}) on a line of its own")
    return None


def _json_kind(value) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):  # an integer column takes a float: pyarrow makes it a double
        return "a number"
    return "a string" if isinstance(value, str) else "a list" if isinstance(value, list) else "an object"


def _first_json_type_conflict(path: str) -> Optional[str]:
    """'line N: ...' for the first line of a JSON-lines file whose field holds another kind of value (a number, a
    string, a list) than an earlier line's, else None. Null goes with any kind."""
    seen = {}
    with _open_text(path) as f:
        for number, line in enumerate(f, start=1):
            row = json.loads(line) if line.strip() else {}
            for key, value in (row.items() if isinstance(row, dict) else ()):
                if value is None:
                    continue
                first_number, kind = seen.setdefault(key, (number, _json_kind(value)))
                if _json_kind(value) != kind:
                    return (f"line {number}: '{key}' is {_json_kind(value)}, and on line {first_number} {kind}: "
                            f"give the field one type in every row")
    return None


def _first_line(path: str) -> str:
    """The first non-blank line of a text file ("" for none)."""
    with _open_text(path) as f:
        return next((line for line in f if line.strip()), "")


def _first_value_is_a_line(path: str) -> bool:
    """Whether the first non-blank line of a file is a JSON value alone, as in a JSON-lines file."""
    try:
        json.loads(_first_line(path))
    except json.JSONDecodeError:
        return False
    return True


def _parse_error(path: str, error: Exception) -> ConfigError:
    """Name the file and, where it can be found, the line: datasets' own message names neither."""
    where = _first_line_not_utf8(path) if _file_type(path) in (".jsonl", ".json", ".csv") else None
    if where is None and _file_type(path) == ".jsonl":
        # Every line parsing, a field's type changing on a line is what the readers failed on.
        where = _first_bad_json_line(path) or _first_line_not_an_object(path) or _first_json_type_conflict(path)
    elif where is None and _file_type(path) == ".json":
        try:
            with _open_text(path) as f:
                json.load(f)
        except json.JSONDecodeError as decode_error:
            # A second value after a first that is a line of its own: JSON lines, which datasets reads from a .json
            # file too (as Dataset.to_json writes them), whose bad line is another one. After a pretty-printed
            # array, the extra data are the error.
            lines_file = decode_error.msg == "Extra data" and _first_value_is_a_line(path)
            where = ((_first_bad_json_line(path) or _first_line_not_an_object(path)
                      or _first_json_type_conflict(path)) if lines_file
                     else f"line {decode_error.lineno}: {decode_error.msg}")
    if where is None:
        cause = error
        while cause.__cause__ is not None:
            cause = cause.__cause__
        where = str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__
    return ConfigError(f"cannot parse {path}, {where}")


def load_split(name: str, config_name: Optional[str], split: str) -> datasets.Dataset:
    """The rows `split` names of a hub data set, a local json/jsonl/csv/parquet file or a saved folder.

    `split` is a split name, a slice of one ('train[:1000]', 'train[90%:]') or several joined by '+', as
    `datasets` reads them. A file, and a folder saved from a single Dataset, hold one split: 'train'.
    """
    instruction = _parse_split(name, split)
    if not os.path.exists(name) and (_file_type(name) in _FILE_BUILDERS or is_local_path(name)):
        raise ConfigError(f"dataset_name {name}: no such file or folder{looked_in(name)}")
    if config_name and (os.path.isfile(name) or _is_saved_folder(name) or _is_files_folder(name)):
        kind = ("file" if os.path.isfile(name) else "save_to_disk folder" if _is_saved_folder(name) else
                "folder of data files without a dataset card (README.md) that names configs")
        raise ConfigError(f"dataset_config_name {config_name} is for a Hub data set (or a local copy of one); {name} "
                          f"is a {kind}: remove dataset_config_name, or in a mixture give one per data set, empty for "
                          "this one (such as ',main')")
    if os.path.isfile(name):
        dataset = _take_split(name, split, instruction, {"train": lambda: _load_file(name)},
                              "a single file holds one split")
    elif os.path.isdir(name) and _is_saved_folder(name):
        dataset = _load_saved_folder(name, split, instruction)
    elif _is_files_folder(name):
        dataset = _load_files_folder(name, split, instruction)
    else:
        try:
            dataset = _load_hub_data_set(name, config_name, split)
        except ValueError as error:
            if "Config name is missing" in str(error):  # datasets' words list the configs that exist
                configs = next((line for line in str(error).splitlines() if "available configs" in line), "")
                raise ConfigError(f"{name} holds several configs: set dataset_config_name. {configs}") from None
            if "BuilderConfig" in str(error) and "not found" in str(error):  # names the configs that exist
                raise ConfigError(f"{name}: dataset_config_name {config_name}: {error}") from None
            if "Unknown split" not in str(error):
                raise
            raise ConfigError(f"{name}: {error}") from None  # datasets' words list the splits that exist
        except FileNotFoundError as error:  # datasets' DatasetNotFoundError among them
            raise ConfigError(f"dataset_name {name}: {error}") from None
        except ConnectionError as error:  # not a local path, so taken for a Hub id; offline, or no network
            # datasets reads a Hub data set offline from its own prepared copy alone, not from the files that
            # `hf download` puts in the hub cache.
            raise ConfigError(f"dataset_name {name}: no such file or folder in {os.getcwd()}, and the Hub cannot be "
                              f"reached to look for a data set of that name ({error}), nor does the datasets cache "
                              f"{datasets.config.HF_DATASETS_CACHE} hold a copy of it: load it once with "
                              f"datasets.load_dataset where the Hub can be reached, with the same HF_HOME (or "
                              f"HF_DATASETS_CACHE), or set HF_HOME to the cache that holds it") from None
    if len(dataset) == 0:
        raise ConfigError(f"{name} (split {split}) holds no examples")
    return dataset


def row_origin(name: str, split: str, index: int) -> Optional[str]:
    """Where row `index` (from 0) of `split` of a data file or a folder of them was read: the line where the row
    starts (JSON lines, CSV) or the row's number in the file (JSON, Parquet), counting from 1, after the file's path
    in a folder ('b.jsonl, line 3'). None for a Hub data set or a save_to_disk folder. Reads the files again (from
    the datasets cache): for an error message only."""
    if os.path.isfile(name):
        split_files = {"train": [name]}
    elif _is_files_folder(name):
        split_files = _folder_files(name)
    else:
        return None
    instruction = _parse_split(name, split)
    wanted = {part.splitname for part in instruction.to_absolute(dict.fromkeys(split_files, 0))}
    lengths = {splitname: [len(_load_file(file)) for file in split_files[splitname]] for splitname in wanted}
    for part in instruction.to_absolute({splitname: sum(counts) for splitname, counts in lengths.items()}):
        if index >= part.to - part.from_:
            index -= part.to - part.from_
            continue
        row = part.from_ + index
        for file, count in zip(split_files[part.splitname], lengths[part.splitname]):
            if row < count:
                place = _row_place(file, row)
                return f"{os.path.relpath(file, name)}, {place}" if os.path.isdir(name) else place
            row -= count
    return None


def _row_place(file: str, row: int) -> str:
    """'line N' where row `row` (from 0) of a JSON-lines or CSV file starts (blank lines are no rows), else 'row N'
    (also for a .jsonl file that holds one JSON array, which datasets reads too: its rows are no lines)."""
    if _file_type(file) == ".jsonl" and not _first_line(file).lstrip().startswith("["):
        with _open_text(file) as f:
            lines = (number for number, line in enumerate(f, start=1) if line.strip())
            line = next(itertools.islice(lines, row, None), None)
        if line is not None:
            return f"line {line}"
    elif _file_type(file) == ".csv":
        line, _ = next(itertools.islice(_csv_rows(file), row + 1, None))  # after the header
        return f"line {line}"
    return f"row {row + 1}"


def _load_hub_data_set(name: str, config_name: Optional[str], split: str) -> datasets.Dataset:
    """A Hub data set, or a local copy whose card names its configs. JSON lines are read in pieces of
    _JSON_PIECE_MAX, not datasets' 10 MB, as a local file is (see _json_chunksize); their size is not known here."""
    builder = datasets.load_dataset_builder(cache_path(name), config_name)
    options = {"chunksize": _JSON_PIECE_MAX} if isinstance(builder, Json) else {}
    return datasets.load_dataset(cache_path(name), config_name, split=split, **options)


def _parse_split(name: str, split: str) -> datasets.ReadInstruction:
    try:
        return datasets.ReadInstruction.from_spec(split)
    except ValueError as error:
        raise ConfigError(f"{name}: cannot read the split '{split}' ({error}); give a split name, a slice such as "
                          "'train[:1000]' or 'train[90%:]', or several joined by '+'") from None


def _take_split(name: str, split: str, instruction: datasets.ReadInstruction,
                loaders: dict[str, Callable[[], datasets.Dataset]], single: Optional[str] = None) -> datasets.Dataset:
    """The rows of `split` (names and slices) among the splits that `loaders` read; each named split is read once,
    and only those named."""
    try:  # lengths 0: only the names are checked here
        wanted = dict.fromkeys(part.splitname for part in instruction.to_absolute(dict.fromkeys(loaders, 0)))
    except ValueError:
        hint = (f" ({single}: slices such as 'train[:1000]' select rows; hold out examples with eval_fraction, or "
                "save a DatasetDict with save_to_disk)") if single else ""
        raise ConfigError(f"{name} has no split '{split}'; its splits are {list(loaders)}{hint}") from None
    loaded = {splitname: loaders[splitname]() for splitname in wanted}
    parts = [loaded[part.splitname] if (part.from_, part.to) == (0, len(loaded[part.splitname]))
             else loaded[part.splitname].select(range(part.from_, part.to))
             for part in instruction.to_absolute({splitname: len(d) for splitname, d in loaded.items()})]
    return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]


def _load_file(name: str) -> datasets.Dataset:
    builder = _FILE_BUILDERS.get(_file_type(name))
    if builder is None:
        raise ConfigError(f"{name}: unsupported file type; use one of {', '.join(_FILE_BUILDERS)} (or one of them "
                          f"compressed: {', '.join(_COMPRESSIONS)})")
    if _is_empty(name):
        raise ConfigError(f"{name} is empty: it holds no examples")
    try:
        options = {}
        if builder == "csv":
            options = _csv_as_text(name)
        elif builder == "json":
            options = {"chunksize": _json_chunksize(name)}
        return _load_local(builder, cache_path(name), **options)
    except ConfigError:
        raise
    except Exception as error:  # the json/csv/parquet readers raise many types, none naming the line
        if "corresponds to no data" in str(error):  # datasets' words for a file that yields no rows
            raise ConfigError(f"{name} holds no examples") from None
        raise _parse_error(name, error) from error


def _load_local(builder: str, files, **options) -> datasets.Dataset:
    """A local file or a list of them (`files`) through one of datasets' packaged builders (json, csv, parquet,
    arrow), as split 'train'.

    Without datasets' download count: load_dataset sends a HEAD request to the Hub's S3 bucket for every call, a
    local file's too (timeout 3 s): a folder of 500 part files took 92 s to read, cached or not, on every rank (1.7 s
    without), and a node whose outgoing connections are dropped would wait 3 s a file. Counting reads of the json
    builder tells the Hub nothing about a data set; a Hub data set's own load still counts."""
    with _download_counts_off():
        return datasets.load_dataset(builder, data_files={"train": files}, split="train", **options)


@contextlib.contextmanager
def _download_counts_off():
    counts = datasets.config.HF_UPDATE_DOWNLOAD_COUNTS
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    try:
        yield
    finally:
        datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = counts


# pyarrow's JSON reader takes a piece of at most 2 GiB (an int32 block size); datasets adds the piece's last line.
_JSON_PIECE_MAX = 1 << 30


def _json_chunksize(name: str) -> int:
    """The json reader's chunksize: the data file's size in bytes, decompressed, so that it is read in one piece; a
    file over _JSON_PIECE_MAX in pieces of that size.

    datasets reads JSON lines in 10 MB pieces and takes the column types from the first piece: the values of a later
    piece are cast to them (a number 5 to '5', a list of content parts to its JSON text; under datasets 5, every
    string of a column with such a value becomes its JSON text, quotes included), and a column that is null all
    through the first piece, or a message key that first appears later (tool_calls), stops the load. Read in one
    piece, the types come from every row, and a row of another type is refused with its row number."""
    if not name.lower().endswith(_COMPRESSIONS):
        return min(max(os.path.getsize(name), 1), _JSON_PIECE_MAX)
    return min(max(_decompressed_size(name), 1), _JSON_PIECE_MAX)


def _decompressed_size(name: str) -> int:
    """A compressed file's size decompressed, up to just past _JSON_PIECE_MAX: the chunksize keys datasets' cache
    entry, so it is needed before the cache can be read. Finding it decompresses up to 1 GiB (4 s of gzip on 2
    cores), which every rank did on every run for every file, so a folder of a thousand .jsonl.zst shards took an
    hour before the first step, cache hit or not: it is remembered."""
    def count() -> str:
        with fsspec.open(name, "rb", compression="infer") as f:
            size = 0
            while size <= _JSON_PIECE_MAX and (block := f.read(1 << 24)):  # no need to read further than the cap
                size += len(block)
        return str(size)

    return int(_remembered(name, "decompressed_size", count))


def _remembered(name: str, fact: str, find: Callable[[], str]) -> str:
    """`find()`, a fact about the data file `name` that takes reading the whole file, found once and kept in the
    datasets cache per file: its path, size and modification time, as datasets keys its own conversion of it."""
    stat = os.stat(name)
    key = hashlib.sha256(f"{os.path.abspath(name)}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    memo = os.path.join(datasets.config.HF_DATASETS_CACHE, "fsdp_recipes_file_facts", fact, key)
    with contextlib.suppress(OSError):
        with open(memo) as f:
            return f.read()
    value = find()
    with contextlib.suppress(OSError):  # a cache that cannot be written: found again next time
        os.makedirs(os.path.dirname(memo), exist_ok=True)
        with open(f"{memo}.{os.getpid()}.tmp", "w") as f:  # renamed whole: the ranks of a node write it at once
            f.write(value)
        os.replace(f"{memo}.{os.getpid()}.tmp", memo)
    return value


def _csv_as_text(name: str) -> dict:
    """load_dataset options that read every cell as text: pandas would read '007' as the number 7, and 'None' or
    'NA' as missing. The columns are named by pandas itself ('Unnamed: 0' for an index column, 'x.1' for a second
    'x'), as the rows are then read."""
    def fields_match() -> str:
        _check_csv_fields(name)  # raises for a row of another width, which is then not remembered
        return "every row has the header's fields"

    # The check reads the whole file in Python (6 s a GB), on every rank of every run: once per file instead.
    _remembered(name, "csv_fields_match", fields_match)
    header = pandas.read_csv(name, nrows=0).columns
    return {"features": datasets.Features({column: datasets.Value("string") for column in header}), "na_filter": False}


def _csv_rows(name: str) -> Iterator[tuple[int, list[str]]]:
    """(the line where it starts, its cells) for each row of a CSV file, the header first. Blank lines are skipped,
    as pandas skips them."""
    csv.field_size_limit(2**31 - 1)  # the csv module's default, 131,072 characters a cell, is no limit of pandas'
    with _open_text(name) as f:
        rows, first_line = csv.reader(f), 1
        for row in rows:
            if any(cell.strip() for cell in row) or len(row) > 1:
                yield first_line, row
            first_line = rows.line_num + 1  # the next row's first line: a quoted cell may span several


def _check_csv_fields(name: str) -> None:
    """A ConfigError for the first row whose fields are more or fewer than the header's. pandas takes a first row
    with one field more for an index column, and shifts every column of every row by one, without a word."""
    rows = _csv_rows(name)
    _, header = next(rows, (1, None))
    for line, row in rows:
        if len(row) != len(header):
            raise ConfigError(f"cannot parse {name}, line {line}: {len(row)} fields, the header has {len(header)} "
                              f"(quote a cell that holds a comma: \"a, b\")")


def _load_saved_folder(name: str, split: str, instruction: datasets.ReadInstruction) -> datasets.Dataset:
    """A `save_to_disk` folder: a Dataset (its one split, 'train'), or the splits wanted of a DatasetDict, each
    read alone so that another split cannot break the load."""
    dict_file = os.path.join(name, "dataset_dict.json")
    if not os.path.isfile(dict_file):
        return _take_split(name, split, instruction, {"train": lambda: _load_from_disk(name)},
                           "a folder saved from a single Dataset holds one split")
    with open(dict_file) as f:
        splits = json.load(f)["splits"]
    loaders = {splitname: functools.partial(_load_from_disk, os.path.join(name, splitname)) for splitname in splits}
    return _take_split(name, split, instruction, loaders)


def _load_files_folder(name: str, split: str, instruction: datasets.ReadInstruction) -> datasets.Dataset:
    """A folder of data files, in splits by datasets' own file naming (train*, test*, validation*, ...: every file is
    train where none is so named), each file read as a single file is (_load_file: CSV cells as text, a bad file
    named with its line), all of them: load_dataset would read only the most common file type, leaving the others
    out without a word."""
    loaders = {splitname: functools.partial(_load_files, name, files)
               for splitname, files in _folder_files(name).items()}
    return _take_split(name, split, instruction, loaders)


def _folder_files(name: str) -> dict[str, list[str]]:
    """The files of each split of a folder of data files, in the order they are read."""
    return _without_empty_parts(_split_files(name))


def _without_empty_parts(files: dict[str, list[str]]) -> dict[str, list[str]]:
    # Sharded exports (Spark's) write empty part files; a split of empty files alone holds no examples.
    return {splitname: [file for file in split_files if not _is_empty(file)] or list(split_files[:1])
            for splitname, split_files in files.items()}


def _split_files(name: str) -> dict[str, list[str]]:
    """The data files of each split of a folder. Files that are no data by datasets' rules are left out, as
    load_dataset leaves them: a dataset card, hidden files (.gitattributes), and files of no data type (a LICENSE,
    a NOTICE); a file of a data type this project does not read (notes.txt) is an error."""
    try:
        found = DataFilesDict.from_patterns(get_data_patterns(name), base_path=name)
    except EmptyDatasetError:
        found = {}
    files = {str(splitname): [file for file in split_files if _is_data(file)]
             for splitname, split_files in found.items()}
    files = {splitname: split_files for splitname, split_files in files.items() if split_files}
    if not files:
        raise ConfigError(f"{name} holds no data files (json, jsonl, csv or parquet)")
    for file in (file for split_files in files.values() for file in split_files):
        if _file_type(file) not in _FILE_BUILDERS:  # not left out: it may be data
            raise ConfigError(f"{file}: unsupported file type in the data folder {name}, whose every file is read; "
                              f"use one of {', '.join(_FILE_BUILDERS)} (or one of them compressed: "
                              f"{', '.join(_COMPRESSIONS)}), or move it out of the folder")
    # datasets' naming reads only the files of named splits: beside train.jsonl, a more.jsonl would be left out.
    # Only data files: a LICENSE beside train.jsonl and test.jsonl (a clone of a Hub data set's repository) is none.
    left_out = [file for file in _not_in_splits(name, files) if _file_type(file) in _FILE_BUILDERS]
    if left_out:
        more = f" (and {len(left_out) - 1} more file{'s' if len(left_out) > 2 else ''})" if len(left_out) > 1 else ""
        raise ConfigError(f"{left_out[0]}{more}: in none of the splits {list(files)} of the data folder "
                          f"{name}, whose every file is read; datasets names a file's split by a folder name "
                          f"(train/, test/, validation/, ...), else by its file name (train*, test*, ...), and where "
                          f"none is named every file is train: rename it or move it into its split's folder, or move "
                          f"it out of the folder")
    return files


def _is_data(path: str) -> bool:
    """Whether load_dataset would take a folder's file for data: one of its suffixes is a data file type datasets
    reads (data.jsonl.gz, notes.txt, a.tsv), where a LICENSE, a NOTICE or a script has none."""
    return any(f".{suffix.lower()}" in _DATA_TYPES for suffix in os.path.basename(path).split(".")[1:])


def _not_in_splits(name: str, files: dict[str, list[str]]) -> list[str]:
    """The folder's files, as datasets' resolution lists them (no card, no hidden file), that no split holds."""
    in_splits = {file for split_files in files.values() for file in split_files}
    return [file for file in DataFilesDict.from_patterns({"train": ["**"]}, base_path=name)["train"]
            if file not in in_splits]


def folder_summary(name: str, split: str, eval_split: Optional[str]) -> Optional[str]:
    """For a folder of data files, the files of each split and the files left out, relative to the folder: what the
    run reads, for its log ('train: a.jsonl, b.jsonl; left out: LICENSE'). A split neither `split` nor `eval_split`
    reads is marked so: a folder's validation split is not evaluated on unless eval_split names it. None for
    anything else."""
    if not _is_files_folder(name):
        return None
    files = _split_files(name)
    read = {part.splitname for spec in filter(None, (split, eval_split))
            for part in _parse_split(name, spec).to_absolute(dict.fromkeys(files, 0))}

    def not_read(splitname: str) -> str:
        if splitname in read:
            return ""
        return " (not read)" if eval_split else f" (not read: eval_split {splitname} evaluates on it)"

    summary = "; ".join(f"{splitname}: {_file_names(name, split_files)}{not_read(splitname)}"
                        for splitname, split_files in _without_empty_parts(files).items())
    left_out = _not_in_splits(name, files)
    return summary + (f"; left out: {_file_names(name, left_out)}" if left_out else "")


def _file_names(folder: str, paths: list[str]) -> str:
    """The files' paths in the folder, the first 3 and the last of a longer list (a thousand shards)."""
    names = [os.path.relpath(path, folder) for path in paths]
    return ", ".join(names) if len(names) <= 5 else f"{len(names)} files: {', '.join(names[:3])}, ..., {names[-1]}"


def _load_files(folder: str, files: list[str]) -> datasets.Dataset:
    """The files of one split of a data folder, one after the other. Files with other columns are an error
    (concatenate_datasets would fill each one's missing columns with None), and so are columns whose types cannot
    be joined."""
    parts = _same_widths([_load_file(file) for file in files])
    advice = "give every file the same columns, or put the files in folders of their own and list those in dataset_name"
    for file, part in zip(files[1:], parts[1:]):
        if sorted(part.column_names) != sorted(parts[0].column_names):
            raise ConfigError(f"the files of {folder} differ in their columns: {files[0]} has {parts[0].column_names}, "
                              f"{file} has {part.column_names}: {advice}")
    try:
        return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    except ValueError as error:  # datasets names the features it cannot align, not the files that hold them
        differ = _type_conflict(files, parts)
        if "Json(" in differ:  # datasets 5 reads a column whose values have several types (5 among strings) as Json
            advice = ("the rows of one file hold values of several types in that column (read alone, as dataset_name, "
                      "the file's rows of another type are named): give them one type")
        raise ConfigError(f"the files of {folder} have columns of other types: {differ or error}: {advice}") from None


def _same_widths(parts: list[datasets.Dataset]) -> list[datasets.Dataset]:
    """Where the files' types differ, each file with Arrow's large strings and lists (pandas 3 and Polars write Parquet
    with them) cast to the plain ones that JSON and CSV files are read as: the same values, which
    concatenate_datasets would not join. Files of one type stay as they are, without a copy into the cache."""
    if all(part.features == parts[0].features for part in parts[1:]):
        return parts
    narrowed = [datasets.Features({column: _narrow(feature) for column, feature in part.features.items()})
                for part in parts]
    return [part if features == part.features else part.cast(features) for part, features in zip(parts, narrowed)]


def _narrow(feature):
    if isinstance(feature, dict):
        return {key: _narrow(value) for key, value in feature.items()}
    if isinstance(feature, datasets.LargeList):
        return datasets.List(_narrow(feature.feature))
    if isinstance(feature, datasets.List):
        return datasets.List(_narrow(feature.feature), length=feature.length)
    if isinstance(feature, datasets.Value) and feature.dtype in ("large_string", "large_binary"):
        return datasets.Value(feature.dtype.removeprefix("large_"))
    return feature


def _type_conflict(files: list[str], parts: list[datasets.Dataset]) -> str:
    """The columns of the first file that cannot join the files before it, each with the earlier file whose type it
    conflicts with. Joined one by one: concatenate_datasets aligns a column null in one file with its type in
    another, so the conflict may be with any earlier file, not the first."""
    joined = parts[0]
    for k, (file, part) in enumerate(zip(files[1:], parts[1:]), 1):
        try:
            joined = datasets.concatenate_datasets([joined, part])
        except ValueError:
            return "; ".join(f"'{column}' is {joined.features[column]} in {_holder(column, joined, files[:k], parts)}, "
                             f"{part.features[column]} in {file}"
                             for column in part.column_names if part.features[column] != joined.features[column])
    return ""


def _holder(column: str, joined: datasets.Dataset, files: list[str], parts: list[datasets.Dataset]) -> str:
    """The first of `files` whose `column` has the type it has in `joined`, the files joined."""
    return next((file for file, part in zip(files, parts) if part.features[column] == joined.features[column]),
                f"the files before it ({', '.join(files)})")


def _load_from_disk(path: str) -> datasets.Dataset:
    """A Dataset's `save_to_disk` folder, read into the datasets cache as its own arrow files. `load_from_disk` would
    map the folder in place, and then every map and filter writes its cache files into the user's folder (and fails
    on a read-only one)."""
    with open(os.path.join(path, "state.json")) as f:
        files = [cache_path(os.path.join(path, entry["filename"])) for entry in json.load(f)["_data_files"]]
    try:
        return _load_local("arrow", files)
    except datasets.exceptions.DatasetGenerationError as error:
        if isinstance(error.__cause__, datasets.arrow_writer.SchemaInferenceError):  # files without a row
            raise ConfigError(f"{path} holds no examples") from None
        raise


def parse_column_mapping(mapping: Optional[str]) -> dict[str, str]:
    """'question=prompt,answer=completion' -> {'question': 'prompt', 'answer': 'completion'}."""
    if not mapping:
        return {}
    pairs = [item.split("=") for item in mapping.split(",")]
    if any(len(pair) != 2 or not all(p.strip() for p in pair) for pair in pairs):
        raise ConfigError(f"dataset_column_mapping must look like 'question=prompt,answer=completion', got '{mapping}'")
    renames: dict[str, str] = {}
    for source, target in ((source.strip(), target.strip()) for source, target in pairs):
        if source in renames:  # a dict would keep the last one without a word
            raise ConfigError(f"dataset_column_mapping renames '{source}' twice, to '{renames[source]}' and "
                              f"'{target}': map it once")
        renames[source] = target
    return renames


def parse_weights(weights: str) -> list[float]:
    """'1,0.5' -> [1.0, 0.5]; each weight a positive number."""
    try:
        values = [float(w) for w in weights.split(",")]
    except ValueError:
        values = []
    if not values or not all(0 < w < math.inf for w in values):
        raise ConfigError(f"dataset_weights must be positive numbers separated by commas, such as '1,0.5', "
                          f"got '{weights}'")
    return values


def rename_columns(dataset: datasets.Dataset, mapping: dict[str, str]) -> datasets.Dataset:
    present = {source: target for source, target in mapping.items() if source in dataset.column_names}
    return dataset.rename_columns(present) if present else dataset


def per_source(value: Optional[str], names: list[str], key: str) -> list[Optional[str]]:
    """A key's value for each data set of dataset_name: one value for all, or one per data set, comma-separated
    (an empty one is none: `,main` gives the second data set's config only)."""
    values = [v.strip() or None for v in value.split(",")] if value else [None]
    if len(values) == 1:
        return values * len(names)
    if len(values) != len(names):
        raise ConfigError(f"{key} has {len(values)} comma-separated values for {len(names)} data sets in dataset_name: "
                          f"give one for all of them, or one per data set")
    return values


def check_held_out(name: str, config_name: Optional[str], split: str, eval_split: str) -> None:
    """Refuse an eval_split that selects rows dataset_split trains on ('train[90%:]' beside the default 'train'):
    its loss would be reported as held-out."""
    names = lambda spec: {part.split("[")[0].strip() for part in spec.split("+")}
    advice = ("give disjoint slices (dataset_split 'train[:90%]' with eval_split 'train[90%:]'), or hold out a "
              "random share with eval_fraction")
    if "all" in names(split) | names(eval_split):  # datasets' name for every split of the data set
        raise ConfigError(f"{name}: eval_split '{eval_split}' and dataset_split '{split}' share rows ('all' is every "
                          f"split), which the evaluation would report as held out: {advice}")
    if not names(split) & names(eval_split):
        return
    lengths = {s: len(load_split(name, config_name, s)) for s in names(split) | names(eval_split)}  # cached reads

    def spans(spec) -> list[tuple[str, int, int]]:
        """The rows `spec` selects, as disjoint (split, start, end) spans: a row selected twice counts once."""
        merged = []
        for r in sorted(_parse_split(name, spec).to_absolute(lengths), key=lambda r: (r.splitname, r.from_)):
            if merged and merged[-1][0] == r.splitname and r.from_ <= merged[-1][2]:
                merged[-1] = (r.splitname, merged[-1][1], max(merged[-1][2], r.to))
            else:
                merged.append((r.splitname, r.from_, r.to))
        return merged

    overlap = sum(max(0, min(a_end, b_end) - max(a_start, b_start))
                  for a_split, a_start, a_end in spans(split) for b_split, b_start, b_end in spans(eval_split)
                  if a_split == b_split)
    if overlap:
        rows = f"{overlap} row{'s' if overlap != 1 else ''}"
        raise ConfigError(f"{name}: eval_split '{eval_split}' and dataset_split '{split}' share {rows}, which the "
                          f"evaluation would report as held out: {advice}")


def load_sources(names: list[str], config_names: list[Optional[str]], splits: list[str],
                 eval_splits: list[Optional[str]],
                 column_mapping: dict[str, str]) -> list[tuple[datasets.Dataset, Optional[datasets.Dataset]]]:
    """(train, given eval split or None) per source, with columns renamed; config and splits given per source."""
    sources = []
    for name, config_name, split, eval_split in zip(names, config_names, splits, eval_splits, strict=True):
        if split is None:
            raise ConfigError(f"dataset_split gives no split for {name}: name one for each data set")
        train = load_split(name, config_name, split)
        held_out = None
        if eval_split:
            check_held_out(name, config_name, split, eval_split)
            held_out = load_split(name, config_name, eval_split)
        sources.append((train, held_out))
    # The held-out split too: its files may have columns that the training split's have not.
    parts = [(name, train) for name, (train, _) in zip(names, sources)] + [
        (f"{name} [{eval_split}]", held_out) for name, eval_split, (_, held_out) in zip(names, eval_splits, sources)
        if held_out is not None]
    for name, part in parts:
        present = {source: target for source, target in column_mapping.items() if source in part.column_names}
        for source, target in present.items():
            if target in part.column_names and target not in column_mapping:
                raise ConfigError(f"dataset_column_mapping renames '{source}' to '{target}', but {name} already has "
                                  f"a column '{target}': rename that one too (e.g. {target}=old_{target})")
            others = [other for other, other_target in present.items() if other_target == target and other != source]
            if others:
                raise ConfigError(f"dataset_column_mapping renames both '{source}' and '{others[0]}' of {name} to "
                                  f"'{target}': map only one of them")
    found = sorted({c for train, _ in sources for c in train.column_names})
    for source in column_mapping:
        if source not in found:
            raise ConfigError(f"dataset_column_mapping renames '{source}', which no data set has; "
                              f"columns found: {found}")
    rename = lambda dataset: None if dataset is None else rename_columns(dataset, column_mapping)
    return [(rename(train), rename(held_out)) for train, held_out in sources]


def carve_eval(dataset: datasets.Dataset, fraction: float, seed: int, name: str):
    """(train, eval): a seeded random `fraction` of the examples held out for evaluation, rounded down."""
    # The decimal as written: in floats 100 x 0.29 is 28.999999999999996, which int() makes 28.
    n_eval = int(fractions.Fraction(str(fraction)) * len(dataset))
    if n_eval == 0 or n_eval == len(dataset):
        raise ConfigError(f"eval_fraction={fraction} of the {len(dataset)} examples of {name} leaves an empty train "
                          "or eval split")
    parts = dataset.train_test_split(test_size=n_eval, seed=seed)
    return parts["train"], parts["test"]


def weighted_sample(dataset: datasets.Dataset, weight: float, seed: int) -> datasets.Dataset:
    """round(weight x len) examples: whole copies for the integer part, a seeded random subset for the rest."""
    n = round(weight * len(dataset))
    if n == 0:
        # round(0.5) is 0: a weight must give more than half an example.
        raise ConfigError(f"dataset weight {weight:g} of a data set of {len(dataset)} examples keeps none of them: "
                          f"raise it above {0.5 / len(dataset):g}, or leave the data set out")
    copies, rest = divmod(n, len(dataset))
    parts = [dataset] * copies
    if rest:
        parts.append(dataset.shuffle(seed=seed).select(range(rest)))
    return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
