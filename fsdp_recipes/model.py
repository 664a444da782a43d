"""Load the tokenizer and the model, by hub id or local folder, through `from_pretrained`; shard the model."""

from __future__ import annotations

import contextlib
import os

import jinja2
import torch
import torch.distributed as dist
from accelerate import init_empty_weights
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel

from .config import ConfigError, TrainConfig, is_local_path, looked_in
from .distributed import long_wait_group, print_rank0, run_on_rank0
from . import fsdp1
from .families import hub_cache_miss, model_config_overrides, model_load_error
from .plan import ShardingPlan
from .sharding import MASTER_DTYPE, buffers_beside_parameters, kept_in_fp32, shard_model, state_dict_name


def load_tokenizer(cfg: TrainConfig):
    source = cfg.tokenizer_name_or_path or cfg.model_name_or_path
    if is_local_path(source) and not os.path.isdir(source):
        raise ConfigError(f"tokenizer_name_or_path {source}: no such folder{looked_in(source)}")
    save = (f"save the model's tokenizer in {source} (tokenizer.save_pretrained), or set tokenizer_name_or_path to "
            f"the base model's")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as error:
        key = "tokenizer_name_or_path" if cfg.tokenizer_name_or_path else "model_name_or_path"
        words = " ".join(str(error).split())
        raise ConfigError(hub_cache_miss(key, source, error)
                          or f"cannot load a tokenizer from {source}: {words}; {save}") from error
    # A folder without tokenizer files gives some model types (Qwen, GPT-2, Gemma) a tokenizer of special tokens
    # alone, which would tokenize every example to nothing or to unknown tokens.
    if not set(tokenizer.get_vocab()) - set(tokenizer.all_special_tokens) - set(tokenizer.get_added_vocab()):
        raise ConfigError(f"the tokenizer loaded from {source} has no vocabulary (its {len(tokenizer)} tokens are "
                          f"all special): the folder lacks its files (tokenizer.json, or its tokenizer's own); {save}")
    check_chat_template_parses(tokenizer, source)
    if tokenizer.pad_token is None:
        # Padding positions carry no loss and are masked out of attention, so any token will do.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_chat_template_parses(tokenizer, source: str) -> None:
    """Refuse a chat template that is not valid Jinja (a chat_template.jinja cut short by a copy) at load: its first
    use, on the first row of chat data or a generation prompt, would name a row or fail with jinja's traceback."""
    if not tokenizer.chat_template:
        return
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    except jinja2.TemplateSyntaxError as error:
        cut_short = "; a file cut short in a copy ends so" if "unexpected end of template" in error.message else ""
        raise ConfigError(f"the chat template of the tokenizer in {source} is not valid Jinja (its line "
                          f"{error.lineno}: {error.message.rstrip('.')}{cut_short}): fix or restore its "
                          f"chat_template.jinja (or tokenizer_config.json's chat_template)") from None
    except Exception:  # a valid template may refuse this one-message conversation: the data's rows are its test
        return


