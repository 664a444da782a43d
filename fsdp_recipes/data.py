"""Data: load the sources, tokenize each example with its loss mask, pack, and batch it per rank.

Sources and splits live in `data_sources`, formats and loss masks in `data_formats`; this module puts them together.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.metadata
import os
import signal
from pathlib import Path
from typing import Callable, Iterator, Optional, TypeVar

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from .config import ConfigError, TrainConfig
from .data_formats import (DEFAULT_CHAT_TEMPLATE, FORMATS, IGNORE_INDEX, OPTIONAL_COLUMNS, detect_format,
                           tokenize_example)
from .data_sources import (cache_path, carve_eval, folder_summary, load_sources, parse_column_mapping, parse_weights,
                           per_source, row_origin, weighted_sample)
from .distributed import long_wait_group, print_rank0, run_on_rank0
from .export import DISK_FULL, space_left
from .sharding import reshard


# datasets keys a map's cache by its function's name and arguments, not by the code the function runs: the hash of
# the data code goes into the arguments, so that changed code (a new version, an edited copy) tokenizes again
# instead of reading what the old code wrote; so do the versions of the libraries that turn text into tokens
# (a tokenizer's pickle, which datasets hashes too, can stay the same when their output does not).
TOKENIZING_LIBRARIES = ("transformers", "tokenizers", "jinja2")  # jinja2 renders chat templates


def data_code_hash(code: bytes, versions: dict[str, str]) -> str:
    return hashlib.sha256(code + repr(sorted(versions.items())).encode()).hexdigest()


DATA_CODE_HASH = data_code_hash(
    b"".join((Path(__file__).parent / name).read_bytes() for name in ("data.py", "data_formats.py", "data_sources.py")),
    {name: importlib.metadata.version(name) for name in TOKENIZING_LIBRARIES})

# int32 token ids, labels and positions: half the cache of the int64 that Arrow infers from Python ints.
TOKEN_LIST = datasets.List(datasets.Value("int32"))
TOKENIZED_FEATURES = datasets.Features({
    "input_ids": TOKEN_LIST, "labels": TOKEN_LIST, "has_labels": datasets.Value("bool"),
    "overlong": datasets.Value("bool"), "reasoning_left_out": datasets.Value("int32")})
PACKED_FEATURES = datasets.Features({"input_ids": TOKEN_LIST, "labels": TOKEN_LIST, "position_ids": TOKEN_LIST})


def _tokenize_row(example: dict, index: int, data_code: str, source: tuple[str, str], **kwargs) -> dict:
    # map(with_indices=True) passes the row's index as the second positional argument; data_code only keys the cache.
    try:
        return _tokenize_text_row(example, index, **kwargs)
    except ConfigError as error:  # a bad row of a file also names the file and its line (of a folder's files too)
        origin = row_origin(*source, index)
        if origin is None:
            raise
        row = f"row {index + 1}"
        raise ConfigError(str(error).replace(f"{row}:", f"{row} ({origin}):", 1)) from None


def _tokenize_text_row(example: dict, index: int, **kwargs) -> dict:
    try:
        return tokenize_example(example, row=index + 1, **kwargs)
    except UnicodeDecodeError:  # pyarrow's JSON reader keeps bytes that are not UTF-8: read, the row fails
        raise ConfigError(f"row {index + 1}: not UTF-8 text: save the file as UTF-8") from None


def _without_its_path(tokenizer):
    """The tokenizer without the path it was loaded from (name_or_path), which datasets would hash into the
    tokenization's cache key: the same tokenizer from ./model, from another directory or from a checkpoint's copy
    gives the same tokens, and would tokenize the data again. A shallow copy: the tokenizer itself is unchanged."""
    keyed = copy.copy(tokenizer)
    keyed.name_or_path = ""
    keyed.init_kwargs = {key: value for key, value in tokenizer.init_kwargs.items() if key != "name_or_path"}
    return keyed


def _tokenize(raw: datasets.Dataset, tokenizer, cfg: TrainConfig, name: str, split: str, held_out: bool = False
              ) -> tuple[datasets.Dataset, str]:
    """Tokenize the rows of `split` of the data set `name` (`held_out`: its eval split), then drop or truncate
    overlong examples and drop those left without label tokens; log the counts. Returns the examples kept and the
    format they were read as."""
    what = f"{name} [{split}]"
    try:
        fmt = detect_format(raw.column_names, cfg.dataset_format)
        if tokenizer.eos_token is None and (fmt in ("prompt_completion", "text") or tokenizer.chat_template is None):
            raise ConfigError(f"the tokenizer has no eos token, which ends every example of {fmt} data (and every turn "
                              f"of the default chat template, for a tokenizer without one) so that the model learns "
                              f"to stop: use a tokenizer_name_or_path that has one, or save the tokenizer with its "
                              f"eos_token set")
        if fmt in ("chat", "instruction") and tokenizer.chat_template is None:
            # Only for data that goes through a chat template: a front end would send chats to a model saved with
            # one, in a layout that prompt/completion or text training never taught it.
            print_rank0("data: the tokenizer has no chat template; using the default (the tokenizer's BOS, then "
                        "ChatML layout with its EOS), saved with the model")
            tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
        tokenized = raw.map(
            _tokenize_row, with_indices=True, remove_columns=raw.column_names, desc=f"Tokenizing {what}",
            num_proc=cfg.dataset_num_proc, features=TOKENIZED_FEATURES,
            fn_kwargs={"fmt": fmt, "tokenizer": _without_its_path(tokenizer), "max_seq_length": cfg.max_seq_length,
                       "completion_only_loss": cfg.completion_only_loss, "data_code": DATA_CODE_HASH,
                       "source": (cache_path(name), split)},  # any spelling of a path: one cache entry
        )
    except ConfigError as error:
        raise ConfigError(f"{what}: {error}") from None
    # Summed and filtered by Arrow: a column read through datasets decodes every row into Python (seconds per 100k
    # rows, on each rank, cache hit or not).
    columns = tokenized.with_format("arrow")
    overlong = pc.sum(columns["overlong"]).as_py()
    reasoning_left_out = pc.sum(columns["reasoning_left_out"]).as_py()
    drop_overlong = cfg.overlong_examples == "drop"
    kept = columns.filter(
        lambda has_labels, long: pc.and_(has_labels, pc.invert(long)) if drop_overlong else has_labels,
        input_columns=["has_labels", "overlong"], batched=True, batch_size=100_000, desc=f"Filtering {what}",
    ).remove_columns(["has_labels", "overlong", "reasoning_left_out"]).with_format(None)
    no_labels = len(tokenized) - len(kept) - (overlong if drop_overlong else 0)
    # Named, so that a column meant to be trained on (Dolly's context, without context=input) is not left out unseen.
    not_read = [c for c in raw.column_names if c not in FORMATS[fmt] + OPTIONAL_COLUMNS.get(fmt, [])]
    read_as = f"{fmt}; columns not read: {', '.join(not_read)}" if not_read else fmt
    print_rank0(f"data: {what}: {len(raw)} examples ({read_as}), {overlong} longer than max_seq_length="
                f"{cfg.max_seq_length} ({'dropped' if drop_overlong else 'truncated'}), {no_labels} dropped for "
                f"having no label tokens, {len(kept)} kept")
    if reasoning_left_out:
        print_rank0(f"warning: {what}: the chat template leaves out the reasoning (reasoning_content, or a <think> "
                    f"block in the content) of {reasoning_left_out} assistant messages, which are trained without it; "
                    f"to train on reasoning, use a "
                    f"tokenizer_name_or_path whose chat template writes it (Qwen3's, into the last turn)")
    if len(kept) == 0:
        roles = sorted({m.get("role") for messages in raw["messages"] for m in messages}) if fmt == "chat" else []
        if cfg.completion_only_loss and roles and "assistant" not in roles:  # ShareGPT's human and gpt, say
            raise ConfigError(f"{what}: no message has the role assistant (the roles are {', '.join(roles)}), and "
                              f"the loss is on assistant turns: name the model's turns assistant (and the user's "
                              f"user), or set completion_only_loss false")
        raise ConfigError(f"{what}: no example is left to {'evaluate' if held_out else 'train'} on (see the counts "
                          f"above)")
    return kept, fmt


def pack_examples(batch: pa.Table, max_seq_length: int) -> pa.Table:
    """Greedy packing in the given order: append examples to a sequence while they fit in max_seq_length.

    position_ids restart at 0 for each example, which is how transformers tells the examples apart (block-diagonal
    attention for sdpa/eager, varlen for flash attention). The first label of each example is masked: it would be
    predicted from the previous example's last token.

    Arrow columns in and out: turning a batch into Python lists and back took most of the time (37 s against 5 s
    for 100k chat examples on 2 cores); only the examples' lengths are read in Python.
    """
    lengths = pc.list_value_length(batch["input_ids"]).to_numpy(zero_copy_only=False)
    first_of_sequence, used = [], max_seq_length
    for i, length in enumerate(lengths.tolist()):
        if used + length > max_seq_length:
            first_of_sequence.append(i)
            used = 0
        used += length
    example_starts = np.concatenate(([0], np.cumsum(lengths)))
    labels = pc.list_flatten(batch["labels"]).to_numpy().copy()
    labels[example_starts[:-1]] = IGNORE_INDEX
    position_ids = np.arange(example_starts[-1]) - np.repeat(example_starts[:-1], lengths)
    offsets = pa.array(example_starts[first_of_sequence + [len(lengths)]], pa.int32())
    columns = {"input_ids": pc.list_flatten(batch["input_ids"]).combine_chunks(), "labels": labels,
               "position_ids": position_ids}
    return pa.table({key: pa.ListArray.from_arrays(offsets, values) for key, values in columns.items()})


T = TypeVar("T")


def on_rank0_first(build: Callable[[], T]) -> T:
    """Rank 0 runs `build` (filling the datasets cache) while the others wait; then the first process of each other
    node (LOCAL_RANK 0), which reads rank 0's cache where the nodes share it and fills its node's own where each node
    has its own disk; then the other processes, from the cache. One tokenization per node, not per process, whatever
    the cache's place.

    They wait on a gloo group of their own with a one-day timeout: tokenizing a large data set can take longer than
    the default group's timeout, which is meant for training collectives. If rank 0 fails, every rank stops with its
    error instead of waiting or crashing in a collective; a process that fails later ends its launcher's run.
    """
    if dist.get_world_size() == 1:
        return build()
    result = run_on_rank0(build, "to build the data")
    first_of_its_node = int(os.environ.get("LOCAL_RANK", 0)) == 0
    for nodes_first_turn in (True, False):
        if dist.get_rank() != 0 and first_of_its_node == nodes_first_turn:
            result = build()
        dist.barrier(group=long_wait_group())
    return result


def naming_a_full_cache(build: Callable[[], T]) -> T:
    """`build()`; a full disk while it writes the tokenized data into the datasets cache is an error that names the
    cache and what to do, not OSError alone (No space left on device, naming no file). datasets removes its
    unfinished files itself."""
    try:
        return build()
    except Exception as error:
        # datasets' clean-up after the failed write can fail in turn (ValueError: I/O operation on closed file).
        cause = error
        while cause is not None and not (isinstance(cause, OSError) and cause.errno in DISK_FULL):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        cache = str(datasets.config.HF_DATASETS_CACHE)
        raise ConfigError(f"writing the tokenized data into the datasets cache failed ({type(cause).__name__}: "
                          f"{cause}), with {space_left(cache)}: make room there, or set HF_DATASETS_CACHE (or "
                          f"HF_HOME) to a folder on a file system with room") from error


def build_datasets(cfg: TrainConfig, tokenizer) -> tuple[datasets.Dataset, Optional[datasets.Dataset]]:
    """Tokenized (and, with `packing`, packed) training set, and the tokenized eval set or None.

    Rank 0 builds first and fills the datasets cache; the other ranks then read it (see on_rank0_first).
    """
    names = [os.path.expanduser(n.strip()) for n in cfg.dataset_name.split(",")]
    if not all(names):
        raise ConfigError(f"dataset_name {cfg.dataset_name!r} has an empty entry: name the data sets separated by "
                          f"single commas")
    weights = parse_weights(cfg.dataset_weights) if cfg.dataset_weights else [1.0] * len(names)
    if len(weights) != len(names):
        raise ConfigError(f"dataset_weights has {len(weights)} values for {len(names)} data sets in dataset_name: give "
                          f"one weight per data set, in dataset_name's order")
    if not tokenizer.is_fast:  # loss masks map characters to tokens through the fast tokenizers' offsets
        raise ConfigError(f"{type(tokenizer).__name__} is a Python tokenizer, without the character offsets of a fast "
                          f"one (tokenizer.json, from the tokenizers library) that the loss masks are built from: set "
                          f"tokenizer_name_or_path to a folder that holds a tokenizer.json of the same vocabulary")

    config_names = per_source(cfg.dataset_config_name, names, "dataset_config_name")
    splits = per_source(cfg.dataset_split, names, "dataset_split")
    eval_splits = per_source(cfg.eval_split, names, "eval_split")

    formats = set()

    def build():
        sources = load_sources(names, config_names, splits, eval_splits,
                               parse_column_mapping(cfg.dataset_column_mapping))
        for name, split, eval_split in zip(names, splits, eval_splits):
            summary = folder_summary(name, split, eval_split)
            if summary:  # which files of a folder were read, and which were taken for no data
                print_rank0(f"data: {name}: {summary}")
        train_parts, eval_parts = [], []
        for index, (name, weight, split, eval_split, (raw_train, raw_eval)) in enumerate(
                zip(names, weights, splits, eval_splits, sources)):
            # A seed per data set: two of one size would otherwise hold out and keep the rows at the same positions.
            seed = cfg.seed + index
            # Tokenized before the eval carve so that an error names the row of the split.
            train, fmt = _tokenize(raw_train, tokenizer, cfg, name, split)
            formats.add(fmt)
            if raw_eval is not None:
                eval_parts.append(_tokenize(raw_eval, tokenizer, cfg, name, eval_split, held_out=True)[0])
            elif cfg.eval_fraction > 0:
                train, held_out = carve_eval(train, cfg.eval_fraction, seed, name)
                eval_parts.append(held_out)
            train_parts.append(weighted_sample(train, weight, seed))
        if len(train_parts) > 1:  # what each data set of the mixture gives, after its weight
            total = sum(map(len, train_parts))
            print_rank0("data: mixture of " + ", ".join(f"{name} x {weight:g}: {len(part)} ({len(part) / total:.1%})"
                                                        for name, weight, part in zip(names, weights, train_parts))
                        + " training examples")
        train = datasets.concatenate_datasets(train_parts) if len(train_parts) > 1 else train_parts[0]
        eval_set = datasets.concatenate_datasets(eval_parts) if len(eval_parts) > 1 else (eval_parts or [None])[0]
        if cfg.packing:
            # Shuffled first so that a pack mixes the data sets of a mixture instead of following file order. Packed
            # through the shuffle's indices: flatten_indices would write a whole copy of the examples into the cache
            # first, read in the same batches.
            n_examples = len(train)
            train = train.shuffle(seed=cfg.seed).with_format("arrow").map(
                pack_examples, batched=True, batch_size=1000, fn_kwargs={"max_seq_length": cfg.max_seq_length},
                remove_columns=train.column_names, desc="Packing", features=PACKED_FEATURES,
            ).with_format(None)
            print_rank0(f"data: packed {n_examples} examples into {len(train)} sequences of at most "
                        f"{cfg.max_seq_length} tokens")
        return train, eval_set

    train, eval_set = on_rank0_first(functools.partial(naming_a_full_cache, build))
    if cfg.generation_prompts and cfg.generation_use_chat_template is None:
        # Prompted as the data were trained: a model trained on prompt/completion data never saw the template.
        templated = {fmt in ("chat", "instruction") for fmt in formats}
        if len(templated) > 1:
            raise ConfigError("generation_prompts: the data sets mix chat or instruction data (trained through the "
                              "chat template) with prompt/completion or text data (plain text): set "
                              "generation_use_chat_template true or false to say how the prompts are sent")
        cfg.generation_use_chat_template = templated.pop()
    if cfg.generation_prompts and cfg.generation_use_chat_template and tokenizer.chat_template is None:
        # Found now, not when the samples are generated after training.
        raise ConfigError("generation_prompts go through the tokenizer's chat template (generation_use_chat_template "
                          "true), and it has none: the data have no chat or instruction set to give it the default "
                          "one; set generation_use_chat_template false to send the prompts as plain text")
    print_rank0(f"data: train {len(train)} {'sequences' if cfg.packing else 'examples'}"
                + (f", eval {len(eval_set)} examples" if eval_set is not None else ", no eval split"))
    return train, eval_set


def check_model_reads_data(model: nn.Module, tokenizer, max_seq_length: int,
                           *splits: Optional[datasets.Dataset]) -> None:
    """Refuse, before the first step, what would index past one of the model's tables: on a GPU that stops the run
    with a device-side assert on whichever rank draws such a batch, far from the cause. Token ids beyond the
    embedding table (a tokenizer with tokens the model lacks), in the data or as the padding; a max_seq_length
    beyond a position table (GPT-2's, OPT's, BioGPT's learned one, CTRL's fixed sinusoids). Rotary positions from
    rope parameters have no table: beyond the context the model was trained for (with its rope scaling) is a warning."""
    num_embeddings = model.get_input_embeddings().num_embeddings
    resize = "or save the model with its embeddings resized to the tokenizer first (resize_token_embeddings)"
    if tokenizer.pad_token_id is None:
        raise ConfigError("the tokenizer has no pad token, nor an eos token to pad with: save the tokenizer with a "
                          "pad token the model has")
    if tokenizer.pad_token_id >= num_embeddings:
        raise ConfigError(f"the tokenizer's pad token {tokenizer.pad_token!r} has id {tokenizer.pad_token_id}, and "
                          f"the model's embedding table has {num_embeddings} rows: save the tokenizer with a pad "
                          f"token the model has (e.g. its eos token), {resize}")
    for dataset in filter(None, splits):
        # Over the whole arrow table, rows held out by selections included: a few seconds for millions of rows.
        largest = pc.max(pc.list_flatten(dataset.data.column("input_ids"))).as_py()
        if largest >= num_embeddings:
            raise ConfigError(f"the data holds token id {largest}, and the model's embedding table has "
                              f"{num_embeddings} rows: use the model's own tokenizer (tokenizer_name_or_path), "
                              f"{resize}")
    check_sequence_length(model, max_seq_length, "max_seq_length")


def check_sequence_length(model: nn.Module, length: int, key: str) -> None:
    """Refuse a sequence `length` (the setting `key`: the run's max_seq_length, the memory estimate's --seq_len)
    beyond the model's position table, which has no row for the positions past it; warn beyond a rotary model's
    trained context, which a run may extend."""
    table = position_table(model)
    if table and length > table:
        raise ConfigError(f"{key} {length} is longer than the model's position table ({table} positions): set {key} "
                          f"{table} or less")
    context = rotary_context(model.config.get_text_config())
    if context and length > context:
        print_rank0(f"warning: {key} {length} is longer than the {context} positions the model was trained for "
                    f"(max_position_embeddings, with its rope scaling): it has never seen the positions beyond; to "
                    f"extend its context, add rope scaling (e.g. YaRN) to its config.json")


@torch.no_grad()
def check_packing_separates_examples(model: nn.Module, cfg: TrainConfig, device: torch.device) -> None:
    """With packing, refuse a model in which a packed example sees the examples before it in its row: not every
    model reads example boundaries from position_ids (OPT, BioGPT, Bloom and MPT build masks without them, gpt-oss
    masks without them, Mamba, convolution and linear-attention layers carry state across).

    Measured on this model, through the training forward (FSDP's: every rank takes part): two rows of one batch that
    pack the same second example after different first ones must give it the same logits. In one batch both rows
    run through the same kernels, a mixture of experts' tokens through the same per-expert batches, so a model that
    separates the examples computes them bit for bit alike (measured on the CPU: 0, dense or routed, fp32 or bf16).
    Beyond a thousandth of the difference without packing (attention crossing the boundary) is refused (Jamba's
    Mamba layers, beside its routed experts: 6e-3).
    """
    generator = torch.Generator().manual_seed(0)
    n = 8  # tokens per example
    firsts = [torch.randint(model.get_input_embeddings().num_embeddings, (n,), generator=generator).tolist()
              for _ in range(2)]
    second = torch.randint(model.get_input_embeddings().num_embeddings, (n,), generator=generator).tolist()
    flatten = "flash" in cfg.attn_implementation  # as build_dataloader batches packed rows

    def second_example_difference(packed: bool) -> torch.Tensor:
        rows = [{"input_ids": first + second, "labels": first + second, "position_ids": [*range(n), *range(n)]}
                for first in firsts]
        batch = collate(rows, pad_token_id=0, flatten=packed and flatten)
        inputs = model_inputs(batch) if packed else {"input_ids": batch["input_ids"]}
        logits = model(**{k: v.to(device) for k, v in inputs.items()}).logits.float()
        logits = logits.reshape(-1, 2 * n, logits.shape[-1])[:, n:]
        return (logits[0] - logits[1]).abs().max()

    training = model.training
    model.eval()  # no dropout
    try:
        # Eager, not through torch_compile's layers: these shapes and no_grad would only add compilations.
        with torch.compiler.set_stance("force_eager"):
            change = torch.stack([second_example_difference(packed) for packed in (True, False)])
    finally:
        model.train(training)
        reshard(model)  # before the optimizer collects the parameters
    dist.all_reduce(change, op=dist.ReduceOp.MAX)  # one decision on every rank
    packed_change, crossing_change = change.tolist()
    if packed_change > 1e-3 * crossing_change or (packed_change > 0 and crossing_change == 0):
        raise ConfigError(f"packing: in this {model.config.get_text_config().model_type} model a packed example sees "
                          f"the example before it in its sequence (changing that example changes its logits by up to "
                          f"{packed_change:.3g}; {crossing_change:.3g} with attention across the boundary): its "
                          f"attention does not separate examples by position_ids, or its layers carry state across "
                          f"them. Set packing false")


# Methods of modules that rebuild their buffer for a longer input: transformers' sinusoids (XGLM, M2M100, Musicgen)
# and the rotary cos/sin caches of remote code copied from transformers 4.3x's Llama (InternLM2's, DeepSeek-V2's).
_GROWN_TABLES = ("make_weights", "_set_cos_sin_cache")


def position_table(model: nn.Module) -> Optional[int]:
    """The positions of the model's position table, learned or fixed: an embedding beside the input embeddings
    with max_position_embeddings rows (GPT-2's; OPT's and BioGPT's hold 2 more, an offset), or a buffer of as many
    rows (CTRL's sinusoids, GPT-J's and CodeGen's rotary sines). None for positions that are computed (rotary,
    ALiBi), grown as needed (XGLM's sinusoids, remote code's rotary caches) or absent (RWKV, Mamba)."""
    positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if not positions:
        return None
    inputs = model.get_input_embeddings()
    for module in model.modules():
        tables = [module.num_embeddings] if isinstance(module, nn.Embedding) and module is not inputs else []
        if not any(hasattr(module, method) for method in _GROWN_TABLES):
            tables += [buffer.shape[0] for buffer in module.buffers(recurse=False) if buffer.dim() == 2]
        if any(positions <= rows <= positions + 2 for rows in tables):
            return positions
    return None


def rotary_context(config) -> Optional[int]:
    """The context of a rotary model, its rope scaling included (YaRN's or dynamic NTK's factor over the original
    context); None for a model without rotary positions."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        return None
    # Gemma 3 holds one set per attention type.
    context = config.max_position_embeddings
    for rope in [p for p in params.values() if isinstance(p, dict)] or [params]:
        # Llama 3's factor scales frequencies: max_position_embeddings is already its context (Llama 3.2: 131072).
        if rope.get("factor") and rope.get("rope_type") != "llama3":
            original = rope.get("original_max_position_embeddings") or config.max_position_embeddings
            context = max(context, int(original * rope["factor"]))
    return context


def collate(examples: list[dict], pad_token_id: int, flatten: bool = False) -> dict[str, torch.Tensor]:
    """Pad to the longest sequence of the batch, not to max_seq_length.

    `attention_mask` marks the real tokens. Packed rows also carry `position_ids`; padding then continues as one
    more short sequence of its own (positions 0, 1, ...), which carries no loss and which no real token sees.
    With `flatten`, packed rows are concatenated into a single row without padding instead.
    """
    if flatten:
        keys = ("input_ids", "labels", "position_ids")
        batch = {key: torch.tensor([[value for ex in examples for value in ex[key]]]) for key in keys}
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        return batch
    length = max(len(ex["input_ids"]) for ex in examples)
    input_ids = torch.full((len(examples), length), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    packed = "position_ids" in examples[0]
    if packed:
        position_ids = torch.arange(length).repeat(len(examples), 1)
    for i, ex in enumerate(examples):
        n = len(ex["input_ids"])
        input_ids[i, :n] = torch.tensor(ex["input_ids"])
        labels[i, :n] = torch.tensor(ex["labels"])
        attention_mask[i, :n] = 1
        if packed:
            position_ids[i, :n] = torch.tensor(ex["position_ids"])
            position_ids[i, n:] = torch.arange(length - n)
    batch = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
    if packed:
        batch["position_ids"] = position_ids
    return batch


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's keyword arguments for a batch. Packed batches pass position_ids and no attention_mask:
    transformers only derives the per-example (block-diagonal) mask from position_ids when attention_mask is None."""
    if "position_ids" in batch:
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def build_dataloader(dataset, cfg: TrainConfig, tokenizer, rank: int, world_size: int, pin_memory: bool) -> DataLoader:
    """Each rank reads a disjoint, equally long part of the data (drop_last), so no rank waits on another."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True)
    # Flash attention finds example boundaries in position_ids only in a batch of one row (transformers'
    # _is_packed_sequence), so there packed rows become one row; sdpa and eager handle any batch size.
    flatten = cfg.packing and "flash" in cfg.attn_implementation
    # Workers collate the next batches while the step computes; pinned batches let the copy to the GPU run
    # asynchronously (forward_backward's non_blocking copy). The sampler stays in this process, so set_epoch
    # reaches it even with persistent workers.
    return DataLoader(
        dataset.with_format(None),
        batch_size=cfg.per_device_train_batch_size,
        sampler=sampler,
        collate_fn=functools.partial(collate, pad_token_id=tokenizer.pad_token_id, flatten=flatten),
        drop_last=True,
        num_workers=cfg.dataloader_num_workers,
        pin_memory=pin_memory,
        persistent_workers=cfg.dataloader_num_workers > 0,
        # Each iterator draws its workers' seed from this generator, not the global RNG, so that the dropout of
        # later steps does not depend on dataloader_num_workers, nor on where a resumed run started its epoch.
        generator=torch.Generator().manual_seed(cfg.seed),
        worker_init_fn=ignore_sigterm,
    )


def ignore_sigterm(worker_id: int) -> None:
    """SLURM sends its SIGTERM to every process of the job, a rank's DataLoader workers too, which torch ends on a
    SIGTERM not from their rank: the rank then failed on its dead worker before it could save. The rank stops them."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def optimizer_step_batches(loader: DataLoader, accumulation: int, start_step: int = 0) -> Iterator[list[dict]]:
    """Endless stream of optimizer steps, each a list of `accumulation` micro-batches, reshuffled every epoch.

    Micro-batches left over at the end of an epoch (fewer than `accumulation`) are dropped, so every step has
    the same shape on every rank. The order depends only on the seed and the epoch. `start_step` skips that many
    steps (on resume): the epoch and the sampler order are the same as in an uninterrupted run, and skipped batches
    are never loaded.
    """
    steps_per_epoch = len(loader) // accumulation
    epoch, skip = divmod(start_step, steps_per_epoch)
    while True:
        loader.sampler.set_epoch(epoch)
        epoch_loader = loader
        if skip:
            # Drop the first batches' indices only; the sampler order is that of set_epoch(epoch).
            batches = list(loader.batch_sampler)[skip * accumulation:]
            epoch_loader = DataLoader(loader.dataset, batch_sampler=batches, collate_fn=loader.collate_fn,
                                      num_workers=loader.num_workers, pin_memory=loader.pin_memory,
                                      generator=loader.generator, worker_init_fn=loader.worker_init_fn)
        epoch_batches = iter(epoch_loader)
        skip = 0
        step: list[dict] = []
        for batch in epoch_batches:
            step.append(batch)
            if len(step) == accumulation:
                yield step
                step = []
        epoch += 1
