"""What a recipe declares about its model family (MODEL_TYPES), checked before anything is loaded."""

from __future__ import annotations

import os
import re
import sys

from huggingface_hub import constants
from huggingface_hub.errors import LocalEntryNotFoundError
from huggingface_hub.file_download import repo_folder_name
from transformers import AutoConfig, AutoModelForCausalLM

from .config import ROUTER_LOSS_KEYS, ConfigError, TrainConfig, is_local_path, looked_in
from .new_recipe import INSTALLED, PROJECT_RECIPES, generic_recipe, recipe_advice, recipes_training


# The attention implementations that apply attention soft-capping (Gemma 2, VaultGemma). eager and flex_attention
# compute it; transformers gives it to every flash_attention_* kernel (its Hub fallback too), or raises where the
# kernel takes no softcap (modeling_flash_attention_utils, 5.24). sdpa skips it (transformers 5.17; later versions
# refuse it), and a Hub kernel (org/repo) may register an attention function of its own, which no check covers.
SOFT_CAPPING_ATTENTION = ("eager", "flash_attention_2", "flash_attention_3", "flash_attention_4", "flex_attention")
# Falcon's ALiBi (Falcon-RW) is a bias added to the attention mask, which no flash kernel takes: transformers refuses
# flash attention for it only at the first forward, once the model is loaded. Falcon implements no flex_attention.
ALIBI_ATTENTION = ("eager", "sdpa")


def exact_attention(config) -> tuple[tuple[str, ...], str] | None:
    """The attention implementations that compute this model exactly, and what needs them (None: any), checked by
    every recipe (the generic sft.py too) and the memory estimate; a recipe's MODEL_TYPES may narrow them further."""
    text_config = config.get_text_config()
    if getattr(text_config, "attn_logit_softcapping", None) is not None:
        return SOFT_CAPPING_ATTENTION, "soft-capping"
    if text_config.model_type == "falcon" and getattr(text_config, "alibi", False):
        return ALIBI_ATTENTION, "ALiBi"
    return None


def model_load_error(name: str, error: Exception) -> str:
    """What to change when transformers cannot read the model's config: its own words, but for the cases whose
    words mislead (a Hub URL for a local folder, a Python keyword argument, an internet connection to check, a
    config.json without model_type for a folder without config.json)."""
    if "trust_remote_code" in str(error):
        return (f"model_name_or_path {name} ships its own model code (auto_map in its config.json): read it, then "
                f"pass --trust_remote_code true to run it (the recipe key trust_remote_code: true)")
    if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
        final = os.path.join(name, "final")
        return (f"model_name_or_path {name} is a folder without config.json: give the folder that save_pretrained "
                f"wrote (config.json beside the weights)"
                + (f", such as this run's export {final}" if os.path.isfile(os.path.join(final, "config.json")) else ""))
    missing_code = re.search(r"does not appear to have a file named (\S+\.py)", str(error))
    if os.path.isdir(name) and missing_code:
        return (f"model_name_or_path {name}: its config.json runs model code from {missing_code.group(1)} (auto_map), "
                f"which the folder lacks: copy the model's .py files beside its config.json")
    return hub_cache_miss("model_name_or_path", name, error) or f"model_name_or_path: {error}"