def export_dtype(cfg: TrainConfig) -> torch.dtype:
    """save_dtype, where "auto" means the dtype the checkpoint was saved in (e.g. bf16 for most hub models)."""
    if cfg.save_dtype != "auto":
        return getattr(torch, cfg.save_dtype)
    config = AutoConfig.from_pretrained(cfg.model_name_or_path, trust_remote_code=cfg.trust_remote_code)
    dtype = getattr(config, "dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def load_model(cfg: TrainConfig, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The whole model in this process (every rank, or rank 0 alone with cpu_ram_efficient_loading), in `dtype`:
    these are the master weights that the optimizer updates."""
    overrides, saved_values = model_config_overrides(cfg)
    try:
        with transformers_initialises_every_weight():
            model, loading = AutoModelForCausalLM.from_pretrained(
                cfg.model_name_or_path,
                dtype=dtype,
                attn_implementation=cfg.attn_implementation,
                trust_remote_code=cfg.trust_remote_code,
                output_loading_info=True,
                **overrides,
            )
    except OSError as error:  # a file the folder lacks (weights, the model code its auto_map names): one line
        raise ConfigError(model_load_error(cfg.model_name_or_path, error)) from error
    check_no_weight_missing(model, loading["missing_keys"], cfg.model_name_or_path)
    set_use_cache(model.config, False)  # the KV cache only costs memory in training
    model.config_for_export = saved_values  # see export.write_model_files
    return model


def check_no_weight_missing(model: PreTrainedModel, missing: list[str], path: str) -> None:
    """Parameters the checkpoint holds no weights for start from random values: a config.json that does not match
    the weights (one without num_hidden_layers builds transformers' default of 32 layers) would fine-tune a mostly
    random model, with only transformers' load report to say so. The output layer alone may be new (a checkpoint of
    the model without its head), which a line says."""
    output = model.get_output_embeddings()
    head = {name for name, param in model.named_parameters() if output is not None and param is output.weight}
    parameters = dict(model.named_parameters())
    lacking = [name for name in parameters if name in set(missing) - head]  # in the model's order
    if lacking:
        shown = ", ".join(lacking[:3]) + (f" and {len(lacking) - 3} more" if len(lacking) > 3 else "")
        layers = getattr(model.config.get_text_config(), "num_hidden_layers", None)
        built = f" (the model built from it has {layers} layers)" if layers else ""
        raise ConfigError(f"{path} holds no weights for {len(lacking)} of the model's {len(parameters)} parameters "
                          f"({shown}), which would train from random values: its config.json does not match its "
                          f"weights{built}, or a weight file is missing")
    for name in sorted(head & set(missing)):
        print_rank0(f"warning: {path} holds no {name}: the output layer starts from random values")


@contextlib.contextmanager
def transformers_initialises_every_weight():
    """from_pretrained with accelerate's FSDP_CPU_RAM_EFFICIENT_LOADING hidden. Under accelerate launch with
    fsdp_cpu_ram_efficient_loading true (its default), transformers leaves the weights a checkpoint lacks (a new
    lm_head) uninitialised on every rank but local rank 0, for accelerate to broadcast; the recipe's plan decides who
    reads the weights instead: every rank (each then initialises them as rank 0 does), or rank 0 alone."""
    saved = os.environ.pop("FSDP_CPU_RAM_EFFICIENT_LOADING", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = saved


def set_use_cache(config, use_cache: bool) -> None:
    """On the config and on its language model's (a multimodal model's reads its own: with a cache left on, an
    activation-checkpointed layer recomputed in backward appends to it a second time and attention fails)."""
    config.use_cache = use_cache
    config.get_text_config().use_cache = use_cache


def checkpoint_generation_config(path: str) -> GenerationConfig:
    """The generation config as from_pretrained reads it: the checkpoint's sampling defaults and stop tokens (which
    final/ carries on), from generation_config.json, else from the generation keys of config.json (older models)."""
    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:
        return GenerationConfig.from_pretrained(path, config_file_name="config.json", _from_model_config=True)


def check_attention_device(cfg: TrainConfig, device: torch.device) -> None:
    """flex_attention on the CPU: an error before the model loads, not torch's traceback on every rank at the first
    backward (its FlexAttention computes forward only there, as evaluation and generation would)."""
    if cfg.attn_implementation == "flex_attention" and device.type == "cpu":
        raise ConfigError("attn_implementation flex_attention trains on a GPU only (torch's FlexAttention has no "
                          "backward on the CPU): on the CPU use sdpa, the default, or eager")


def load_sharded_model(cfg: TrainConfig, plan: ShardingPlan, device: torch.device) -> nn.Module:
    """The model sharded as `plan` says, with master weights in the plan's dtype.

    With `cpu_ram_efficient_loading` only rank 0 reads the weights: every rank builds the model with its parameters
    on the meta device, shards it, allocates its own shards only, and rank 0 broadcasts the weights into them.
    """
    fsdp1.check_offload_device(plan, device)
    check_attention_device(cfg, device)
    dtype = MASTER_DTYPE[plan.mixed_precision]
    if not plan.cpu_ram_efficient_loading:
        model = load_model(cfg, dtype)
        # Each rank reads (or downloads) at its own pace: they meet here, not in sharding's first collective, whose
        # 30-minute timeout is meant for training.
        dist.barrier(group=long_wait_group())
        return shard_model(model, plan, device)

    config = AutoConfig.from_pretrained(cfg.model_name_or_path, trust_remote_code=cfg.trust_remote_code)
    overrides, saved_values = model_config_overrides(cfg)
    config.update(overrides)
    # Buffers stay real: non-persistent ones (rotary frequencies) are computed here, not read from the checkpoint.
    with init_empty_weights(include_buffers=False):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=cfg.attn_implementation,
                                                     trust_remote_code=cfg.trust_remote_code)
        except OSError as error:  # the model code its auto_map names, missing from the folder
            raise ConfigError(model_load_error(cfg.model_name_or_path, error)) from error
    set_use_cache(model.config, False)  # as load_model: after the generation config was derived from it
    model.config_for_export = saved_values
    if model.can_generate():
        model.generation_config = checkpoint_generation_config(cfg.model_name_or_path)
    model.tie_weights()  # init_empty_weights gives lm_head a parameter of its own
    # In fp32 where from_pretrained keeps them (DeepSeek V3's router bias): transformers 5.17's from_config leaves
    # them in `dtype`, and the fp32 values rank 0 reads would be rounded into them.
    kept = kept_in_fp32(model, dtype)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if kept and kept.search(name) and tensor.is_floating_point():
            tensor.data = tensor.data.float()
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    loaded = {}

    def read_weights() -> dict:
        full = load_model(cfg, dtype)
        # The renames from_pretrained applied, which the export reverses to write the Hub layout: a model built from
        # its config has none recorded, and the defaults transformers looks up by class name miss FSDP2's class.
        loaded["conversions"] = getattr(full, "_weight_conversions", None)
        return full.state_dict()

    # Rank 0 reads (or downloads) the weights alone; the others hold an empty dict: the broadcast below fills their
    # shards, not the dict.
    full_state = run_on_rank0(read_weights, "to read the weights") or {}
    if loaded.get("conversions") is not None:  # rank 0, which writes the exports
        model._weight_conversions = loaded["conversions"]

    model = shard_model(model, plan, device)
    if any(p.is_meta for p in model.parameters()):  # FSDP1 allocated while wrapping; FSDP2 allocates here
        model.to_empty(device=torch.device("cpu") if plan.offload_params else device)
    # to_empty also emptied the buffers; they live on the compute device even when parameters are offloaded.
    for module_name, module in model.named_modules():
        for name in [n for n, b in module._buffers.items() if b is not None]:
            module._buffers[name] = buffers[state_dict_name(f"{module_name}.{name}".lstrip("."))].to(device)
    if isinstance(model, FSDP):
        _broadcast_into_fsdp1_shards(model, full_state)
        _broadcast_persistent_buffers(model, full_state)
    else:
        with buffers_beside_parameters(model):
            set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True,
                                                                             broadcast_from_rank0=True))
    return model


def _broadcast_into_fsdp1_shards(model: FSDP, full_state: dict) -> None:
    """Rank 0's tensors, broadcast one at a time; each rank copies its part into its shard of the flat parameter.

    torch's broadcast_from_rank0 (and FSDP1's sharded state dict) would build a full or a second sharded copy on
    every rank. This reads FSDP1's flat-parameter layout, stable since torch 2.1: with use_orig_params=True each
    original parameter is a view of its part of this rank's shard (1-D, or the whole parameter under NO_SHARD).
    """
    for unit_name, unit in model.named_modules():
        handle = unit._handle if isinstance(unit, FSDP) else None
        if handle is None:
            continue
        prefix = state_dict_name(unit_name + ".") if unit_name else ""
        flat = handle.flat_param
        # _params holds each parameter once; a tied one is in _shared_params and aliases its first occurrence.
        for param, info, fqn, shape in zip(flat._params, flat._shard_param_infos, flat._fqns, flat._shapes):
            key = prefix + state_dict_name(fqn)
            full = full_state[key] if dist.get_rank() == 0 else torch.empty(shape, dtype=param.dtype)
            full = full.to(param.device, param.dtype)
            dist.broadcast(full, src=0)
            if info.in_shard:
                with torch.no_grad():
                    # view(-1): NO_SHARD (and any FSDP1 on one rank) keeps parameters in their original shape.
                    param.view(-1).copy_(full.flatten()[info.intra_param_start_idx: info.intra_param_end_idx + 1])
            del full


def _broadcast_persistent_buffers(model: nn.Module, full_state: dict) -> None:
    """Rank 0's values of the buffers the checkpoint holds (e.g. Gemma 4's layer_scalar), in place of the values
    the model's constructor gave them; FSDP2's set_model_state_dict loads them with the parameters."""
    for module_name, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is None or name in module._non_persistent_buffers_set:
                continue
            if dist.get_rank() == 0:
                buffer.copy_(full_state[state_dict_name(f"{module_name}.{name}".lstrip("."))])
            dist.broadcast(buffer, src=0)