def hub_cache_miss(key: str, name: str, error: Exception) -> str | None:
    """What to change when `name`, no local folder, is not in the Hugging Face cache, whole or in part, and the Hub
    cannot be reached to download it (a compute node without network): the cache looked in, and how to fill it or
    point at the one that holds it (on a cluster, HF_HOME set on the login node but not in the job). None for another
    error."""
    chain = [error]
    while chain[-1].__cause__ or chain[-1].__context__:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    if os.path.exists(name) or not any(isinstance(e, LocalEntryNotFoundError) for e in chain):
        return None
    cache = constants.HF_HUB_CACHE
    why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "no network"
    # A download with --include, or one cut short, leaves the id's folder without a file the load needs.
    if os.path.isdir(os.path.join(cache, repo_folder_name(repo_id=name, repo_type="model"), "snapshots")):
        return (f"{key} {name}: the Hugging Face cache {cache} holds only part of it, without a file the load needs, "
                f"and the Hub cannot be reached ({why}) to download that: download it whole into that cache where the "
                f"Hub can be reached (hf download {name}, without --include)")
    return (f"{key} {name}: no such folder in {os.getcwd()}, nor in the Hugging Face cache {cache}, and the Hub "
            f"cannot be reached ({why}) to download it: download it into that cache where the Hub can be reached (hf "
            f"download {name}, with the same HF_HOME or HF_HUB_CACHE), or set HF_HOME (or HF_HUB_CACHE) to the cache "
            f"that holds it")


def check_model_type(cfg: TrainConfig, model_types: dict[str, tuple[str, ...] | None] | None, recipe: str) -> None:
    """The model must be one of the recipe's model types, with an attention implementation that computes it exactly,
    and take the router-loss keys the recipe config sets.

    A recipe's YAML holds defaults for its family (e.g. Gemma 2's eager attention), so another family's model is
    refused rather than trained with them. `model_types` maps config.json's model_type to the attention
    implementations the recipe allows for it (None: those of exact_attention, or any); `model_types` None (the
    generic recipe) takes every model type, with the attention implementations of exact_attention.
    """
    for model_type, allowed in (model_types or {}).items():
        # A bare string would be read letter by letter: "eager" allowing "e", refusing sdpa as "e or a or g ...".
        if allowed is not None and (isinstance(allowed, str) or not all(isinstance(a, str) for a in allowed)):
            raise TypeError(f"{os.path.basename(recipe)}: MODEL_TYPES[{model_type!r}] must be None or a tuple of "
                            f"attention implementations, such as (\"eager\",), got {allowed!r}")
    name = cfg.model_name_or_path
    if is_local_path(name) and not os.path.exists(name):
        raise ConfigError(f"model_name_or_path {name}: no such folder{looked_in(name)}")
    if os.path.isdir(os.path.join(cfg.model_name_or_path, "model")) and os.path.isfile(
            os.path.join(cfg.model_name_or_path, "trainer_state.json")):
        path = cfg.model_name_or_path
        raise ConfigError(f"model_name_or_path {path} is a sharded checkpoint (its weights are the DCP shards in "
                          f"model/), which from_pretrained cannot load: to train from its weights, convert it "
                          f"(python -m fsdp_recipes.convert {path} <out_dir>) and pass <out_dir>; to continue its "
                          f"run, pass resume_from_checkpoint {path}")
    try:
        config = AutoConfig.from_pretrained(cfg.model_name_or_path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:  # transformers' message names the path or hub id and what is missing there
        raise ConfigError(model_load_error(cfg.model_name_or_path, e)) from e
    check_causal_lm(config, cfg.model_name_or_path)
    check_loads_whole(config, cfg.model_name_or_path)
    # The family first: another family's recipe would give the attention advice of its own YAML config.
    if model_types is not None and config.model_type not in model_types:
        raise ConfigError(
            f"{os.path.basename(recipe)} trains {', '.join(model_types)} models, but {cfg.model_name_or_path} is a "
            f"{config.model_type} model: {_recipe_advice(config.model_type, recipe)}"
        )
    # The generic recipe names the family's recipe first: its YAML holds what the attention check may ask for
    # (Gemma 2's eager attention).
    if model_types is None and os.environ.get("RANK", "0") == "0":  # before the process group: rank 0 says it once
        family = recipes_training(config.model_type, os.path.dirname(recipe) or ".")
        if family:  # trained here without the family's YAML defaults (Qwen3-MoE's router loss): say so
            print(f"note: {family[0]} trains {config.model_type} models with its family's defaults (its YAML config "
                  f"in {os.path.join(os.path.dirname(family[0]), 'configs')}); {os.path.basename(recipe)} trains it "
                  f"with the config given here", flush=True)
    exact = exact_attention(config)
    if exact:
        _check_attention(cfg, config.model_type, exact[0], f"fsdp_recipes/families.py: attention {exact[1]}")
    if model_types is not None:
        _check_attention(cfg, config.model_type, model_types[config.model_type], os.path.basename(recipe))
    check_attention_implemented(cfg.attn_implementation, config)
    model_config_overrides(cfg)  # router-loss keys the model cannot take: now, not after the data


def model_config_overrides(cfg: TrainConfig) -> tuple[dict, dict]:
    """Model config attributes the recipe config sets (the MoE router loss), and the values config.json has for them,
    which the exported folders keep (batched generate fails with output_router_logits on). One the model lacks is
    an error."""
    overrides = {key: getattr(cfg, key) for key in ROUTER_LOSS_KEYS if getattr(cfg, key) is not None}
    if not overrides:
        return {}, {}
    config = AutoConfig.from_pretrained(cfg.model_name_or_path, trust_remote_code=cfg.trust_remote_code)
    # The trainer adds router_aux_loss_coef x the aux_loss of transformers' load_balancing_loss_func: a model with a
    # router but without these would train without the loss (DeepSeek V3, Llama 4) or fail at its first step
    # (JetMoE's and DBRX's coefficients have other names).
    # None: the checkpoint's own code, not known before loading; with trust_remote_code, an auto_map entry for
    # AutoModelForCausalLM loads that code even where config.json's model_type (and so the config class) is native.
    own_code = cfg.trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    model_class = (AutoModelForCausalLM._model_mapping[type(config)]
                   if type(config) in AutoModelForCausalLM._model_mapping and not own_code else None)
    if (hasattr(config, "output_router_logits") and model_class is not None
            and overrides.get("output_router_logits", "router_aux_loss_coef" in overrides)
            and not (hasattr(sys.modules[model_class.__module__], "load_balancing_loss_func")
                     and hasattr(config, "router_aux_loss_coef"))):
        raise ConfigError(f"{', '.join(overrides)} is set, but {model_class.__name__} does not compute the router "
                          f"load-balancing loss that the trainer weighs (transformers' load_balancing_loss_func, with "
                          f"router_aux_loss_coef): the run would train without it, or fail at its first step. Remove "
                          f"it, or set output_router_logits false")
    missing = [key for key in overrides if not hasattr(config, key)]
    if missing:
        raise ConfigError(f"{', '.join(missing)} is set, but {config.model_type} models have no such setting (no "
                          "router load-balancing loss to turn on or weigh: a dense model, or a mixture of experts "
                          "whose forward computes none): remove it")
    # The model computes aux_loss only with output_router_logits: a coefficient alone would weigh nothing.
    # (output_router_logits false in the recipe config turns the loss off on purpose, coefficient or not.)
    if (overrides.get("router_aux_loss_coef") and cfg.output_router_logits is None
            and not getattr(config, "output_router_logits", False)):
        raise ConfigError("router_aux_loss_coef is set, but the model's config.json has output_router_logits "
                          "false, so the model computes no router loss: add --output_router_logits true, or "
                          "remove router_aux_loss_coef")
    return overrides, {key: getattr(config, key) for key in overrides}


def _recipe_advice(model_type: str, recipe: str) -> str:
    """Where to go for a model type that `recipe` does not train: new_recipe's advice for the recipe's folder (the
    recipe that trains it, there or in this project's recipes/), or else the ways to get a recipe of its own."""
    folder = os.path.dirname(recipe) or "."
    if os.path.abspath(folder) != PROJECT_RECIPES:  # a copy of one's own: its sibling is written beside it
        create = f"python -m fsdp_recipes.new_recipe {model_type} --recipes_dir {folder}"
    elif INSTALLED:  # an installed package's own recipes: no folder of the user's to write into
        create = f"python -m fsdp_recipes.new_recipe {model_type} --recipes_dir <your recipes folder>"
    else:
        create = f"make new-recipe MODEL={model_type}"
    return recipe_advice(model_type, folder) or (
        f"no recipe trains {model_type} models: run the generic {generic_recipe()}, or create one with `{create}`")


def check_causal_lm(config, name: str) -> None:
    """A model AutoModelForCausalLM builds: a model type transformers lists for it (BART's and Whisper's decoders
    too), or code of the checkpoint's own that declares it (auto_map); not a type only other auto classes load
    (T5, encoders, most vision-language models)."""
    if type(config) in AutoModelForCausalLM._model_mapping or "AutoModelForCausalLM" in (
            getattr(config, "auto_map", None) or {}):
        return
    raise ConfigError(f"{name} is a {config.model_type} model, which AutoModelForCausalLM does not load: train a "
                      f"causal language model (a decoder-only model type transformers lists for "
                      f"AutoModelForCausalLM), or a checkpoint whose own code declares one (trust_remote_code)")


def check_loads_whole(config, name: str) -> None:
    """Refuse a model of which AutoModelForCausalLM loads a part alone (Llama 4's, Qwen 3.5's text model), checked
    by every recipe and by the memory estimate: `name` is the model as the user gave it."""
    part = part_that_loads(config)
    if part is not None:
        raise ConfigError(
            f"{name} is a {config.model_type} model, of which AutoModelForCausalLM loads the {part.__name__} part "
            f"alone: the run would train and export it without the rest of the checkpoint (its vision or audio "
            f"model). Not supported: train a model that AutoModelForCausalLM loads whole, such as a checkpoint of "
            f"that part alone (model_type {part.config_class.model_type})"
        )


def part_that_loads(config) -> type | None:
    """The class AutoModelForCausalLM builds from one of the config's sub-configs, leaving the rest of the checkpoint
    out (Qwen 3.5's and Llama 4's text models), or None when it builds the whole model."""
    mapping = AutoModelForCausalLM._model_mapping
    if type(config) not in mapping:
        return None
    model_class = mapping[type(config)]
    sub_config_classes = {type(getattr(config, key, None)) for key in config.sub_configs}
    return model_class if model_class.config_class in sub_config_classes - {type(config)} else None


# The attention implementations a transformers model class declares, by the flag from_pretrained checks for each.
ATTENTION_FLAGS = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn",
                   "flash_attention_3": "_supports_flash_attn", "flash_attention_4": "_supports_flash_attn",
                   "flex_attention": "_supports_flex_attn"}


def check_attention_implemented(attn_implementation: str, config) -> None:
    """Refuse an attention implementation the model class lacks (BLOOM, MPT, XGLM, gpt-oss have no sdpa, the
    default) before the data are tokenized and the model is loaded, where from_pretrained would raise it with advice
    for Python code. A Hub kernel, and a checkpoint's own code, are left to from_pretrained."""
    if attn_implementation not in ATTENTION_FLAGS or type(config) not in AutoModelForCausalLM._model_mapping:
        return
    model_class = AutoModelForCausalLM._model_mapping[type(config)]
    if getattr(model_class, ATTENTION_FLAGS[attn_implementation], False):
        return
    implemented = ["eager", *(name for name, flag in ATTENTION_FLAGS.items() if getattr(model_class, flag, False))]
    raise ConfigError(f"{model_class.__name__} does not implement attn_implementation {attn_implementation}: set "
                      f"attn_implementation to one it does ({', '.join(implemented)}), e.g. --attn_implementation "
                      f"eager")


def _check_attention(cfg: TrainConfig, model_type: str, allowed: tuple[str, ...] | None, source: str) -> None:
    if allowed is not None and cfg.attn_implementation not in allowed:
        raise ConfigError(f"{model_type} models need attn_implementation {' or '.join(allowed)} (see {source}), "
                          f"got {cfg.attn_implementation}")
