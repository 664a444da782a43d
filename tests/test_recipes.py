"""Every recipe trains a tiny random model of its architecture with 2-process FSDP2, and exports a folder that
reloads with the trained weights; the model-specific traps are checked with numbers; the recipes share every line
but their own; a model type without a recipe gets one from `make new-recipe` and runs through the generic path."""

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import huggingface_hub
import pytest
import torch
import yaml
from torch import nn
from safetensors import safe_open
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (AutoConfig, AutoModelForCausalLM, BioGptConfig, Gemma2Config, Gemma3Config,
                          Gemma3TextConfig, Gemma4TextConfig, LlamaConfig, MistralConfig, Phi3Config,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen3Config, Qwen3MoeConfig, Qwen3MoeForCausalLM,
                          SiglipVisionConfig, VaultGemmaConfig)
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from conftest import REPO, read_metrics, run, subprocess_env, torchrun
from test_readme import readme_commands
from fsdp_recipes import demo
from fsdp_recipes.config import ConfigError, parse_config
from fsdp_recipes.data import IGNORE_INDEX, collate, model_inputs
from fsdp_recipes.data_sources import load_split
from fsdp_recipes.export import tied_parameter_names
from fsdp_recipes import families, new_recipe as new_recipe_module
from fsdp_recipes.families import check_model_type
from fsdp_recipes.model import load_model, load_sharded_model, load_tokenizer, model_config_overrides
from fsdp_recipes.new_recipe import OWN_END, OWN_START, is_recipe, new_recipe, split_recipe, sync_recipes
from fsdp_recipes.plan import resolve_plan
from fsdp_recipes.sharding import find_layer_classes
from fsdp_recipes.trainer import check_packed_router_loss, forward_backward

TOKENIZER = demo.build_tokenizer()
TINY = dict(vocab_size=len(TOKENIZER), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
            bos_token_id=TOKENIZER.bos_token_id, eos_token_id=TOKENIZER.eos_token_id,
            pad_token_id=TOKENIZER.pad_token_id)
WINDOW = 8  # sliding window of the tiny models that have one: far shorter than the 40-token test inputs

# family: (recipe, its YAML config, the tiny model's config, the decoder layer class, extra recipe arguments)
FAMILIES = {
    "llama": ("llama_sft", "llama_sft", LlamaConfig(**TINY, tie_word_embeddings=True), "LlamaDecoderLayer", []),
    "mistral": ("mistral_sft", "mistral_sft", MistralConfig(**TINY, sliding_window=WINDOW), "MistralDecoderLayer",
                []),
    "qwen2": ("qwen2_sft", "qwen2_sft", Qwen2Config(**TINY, tie_word_embeddings=True), "Qwen2DecoderLayer", []),
    "qwen3": ("qwen3_sft", "qwen3_sft", Qwen3Config(**TINY, tie_word_embeddings=True), "Qwen3DecoderLayer", []),
    "gemma2": ("gemma_sft", "gemma2_sft", Gemma2Config(**TINY, sliding_window=WINDOW, query_pre_attn_scalar=16),
               "Gemma2DecoderLayer", []),
    # Rank-0 loading builds Gemma 3 on the meta device: its embedding scale is a buffer that must survive that.
    "gemma3": ("gemma_sft", "gemma3_sft", Gemma3TextConfig(**TINY, sliding_window=WINDOW, query_pre_attn_scalar=16),
               "Gemma3DecoderLayer", ["--fsdp_cpu_ram_efficient_loading", "true"]),
    "phi3": ("phi3_sft", "phi3_sft", Phi3Config(**TINY), "Phi3DecoderLayer", []),
    "qwen3_moe": ("qwen3_moe_sft", "qwen3_moe_sft",
                  Qwen3MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
                  "Qwen3MoeDecoderLayer", ["--save_steps", "8"]),
}


def write_model(path: Path, config, generation_in_config_json=False) -> Path:
    """A random model; its sampling settings, which final/ must keep, in generation_config.json or (as older models
    have them) in config.json."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.do_sample, model.generation_config.temperature = True, 0.6
    model.save_pretrained(path)
    if generation_in_config_json:
        (path / "generation_config.json").unlink()
        config_json = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config_json, "do_sample": True, "temperature": 0.6}))
    TOKENIZER.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("recipes") / "train.jsonl"
    demo.write_jsonl(path, demo.make_split(seed=1, n_train=64, n_eval=0)[0])
    return path


def train_and_check_export(recipe: Path, config_yaml: str, model_dir: Path, data: Path, out: Path, *extra) -> dict:
    """Train 8 steps with the recipe; check that the loss fell and that the exported folder reloads with logits
    equal to the trained weights' and to the sharded model's. Returns what the driver recorded, and the run."""
    proc = torchrun("tests/drivers/recipe_check.py", recipe, out, "--config", config_yaml,
                    "--model_name_or_path", model_dir, "--dataset_name", data, "--output_dir", out / "run",
                    "--max_steps", "8", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
                    "--max_seq_length", "64",
                    "--learning_rate", "3e-3", "--warmup_steps", "0", "--logging_steps", "1",
                    "--mixed_precision", "no", "--save_dtype", "float32", "--fsdp_version", "2", *extra)
    metrics = read_metrics(out / "run" / "metrics.jsonl")
    losses = [m["loss"] for m in metrics]
    assert len(losses) == 8 and losses[-1] < 0.9 * losses[0], losses

    recorded = torch.load(out / "sharded.pt", weights_only=True)
    # The training model is freed before sample generation loads the exported one onto rank 0's device.
    assert json.loads((out / "at_generation.json").read_text()) == {"live_fsdp_objects": 0}
    inputs = recorded["inputs"]
    final = out / "run" / "final"
    # config.json does not record the attention implementation: reload with the recipe's (Gemma 2: eager).
    attn = yaml.safe_load((REPO / config_yaml).read_text()).get("attn_implementation", "sdpa")
    reloaded = AutoModelForCausalLM.from_pretrained(final, attn_implementation=attn).eval()
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32,
                                                 attn_implementation=attn).eval()
    missing, unexpected = reference.load_state_dict(recorded["gathered"], strict=False)
    assert not unexpected and set(missing) <= tied_parameter_names(reference)
    initial = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn).eval()
    with torch.no_grad():
        logits = reloaded(inputs).logits
        assert torch.equal(logits, reference(inputs).logits)
        assert not torch.equal(logits, initial(inputs).logits)  # the weights did train
    # The sharded model computes what the unsharded one does.
    torch.testing.assert_close(recorded["logits"], logits, rtol=1e-5, atol=1e-5)
    print(f"{recipe.name}: losses {losses[0]:.3f} -> {losses[-1]:.3f}, max |sharded - reloaded| logit deviation "
          f"{(recorded['logits'] - logits).abs().max().item():.1e}")
    # The source's generation settings, whichever rank loads the weights; the KV cache on for generation.
    generation = json.loads((final / "generation_config.json").read_text())
    assert (generation["do_sample"], generation["temperature"], generation.get("use_cache", True)) == (True, 0.6, True)
    with safe_open(str(final / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    if reloaded.config.tie_word_embeddings:
        assert tied_parameter_names(reloaded) and not tied_parameter_names(reloaded) & stored  # written once
        assert reloaded.get_output_embeddings().weight is reloaded.get_input_embeddings().weight
    return {"recorded": recorded, "reloaded": reloaded, "stdout": proc.stdout, "metrics": metrics}


@pytest.mark.parametrize("family", FAMILIES)
def test_recipe_trains_and_exports_its_family(family, data, tmp_path):
    recipe, config_yaml, config, layer_class, extra = FAMILIES[family]
    # Rank-0 loading builds the model from its config: the generation config must still be the checkpoint's.
    rank0_loading = "--fsdp_cpu_ram_efficient_loading" in extra
    model_dir = write_model(tmp_path / "model", config, generation_in_config_json=rank0_loading)
    result = train_and_check_export(REPO / "recipes" / f"{recipe}.py", f"recipes/configs/{config_yaml}.yaml",
                                    model_dir, data, tmp_path, *extra)
    assert f"wrapped: 2 x {layer_class}, then the root" in result["stdout"]
    reloaded, inputs = result["reloaded"], result["recorded"]["inputs"]

    if config.model_type in ("mistral", "gemma3_text"):
        # Sliding window (both tiny layers): token 0 is out of reach of the last position, token 35 is not.
        far, near = inputs.clone(), inputs.clone()
        far[:, 0], near[:, 35] = 7, 7
        with torch.no_grad():
            logits, far_logits, near_logits = (reloaded(x).logits[:, -1] for x in (inputs, far, near))
        torch.testing.assert_close(far_logits, logits, rtol=0, atol=1e-6)
        assert (near_logits - logits).abs().max() > 1e-3
    if config.model_type == "gemma2":
        # Final-logit soft-capping: with weights scaled up, the logits stay within the cap, the uncapped ones do not.
        with torch.no_grad():
            reloaded.get_input_embeddings().weight.mul_(50)  # tied: also lm_head
            capped = reloaded(inputs).logits
            reloaded.config.final_logit_softcapping = None
            uncapped = reloaded(inputs).logits
        assert capped.abs().max() < 30 < uncapped.abs().max()
    if config.model_type == "qwen3_moe":
        # Each rank holds 2 of the 4 experts: the 3-D expert parameters are sharded along the expert dimension,
        # inside their decoder layer's FSDP unit.
        shapes = result["recorded"]["local_shapes"]
        assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (2, 64, 64)
        assert shapes["model.layers.0.mlp.experts.down_proj"] == (2, 64, 32)
        # The router loss is computed and logged at every step (about top_k for a balanced router).
        assert all(1.0 < m["router_aux_loss"] < 4.0 for m in result["metrics"])
        # final/ and the converted checkpoint hold the original (Hub) layout, as save_pretrained wrote the source:
        # per-expert gate_proj, up_proj and down_proj, not transformers 5's fused gate_up_proj.
        final = load_file(tmp_path / "run" / "final" / "model.safetensors")
        assert final.keys() == load_file(model_dir / "model.safetensors").keys()
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in final
        run([sys.executable, "-m", "fsdp_recipes.convert", tmp_path / "run" / "checkpoint-8", tmp_path / "converted"])
        converted = load_file(tmp_path / "converted" / "model.safetensors")
        assert converted.keys() == final.keys() and all(torch.equal(converted[k], final[k]) for k in final)
        # The router loss was on for training only: the folders keep config.json's settings (off, coefficient
        # 0.001), with which batched generate works.
        source = json.loads((model_dir / "config.json").read_text())
        for folder in [tmp_path / "run" / "final", tmp_path / "converted"]:
            saved = json.loads((folder / "config.json").read_text())
            assert [saved["output_router_logits"], saved["router_aux_loss_coef"]] == [
                source["output_router_logits"], source["router_aux_loss_coef"]] == [False, 0.001]
        assert reloaded.generate(inputs[:2, :8], min_new_tokens=2, max_new_tokens=2, do_sample=False).shape == (2, 10)


def tiny_moe_step():
    """A tiny Qwen3-MoE with its router loss on, and an optimizer step of two micro-batches of equal label counts."""
    config = Qwen3MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            output_router_logits=True, router_aux_loss_coef=0.1)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    ids = torch.randint(5, config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(1))
    micro_batches = [{"input_ids": ids[i:i + 2], "attention_mask": torch.ones_like(ids[i:i + 2]),
                      "labels": ids[i:i + 2]} for i in (0, 2)]
    label_tokens = sum(int((mb["labels"][:, 1:] != IGNORE_INDEX).sum()) for mb in micro_batches)
    return model, micro_batches, label_tokens


def take_grads(model) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def test_router_aux_loss_is_weighted_as_the_models_own_loss():
    """The gradient is that of the mean of the model's own per-micro-batch loss (mean cross-entropy + coef x
    aux_loss), and differs without the router loss."""
    model, micro_batches, label_tokens = tiny_moe_step()
    _, aux_loss_sum = forward_backward(model, micro_batches, label_tokens, 1, torch.device("cpu"))
    ours = take_grads(model)
    hf_aux = 0.0
    for mb in micro_batches:
        outputs = model(**mb)
        (outputs.loss / len(micro_batches)).backward()
        hf_aux += outputs.aux_loss.item()
    reference = take_grads(model)
    for name in ours:
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-5, atol=1e-7, msg=name)
    assert aux_loss_sum.item() == pytest.approx(hf_aux, rel=1e-6)

    model.config.output_router_logits = False
    assert forward_backward(model, micro_batches, label_tokens, 1, torch.device("cpu"))[1] is None
    router = "model.layers.0.mlp.gate.weight"
    assert (take_grads(model)[router] - ours[router]).abs().max() > 1e-4


def test_packed_router_loss_leaves_out_the_padding_of_packed_rows():
    """Packed batches reach the model without attention_mask, so its own aux_loss would count the padding that
    ends the shorter row. The loss used is that of the real tokens alone: each packed row run on its own, without
    padding, gives the same router logits (attention stays within each example)."""
    model, _, _ = tiny_moe_step()
    with torch.no_grad():  # a router sharper than at initialisation, whose loss the padding moves more
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(30)
    rows = [{"input_ids": list(range(5, 17)), "labels": list(range(5, 17)), "position_ids": [*range(5), *range(7)]},
            {"input_ids": [20, 21, 22], "labels": [20, 21, 22], "position_ids": [0, 1, 2]}]
    batch = collate(rows, pad_token_id=0)
    label_tokens = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    _, aux_loss_sum = forward_backward(model, [batch], label_tokens, 1, torch.device("cpu"))
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([row["input_ids"]]), position_ids=torch.tensor([row["position_ids"]]))
                 for row in rows]
        padded = model(**model_inputs(batch))
    layers = range(len(alone[0].router_logits))
    real_tokens = tuple(torch.cat([out.router_logits[i] for out in alone]) for i in layers)
    expected = load_balancing_loss_func(real_tokens, 4, 2)
    assert aux_loss_sum.item() == pytest.approx(expected.item(), rel=1e-6)
    assert abs(padded.aux_loss.item() - expected.item()) > 1e-2  # the model's own, padding counted


def test_packing_with_a_router_loss_the_project_cannot_mask_is_refused():
    model, _, _ = tiny_moe_step()
    check_packed_router_loss(model)
    del model.num_experts_per_tok  # a model that computes the loss some other way
    with pytest.raises(ConfigError, match="^packing with the router load-balancing loss on: Qwen3MoeForCausalLM does "
                                          "not compute that loss as transformers' MoE models do .* Set packing false, "
                                          "or output_router_logits false$"):
        check_packed_router_loss(model)


def test_hf_trainer_weights_the_router_loss_gradient_accumulation_steps_times_more(tmp_path):
    """The README's claim about HF's Trainer, checked against transformers' own Trainer (x world size too, which
    one process cannot show)."""
    from transformers import Trainer, TrainingArguments  # slow to import, and only this test uses it

    model, micro_batches, label_tokens = tiny_moe_step()
    # One optimizer step of HF's Trainer: 2 micro-batches, each with the step's label count, as its loop passes it.
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             report_to="none", use_cpu=True)
    trainer = Trainer(model=model, args=args)
    for mb in micro_batches:
        trainer.training_step(model, dict(mb), num_items_in_batch=torch.tensor(label_tokens))
    hf = take_grads(model)

    router = "model.layers.0.mlp.gate.weight"
    forward_backward(model, micro_batches, label_tokens, 1, torch.device("cpu"))
    assert not torch.allclose(take_grads(model)[router], hf[router], rtol=1e-3)  # the same coefficient: another
    model.config.router_aux_loss_coef = 0.1 * 2  # x gradient_accumulation_steps
    forward_backward(model, micro_batches, label_tokens, 1, torch.device("cpu"))
    ours = take_grads(model)
    for name in ours:
        torch.testing.assert_close(ours[name], hf[name], rtol=1e-5, atol=1e-7, msg=name)


def check_recipes_folder(recipes_dir: Path) -> list[str]:
    """Each recipe in recipes_dir (a .py file with the markers, as --sync reads them: a helper module is none) has
    llama_sft.py's shared part, and each YAML config in its configs/ only known keys. Returns the recipes' names."""
    _, head, _, tail = split_recipe((REPO / "recipes" / "llama_sft.py").read_text())
    recipes = [path for path in sorted(recipes_dir.glob("*.py")) if is_recipe(path.read_text())]
    for path in recipes:
        text = path.read_text()
        _, recipe_head, own, recipe_tail = split_recipe(text)
        assert (recipe_head, recipe_tail) == (head, tail), (
            f"{path.name}'s shared part differs from llama_sft.py's: `python -m fsdp_recipes.new_recipe --sync` "
            "copies llama_sft.py's into every recipe")
        assert "MODEL_TYPES = " in own and len(text.splitlines()) <= 150
    for config_yaml in sorted((recipes_dir / "configs").glob("*.yaml")):
        # The model from the command line: sft.yaml names none, nor does a new recipe's until its hub id is set.
        parse_config(["--config", str(config_yaml), "--model_name_or_path", "m", "--dataset_name", "d"])
    return [path.stem for path in recipes]


def test_recipes_share_every_line_but_their_own():
    """A fix to the shared part of llama_sft.py must reach every recipe (and `make new-recipe` copies it)."""
    assert {recipe for recipe, *_ in FAMILIES.values()} <= set(check_recipes_folder(REPO / "recipes"))
    for _, config_yaml, *_ in FAMILIES.values():  # each family's YAML names its default model: a real hub id
        assert "/" in yaml.safe_load((REPO / "recipes" / "configs" / f"{config_yaml}.yaml").read_text())[
            "model_name_or_path"], config_yaml


def test_a_new_recipe_and_a_helper_module_pass_the_identical_part_test(tmp_path):
    """`make new-recipe` writes a recipe that passes the test above as it is written, before its hub id is set; a
    helper module beside the recipes is no recipe, as for --sync."""
    run(["make", "new-recipe", "MODEL=olmo2", f"RECIPES_DIR={tmp_path}", f"PYTHON={sys.executable}"])
    (tmp_path / "helpers.py").write_text("STOP_WORDS = ()\n")
    assert check_recipes_folder(tmp_path) == ["olmo2_sft"]


def test_recipe_refuses_another_family_and_gemma2_with_sdpa(tmp_path, capsys):
    gemma2 = write_model(tmp_path / "gemma2", FAMILIES["gemma2"][2])
    args = ["--config", "recipes/configs/gemma2_sft.yaml", "--model_name_or_path", str(gemma2),
            "--dataset_name", "data.jsonl"]
    check_model_type(parse_config(args), {"gemma2": ("eager",)}, "gemma_sft.py")
    with pytest.raises(ConfigError, match="gemma2 models need attn_implementation eager .* got sdpa"):
        check_model_type(parse_config(args + ["--attn_implementation", "sdpa"]),
                         {"gemma2": ("eager",)}, "gemma_sft.py")
    # The generic recipe takes every model type, but not Gemma 2 with sdpa either.
    generic = ["--config", "recipes/configs/sft.yaml", "--model_name_or_path", str(gemma2), "--dataset_name", "d"]
    check_model_type(parse_config(generic + ["--attn_implementation", "eager"]), None, "recipes/sft.py")
    with pytest.raises(ConfigError, match=r"gemma2 models need attn_implementation eager or flash_attention_2 or "
                                          r"flash_attention_3 or flash_attention_4 or flex_attention \(see "
                                          r"fsdp_recipes/families.py: attention soft-capping\), got sdpa"):
        check_model_type(parse_config(generic), None, "recipes/sft.py")
    # transformers passes the cap to every flash_attention_* kernel, or raises; a Hub kernel may bypass that check.
    for attn in ("flash_attention_2", "flash_attention_3", "flash_attention_4", "flex_attention"):
        check_model_type(parse_config([*generic, "--attn_implementation", attn]), None, "recipes/sft.py")
    with pytest.raises(ConfigError, match="gemma2 models need attn_implementation eager or .* got "
                                          "kernels-community/flash-attn3$"):
        check_model_type(parse_config([*generic, "--attn_implementation", "kernels-community/flash-attn3"]), None,
                         "recipes/sft.py")
    # Whatever the model type: VaultGemma soft-caps its attention too; Gemma 3 does not.
    vaultgemma = write_model(tmp_path / "vaultgemma", VaultGemmaConfig(**TINY))
    with pytest.raises(ConfigError, match=r"vaultgemma models need attn_implementation eager or"):
        check_model_type(parse_config([*generic[:3], str(vaultgemma), *generic[4:]]), None, "recipes/sft.py")
    gemma3 = write_model(tmp_path / "gemma3", FAMILIES["gemma3"][2])
    capsys.readouterr()
    check_model_type(parse_config([*generic[:3], str(gemma3), *generic[4:]]), None, "recipes/sft.py")
    # A family with a recipe of its own: the generic recipe trains it, and says which recipe has its defaults.
    assert capsys.readouterr().out == ("note: recipes/gemma_sft.py trains gemma3_text models with its family's "
                                       "defaults (its YAML config in recipes/configs); sft.py trains it with the "
                                       "config given here\n")
    # The recipe that trains it, before the attention check: llama_sft.yaml's sdpa is no reason to use eager here.
    with pytest.raises(ConfigError, match=r"llama_sft.py trains llama models, but .* is a gemma2 model: "
                                          r"recipes/gemma_sft.py trains gemma2 models: run it \(or a copy of it\), "
                                          r"with its YAML config from recipes/configs$"):
        check_model_type(parse_config([*args, "--attn_implementation", "sdpa"]), {"llama": None},
                         "recipes/llama_sft.py")
    missing = ["--config", "recipes/configs/gemma2_sft.yaml", "--model_name_or_path", str(tmp_path / "none"),
               "--dataset_name", "data.jsonl"]
    with pytest.raises(ConfigError, match=f"model_name_or_path {tmp_path}/none: no such folder"):
        check_model_type(parse_config(missing), {"gemma2": ("eager",)}, "gemma_sft.py")
    # The recipes themselves, with their own MODEL_TYPES: each stops before loading anything.
    for recipe, recipe_args, message in [
            ("llama_sft.py", args, "llama_sft.py trains llama models, but .* is a gemma2 model"),
            ("gemma_sft.py", [*args, "--attn_implementation", "sdpa"], "gemma2 models need attn_implementation eager"),
            ("sft.py", generic, "gemma2 models need attn_implementation eager or flash_attention_2")]:
        proc = run([sys.executable, f"recipes/{recipe}", *recipe_args], expect_rc=2)
        assert re.search(f"^error: {message}", proc.stderr, re.MULTILINE), proc.stderr


def test_the_generic_recipe_names_gemma2s_recipe_before_refusing_its_sdpa(tmp_path, capsys):
    """Gemma 2 through sft.py with sft.yaml's sdpa stops on the soft-capping check: the note that names
    gemma_sft.py, whose YAML holds the eager attention it needs, comes first, not only for a model that passes."""
    gemma2 = write_model(tmp_path / "gemma2", FAMILIES["gemma2"][2])
    generic = ["--config", "recipes/configs/sft.yaml", "--model_name_or_path", str(gemma2), "--dataset_name", "d"]
    capsys.readouterr()
    with pytest.raises(ConfigError, match="^gemma2 models need attn_implementation eager or "):
        check_model_type(parse_config(generic), None, "recipes/sft.py")
    assert capsys.readouterr().out == ("note: recipes/gemma_sft.py trains gemma2 models with its family's defaults "
                                       "(its YAML config in recipes/configs); sft.py trains it with the config given "
                                       "here\n")


def test_the_generic_recipes_note_comes_from_rank_0_alone_and_not_from_a_familys_recipe(tmp_path, capsys,
                                                                                      monkeypatch):
    """The note that names the family's recipe is the generic recipe's, said once: every rank checks the model before
    the process group, and a family's recipe naming itself would be noise."""
    gemma3 = write_model(tmp_path / "gemma3", FAMILIES["gemma3"][2])
    args = ["--model_name_or_path", str(gemma3), "--dataset_name", "d"]
    capsys.readouterr()
    monkeypatch.setenv("RANK", "1")
    check_model_type(parse_config(args), None, "recipes/sft.py")
    monkeypatch.setenv("RANK", "0")
    check_model_type(parse_config(args), {"gemma2": ("eager",), "gemma3_text": None}, "recipes/gemma_sft.py")
    assert capsys.readouterr().out == ""
    check_model_type(parse_config(args), None, "recipes/sft.py")
    assert capsys.readouterr().out.startswith("note: recipes/gemma_sft.py trains gemma3_text models")


def test_a_multimodal_models_text_attention_soft_capping_needs_an_attention_that_applies_it(tmp_path):
    """exact_attention reads the text config: a Gemma 3 image-text checkpoint's soft-capping is in its text_config,
    which sdpa would skip."""
    AutoConfig.for_model("gemma3", text_config={"attn_logit_softcapping": 50.0}).save_pretrained(tmp_path / "gemma3")
    args = ["--model_name_or_path", str(tmp_path / "gemma3"), "--dataset_name", "d"]
    with pytest.raises(ConfigError, match=r"^gemma3 models need attn_implementation eager or flash_attention_2 or "
                                          r"flash_attention_3 or flash_attention_4 or flex_attention \(see "
                                          r"fsdp_recipes/families.py: attention soft-capping\), got sdpa$"):
        check_model_type(parse_config(args), None, "recipes/sft.py")
    check_model_type(parse_config([*args, "--attn_implementation", "eager"]), None, "recipes/sft.py")


def test_a_recipes_attention_implementations_are_a_tuple(tmp_path):
    # As the README writes them: ("eager",). A bare "eager" would allow "e" and refuse sdpa as "e or a or g or ...".
    llama = write_model(tmp_path / "llama", FAMILIES["llama"][2])
    cfg = parse_config(["--model_name_or_path", str(llama), "--dataset_name", "d", "--attn_implementation", "eager"])
    check_model_type(cfg, {"llama": ("eager", "flash_attention_2")}, "recipes/olmo2_sft.py")
    # The recipe's own narrowing is checked too, for a model that needs no particular attention.
    sdpa = parse_config(["--model_name_or_path", str(llama), "--dataset_name", "d"])
    with pytest.raises(ConfigError, match=r"^llama models need attn_implementation eager or flash_attention_2 \(see "
                                          r"olmo2_sft.py\), got sdpa$"):
        check_model_type(sdpa, {"llama": ("eager", "flash_attention_2")}, "recipes/olmo2_sft.py")
    with pytest.raises(TypeError) as error:
        check_model_type(cfg, {"llama": "eager"}, "recipes/olmo2_sft.py")
    assert str(error.value) == ("olmo2_sft.py: MODEL_TYPES['llama'] must be None or a tuple of attention "
                                "implementations, such as (\"eager\",), got 'eager'")


def test_an_attention_implementation_the_model_class_lacks_is_refused_before_loading(tmp_path):
    """BLOOM has no sdpa, the default: from_pretrained raised it after the data were tokenized, as a traceback on each
    rank with advice for Python code (`attn_implementation="eager"`)."""
    def check(model_type, *args):
        AutoConfig.for_model(model_type).save_pretrained(tmp_path / model_type)
        check_model_type(parse_config(["--model_name_or_path", str(tmp_path / model_type), "--dataset_name", "d",
                                       *args]), None, "recipes/sft.py")

    with pytest.raises(ConfigError, match="^BloomForCausalLM does not implement attn_implementation sdpa: set "
                                          r"attn_implementation to one it does \(eager\), e.g. --attn_implementation "
                                          "eager$"):
        check("bloom")
    check("bloom", "--attn_implementation", "eager")
    with pytest.raises(ConfigError, match=r"^GptOssForCausalLM does not implement attn_implementation sdpa: .* "
                                          r"\(eager, flash_attention_2, flash_attention_3, flash_attention_4, "
                                          r"flex_attention\)"):
        check("gpt_oss")
    check("gpt_oss", "--attn_implementation", "flex_attention")


def test_recipe_points_to_the_recipe_of_the_models_family_and_refuses_a_part_model(tmp_path, monkeypatch):
    def check(model_dir, recipe, model_types):
        args = ["--model_name_or_path", str(model_dir), "--dataset_name", "d"]
        check_model_type(parse_config(args), model_types, str(REPO / "recipes" / recipe))

    qwen2 = write_model(tmp_path / "qwen2", FAMILIES["qwen2"][2])
    with pytest.raises(ConfigError, match=f"but {qwen2} is a qwen2 model: {REPO}/recipes/qwen2_sft.py trains qwen2 "
                                          f"models: run it \\(or a copy of it\\), with its YAML config from "
                                          f"{REPO}/recipes/configs$"):
        check(qwen2, "llama_sft.py", {"llama": None})
    # Gemma 3's text model: gemma_sft.py lists it, under another name.
    gemma3 = write_model(tmp_path / "gemma3", FAMILIES["gemma3"][2])
    with pytest.raises(ConfigError, match=f"is a gemma3_text model: {REPO}/recipes/gemma_sft.py trains gemma3_text "
                                          "models: run it"):
        check(gemma3, "llama_sft.py", {"llama": None})
    # Gemma 1: the file named after it is the recipe of Gemma 2 and 3, so `make new-recipe MODEL=gemma` would fail.
    AutoConfig.for_model("gemma", **TINY).save_pretrained(tmp_path / "gemma")
    with pytest.raises(ConfigError, match=f'is a gemma model: add "gemma" to MODEL_TYPES in {REPO}/recipes/gemma_sft.py'):
        check(tmp_path / "gemma", "gemma_sft.py", {"gemma2": None, "gemma3_text": None})
    # A multimodal Gemma 3 (model_type gemma3): `make new-recipe MODEL=gemma3` would collide with Gemma 3 text's
    # gemma3_sft.yaml, so it is not offered.
    AutoConfig.for_model("gemma3").save_pretrained(tmp_path / "gemma3_image_text")
    with pytest.raises(ConfigError, match=f'is a gemma3 model: run the generic recipes/sft.py, or add "gemma3" to the '
                                          f'MODEL_TYPES of the recipe whose YAML config is {REPO}/recipes/configs/'
                                          f'gemma3_sft.yaml \\(`make new-recipe MODEL=gemma3` cannot write that '
                                          f'file: it exists\\)$'):
        check(tmp_path / "gemma3_image_text", "gemma_sft.py", {"gemma2": None, "gemma3_text": None})
    # A recipe copied into a folder of its own: the project's recipe of the family is found all the same.
    (tmp_path / "mine").mkdir()
    with pytest.raises(ConfigError, match=f"is a qwen2 model: {REPO}/recipes/qwen2_sft.py trains qwen2 models: run "
                                          f"it \\(or a copy of it\\), with its YAML config from "
                                          f"{REPO}/recipes/configs$"):
        check_model_type(parse_config(["--model_name_or_path", str(qwen2), "--dataset_name", "d"]), {"llama": None},
                         str(tmp_path / "mine" / "my_sft.py"))
    # A model type no recipe trains: the generic recipe, and how to write one beside the recipe that was run (a copy
    # outside the clone, run from its own folder: no recipes/ there, and no Makefile).
    AutoConfig.for_model("olmo2", **TINY).save_pretrained(tmp_path / "olmo2")
    with pytest.raises(ConfigError, match="is a olmo2 model: no recipe trains olmo2 models: run the generic "
                                          "recipes/sft.py, or create one with `make new-recipe MODEL=olmo2`$"):
        check(tmp_path / "olmo2", "llama_sft.py", {"llama": None})
    monkeypatch.chdir(tmp_path / "mine")
    with pytest.raises(ConfigError, match=f"is a olmo2 model: no recipe trains olmo2 models: run the generic "
                                          f"{REPO}/recipes/sft.py, or create one with `python -m "
                                          f"fsdp_recipes.new_recipe olmo2 --recipes_dir {tmp_path}/mine`$"):
        check_model_type(parse_config(["--model_name_or_path", str(tmp_path / "olmo2"), "--dataset_name", "d"]),
                         {"llama": None}, str(tmp_path / "mine" / "my_sft.py"))
    # Run as `python my_sft.py` there: its folder is ".", not an empty --recipes_dir.
    with pytest.raises(ConfigError, match="or create one with `python -m fsdp_recipes.new_recipe olmo2 --recipes_dir "
                                          r"\.`$"):
        check_model_type(parse_config(["--model_name_or_path", str(tmp_path / "olmo2"), "--dataset_name", "d"]),
                         {"llama": None}, "my_sft.py")
    # A copy of gemma_sft.py there: Gemma 1 is told of the project's generic recipe by the path that runs from there.
    shutil.copy(REPO / "recipes" / "gemma_sft.py", tmp_path / "mine")
    with pytest.raises(ConfigError, match=f'is a gemma model: add "gemma" to MODEL_TYPES in '
                                          f'{tmp_path}/mine/gemma_sft.py .* or run the generic {REPO}/recipes/sft.py$'):
        check_model_type(parse_config(["--model_name_or_path", str(tmp_path / "gemma"), "--dataset_name", "d"]),
                         {"gemma2": None, "gemma3_text": None}, str(tmp_path / "mine" / "gemma_sft.py"))
    # An installed package's own recipe (pip install): its recipes/ is no folder to write the new recipe into.
    monkeypatch.setattr(families, "INSTALLED", True)
    with pytest.raises(ConfigError, match="or create one with `python -m fsdp_recipes.new_recipe olmo2 --recipes_dir "
                                          "<your recipes folder>`$"):
        check(tmp_path / "olmo2", "llama_sft.py", {"llama": None})
    # A copy of one's own still gets its own folder.
    with pytest.raises(ConfigError, match=f"or create one with `python -m fsdp_recipes.new_recipe olmo2 --recipes_dir "
                                          f"{tmp_path}/mine`$"):
        check_model_type(parse_config(["--model_name_or_path", str(tmp_path / "olmo2"), "--dataset_name", "d"]),
                         {"llama": None}, str(tmp_path / "mine" / "my_sft.py"))
    # Llama 4 checkpoints hold a vision model too, of which AutoModelForCausalLM would load the text model alone.
    AutoConfig.for_model("llama4").save_pretrained(tmp_path / "llama4")
    with pytest.raises(ConfigError, match="is a llama4 model, of which AutoModelForCausalLM loads the "
                                          r"Llama4ForCausalLM part alone: .* \(model_type llama4_text\)"):
        check(tmp_path / "llama4", "sft.py", None)
    # An encoder-decoder: one line before anything loads, not AutoModelForCausalLM's traceback after the data.
    AutoConfig.for_model("t5", d_model=32, num_layers=1, num_heads=2, d_ff=64).save_pretrained(tmp_path / "t5")
    with pytest.raises(ConfigError, match=f"^{tmp_path}/t5 is a t5 model, which AutoModelForCausalLM does not load: "
                                          r"train a causal language model .*\(trust_remote_code\)$"):
        check(tmp_path / "t5", "sft.py", None)
    # A sharded checkpoint (as checkpoint.py writes one: config.json beside it) given as the model to train from.
    sharded = tmp_path / "checkpoint-8"
    shutil.copytree(qwen2, sharded)
    for weights in sharded.glob("*.safetensors"):
        weights.unlink()
    (sharded / "model").mkdir()
    (sharded / "trainer_state.json").write_text("{}")
    with pytest.raises(ConfigError, match=f"^model_name_or_path {sharded} is a sharded checkpoint .*: to train from "
                                          f"its weights, convert it \\(python -m fsdp_recipes.convert {sharded} "
                                          f"<out_dir>\\) and pass <out_dir>; to continue its run, pass "
                                          f"resume_from_checkpoint {sharded}$"):
        check(sharded, "sft.py", None)
    # transformers' Trainer writes its checkpoints' trainer_state.json beside save_pretrained's files: a model folder.
    (qwen2 / "trainer_state.json").write_text("{}")
    check(qwen2, "sft.py", None)
    # A folder without config.json (a run's output_dir rather than its final/): one line that names final/.
    shutil.copytree(qwen2, tmp_path / "run" / "final")
    with pytest.raises(ConfigError, match=f"^model_name_or_path {tmp_path}/run is a folder without config.json: give "
                                          f"the folder that save_pretrained wrote \\(config.json beside the weights\\), "
                                          f"such as this run's export {tmp_path}/run/final$"):
        check(tmp_path / "run", "sft.py", None)


def test_a_chat_template_that_is_not_valid_jinja_is_refused_at_load(tmp_path):
    """A chat_template.jinja cut short by a copy was found on the first chat row, as that row's fault ("row 1: the
    tokenizer's chat template refuses this conversation")."""
    def load(folder):
        return load_tokenizer(parse_config(["--model_name_or_path", str(folder), "--dataset_name", "d"]))

    TOKENIZER.save_pretrained(tmp_path / "cut")
    template = (tmp_path / "cut" / "chat_template.jinja").read_text()
    assert load(tmp_path / "cut").chat_template == template
    (tmp_path / "cut" / "chat_template.jinja").write_text(template[:len(template) // 2])
    with pytest.raises(ConfigError, match=f"^the chat template of the tokenizer in {tmp_path}/cut is not valid Jinja "
                                          r"\(its line 1: unexpected end of template, expected 'end of print "
                                          r"statement'; a file cut short in a copy ends so\): fix or restore its "
                                          r"chat_template.jinja \(or tokenizer_config.json's chat_template\)$"):
        load(tmp_path / "cut")
    (tmp_path / "cut" / "chat_template.jinja").write_text("{{ messages | no_such_filter }}")
    with pytest.raises(ConfigError, match=r"not valid Jinja \(its line 1: No filter named 'no_such_filter'\): fix"):
        load(tmp_path / "cut")
    # A valid template that refuses a conversation of one user message (it wants a system message first) loads.
    TOKENIZER.save_pretrained(tmp_path / "strict")
    (tmp_path / "strict" / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message first') }}{% endif %}" + template)
    assert "raise_exception" in load(tmp_path / "strict").chat_template


def test_a_model_folder_without_its_tokenizer_is_refused_with_what_to_do(tmp_path):
    def load(model_dir, tokenizer=None):
        return load_tokenizer(parse_config(["--model_name_or_path", str(model_dir), "--dataset_name", "d"]
                                           + (["--tokenizer_name_or_path", str(tokenizer)] if tokenizer else [])))

    save = r"save the model's tokenizer in .* \(tokenizer.save_pretrained\), or set tokenizer_name_or_path"
    # Qwen's and Gemma's tokenizer classes load from a folder without their files, with special tokens alone.
    for model_type in ("qwen2", "gemma2"):
        AutoConfig.for_model(model_type).save_pretrained(tmp_path / model_type)
        with pytest.raises(ConfigError, match=f"^the tokenizer loaded from {tmp_path}/{model_type} has no vocabulary "
                                              rf"\(its \d+ tokens are all special\): the folder lacks its files .*; "
                                              rf"{save} to the base model's$"):
            load(tmp_path / model_type)
    # tokenizer_config.json copied without the vocabulary: Qwen 2.5's tool-call tokens are added, not special.
    AutoConfig.for_model("qwen2").save_pretrained(tmp_path / "qwen2_config")
    token = {"lstrip": False, "rstrip": False, "normalized": False, "single_word": False}
    (tmp_path / "qwen2_config" / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|endoftext|>", "added_tokens_decoder": {
            "151643": {"content": "<|endoftext|>", "special": True, **token},
            "151657": {"content": "<tool_call>", "special": False, **token}}}))
    with pytest.raises(ConfigError, match=rf"^the tokenizer loaded from {tmp_path}/qwen2_config has no vocabulary "):
        load(tmp_path / "qwen2_config")
    AutoConfig.for_model("mistral").save_pretrained(tmp_path / "mistral")  # its class cannot load without files
    with pytest.raises(ConfigError, match=f"^cannot load a tokenizer from {tmp_path}/mistral: .*; {save}"):
        load(tmp_path / "mistral")
    with pytest.raises(ConfigError, match=f"^tokenizer_name_or_path {tmp_path}/none: no such folder$"):
        load(tmp_path / "qwen2", tmp_path / "none")
    TOKENIZER.save_pretrained(tmp_path / "tokenizer")
    assert len(load(tmp_path / "qwen2", tmp_path / "tokenizer")) == len(TOKENIZER)
    # A complete tokenizer of another alphabet (DNA) maps English to unknown tokens, and is no less a tokenizer.
    dna = Tokenizer(models.WordLevel({"[UNK]": 0, "A": 1, "C": 2, "G": 3, "T": 4}, unk_token="[UNK]"))
    dna.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=dna, unk_token="[UNK]", pad_token="[UNK]").save_pretrained(tmp_path / "dna")
    assert load(tmp_path / "qwen2", tmp_path / "dna")("ACGT")["input_ids"] == [1, 2, 3, 4]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)


class OtherBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)


class CustomModel(nn.Module):
    def __init__(self, num_hidden_layers: int):
        super().__init__()
        self.config = type("Config", (), {"num_hidden_layers": num_hidden_layers})()
        self.blocks = nn.ModuleList(Block() for _ in range(3))


def test_decoder_layers_found_without_no_split_modules(capsys):
    assert find_layer_classes(CustomModel(num_hidden_layers=3), None) == (Block,)
    assert "wrapping its decoder layers, blocks: 3 x Block" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="no single nn.ModuleList of config.num_hidden_layers=2 .* set "
                                          "fsdp_transformer_layer_cls_to_wrap to its decoder layer class, e.g. "
                                          "one of: Block"):
        find_layer_classes(CustomModel(num_hidden_layers=2), None)
    assert find_layer_classes(CustomModel(num_hidden_layers=2), ["Block"]) == (Block,)
    # Layers of two classes: wrapping the first one's would leave the others whole on every rank, in the root.
    mixed = CustomModel(num_hidden_layers=3)
    mixed.blocks[1] = OtherBlock()
    with pytest.raises(ConfigError, match="no single nn.ModuleList of config.num_hidden_layers=3 modules of one class.* "
                                          "e.g. one of: Block, OtherBlock$"):
        find_layer_classes(mixed, None)
    # _no_split_modules naming none of the model's classes is as good as none, and the line says so.
    misdeclared = CustomModel(num_hidden_layers=3)
    misdeclared._no_split_modules = ["DecoderLayer"]
    assert find_layer_classes(misdeclared, None) == (Block,)
    assert "wrapping: CustomModel declares no _no_split_modules it holds; wrapping" in capsys.readouterr().out


def test_a_model_of_no_decoder_layers_is_refused_as_such():
    # It said "declares no _no_split_modules" (Llama declares its layer) and offered Embedding or Linear to wrap.
    config = demo.tiny_llama_config(demo.build_tokenizer(), hidden_size=32, intermediate_size=64, num_hidden_layers=0)
    with pytest.raises(ConfigError, match="^LlamaForCausalLM's config sets num_hidden_layers 0: the model has no "
                                          "decoder layers to train or shard; check its config.json$"):
        find_layer_classes(demo.LlamaForCausalLM(config), None)


def test_a_family_without_recipe_runs_through_the_generic_path_and_make_new_recipe(data, tmp_path):
    """BioGPT: no recipe and no _no_split_modules. The generic recipe finds its decoder layers, trains and exports
    it; `make new-recipe` writes a recipe of its own with the shared part."""
    run(["make", "new-recipe", "MODEL=biogpt", f"RECIPES_DIR={tmp_path / 'recipes'}", f"PYTHON={sys.executable}"])
    recipe = tmp_path / "recipes" / "biogpt_sft.py"
    shared = split_recipe(recipe.read_text())[1::2]  # (head, tail)
    assert shared == split_recipe((REPO / "recipes" / "llama_sft.py").read_text())[1::2]
    run(["make", "new-recipe", "MODEL=biogpt", f"RECIPES_DIR={tmp_path / 'recipes'}", f"PYTHON={sys.executable}"],
        expect_rc=2)
    config = BioGptConfig(**{k: v for k, v in TINY.items() if k not in ("num_key_value_heads", "head_dim")})
    model_dir = write_model(tmp_path / "model", config)
    generated = parse_config(["--config", str(tmp_path / "recipes" / "configs" / "biogpt_sft.yaml"),
                              "--model_name_or_path", str(model_dir), "--dataset_name", str(data)])
    check_model_type(generated, {"biogpt": None}, str(recipe))
    assert "MODEL_TYPES = {\"biogpt\": None}" in split_recipe(recipe.read_text())[2]
    # Its docstring's command names the files where they are (relative to the repository's root inside it, as the
    # tests' temporary folders are under `make test`).
    shown = lambda path: os.path.relpath(path, REPO) if str(path).startswith(f"{REPO}{os.sep}") else str(path)
    config_yaml = tmp_path / "recipes" / "configs" / "biogpt_sft.yaml"
    assert (f"accelerate_configs/fsdp2.yaml {shown(recipe)} \\\n        --config {shown(config_yaml)} "
            in split_recipe(recipe.read_text())[0])
    # A model type with a hyphen, as config.json spells it; the file names take an underscore.
    run(["make", "new-recipe", "MODEL=modernbert-decoder", f"RECIPES_DIR={tmp_path / 'recipes'}",
         f"PYTHON={sys.executable}"])
    hyphenated = tmp_path / "recipes" / "modernbert_decoder_sft.py"
    assert "MODEL_TYPES = {\"modernbert-decoder\": None}" in split_recipe(hyphenated.read_text())[2]
    assert split_recipe(hyphenated.read_text())[1::2] == shared
    assert ("output_dir: outputs/modernbert_decoder_sft\n" in
            (tmp_path / "recipes" / "configs" / "modernbert_decoder_sft.yaml").read_text())
    # The README's own command, into the same folder.
    [command] = [c for c in readme_commands() if c.startswith("make new-recipe ")]
    run([*shlex.split(command), f"RECIPES_DIR={tmp_path / 'recipes'}", f"PYTHON={sys.executable}"])
    assert "MODEL_TYPES = {\"olmo2\": None}" in (tmp_path / "recipes" / "olmo2_sft.py").read_text()
    assert (tmp_path / "recipes" / "configs" / "olmo2_sft.yaml").is_file()
    # BioGPT's attention does not read example boundaries from position_ids: packing is refused before training.
    packed = run([sys.executable, "recipes/sft.py", "--config", "recipes/configs/sft.yaml", "--model_name_or_path",
                  model_dir, "--dataset_name", data, "--packing", "true", "--max_seq_length", "64", "--max_steps", "1",
                  "--output_dir", tmp_path / "packed"], expect_rc=2)
    assert "error: packing: in this biogpt model a packed example sees the example before it" in packed.stderr
    result = train_and_check_export(REPO / "recipes" / "sft.py", "recipes/configs/sft.yaml", model_dir, data, tmp_path)
    assert ("wrapping: BioGptForCausalLM declares no _no_split_modules; wrapping its decoder layers, "
            "biogpt.layers: 2 x BioGptDecoderLayer") in result["stdout"]
    assert "wrapped: 2 x BioGptDecoderLayer, then the root" in result["stdout"]


def test_a_multimodal_gemma3_trains_with_activation_checkpointing_and_exports_with_its_cache_on(data, tmp_path):
    """Gemma 3 4B-27B load whole (vision tower and language model): the language model reads use_cache from its own
    text_config, whose KV cache a checkpointed layer recomputed in backward would append to a second time."""
    text = Gemma3TextConfig(**{**TINY, "vocab_size": len(TOKENIZER) + 4}, sliding_window=WINDOW)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=len(TOKENIZER) + 1, boi_token_index=len(TOKENIZER) + 2,
                          eoi_token_index=len(TOKENIZER) + 3)
    model_dir = write_model(tmp_path / "model", config)
    run([sys.executable, "recipes/sft.py", "--config", "recipes/configs/sft.yaml", "--model_name_or_path", model_dir,
         "--dataset_name", data, "--output_dir", tmp_path / "run", "--max_steps", "2", "--save_steps", "2",
         "--per_device_train_batch_size", "2", "--max_seq_length", "64", "--fsdp_activation_checkpointing", "true",
         "--save_state_dict_type", "sharded"])
    run([sys.executable, "-m", "fsdp_recipes.convert", tmp_path / "run" / "checkpoint-2", tmp_path / "converted"])
    for folder in (tmp_path / "run" / "final", tmp_path / "converted"):
        saved = json.loads((folder / "config.json").read_text())
        assert (saved["use_cache"], saved["text_config"]["use_cache"]) == (True, True)  # for generation
        assert type(AutoModelForCausalLM.from_pretrained(folder)).__name__ == "Gemma3ForConditionalGeneration"


def test_fsdp1_rank0_loading_keeps_the_checkpoints_buffers(data, tmp_path):
    """Gemma 4 through the generic recipe: its _no_split_modules also names vision and audio layers, which a
    text-only model lacks; its layer_scalar is a persistent buffer, which FSDP1's rank-0 loading must broadcast."""
    config = Gemma4TextConfig(**TINY, sliding_window=WINDOW, global_head_dim=16, hidden_size_per_layer_input=8,
                              vocab_size_per_layer_input=len(TOKENIZER))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for layer, value in zip(model.model.layers, (0.5, 1.5)):
        layer.layer_scalar.fill_(value)
    model.save_pretrained(tmp_path / "model")
    TOKENIZER.save_pretrained(tmp_path / "model")
    proc = torchrun("tests/drivers/recipe_check.py", "recipes/sft.py", tmp_path, "--model_name_or_path",
                    tmp_path / "model", "--dataset_name", data, "--output_dir", tmp_path / "run", "--max_steps", "2",
                    "--per_device_train_batch_size", "4", "--max_seq_length", "64", "--mixed_precision", "no",
                    "--save_dtype", "float32", "--fsdp_version", "1", "--fsdp_cpu_ram_efficient_loading", "true",
                    "--eval_fraction", "0.25")
    assert "wrapped: 2 x Gemma4TextDecoderLayer, then the root" in proc.stdout
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    assert [layer.layer_scalar.item() for layer in exported.model.layers] == [0.5, 1.5]  # not the initial 1.0
    for rank in (0, 1):  # rank 1 trained with them too (the export reads rank 0's alone)
        buffers = json.loads((tmp_path / f"buffers_rank{rank}.json").read_text())
        assert [buffers[f"model.layers.{i}.layer_scalar"] for i in (0, 1)] == [0.5, 1.5]
    # The run's last forward was the final evaluation, whose views of the flat parameters FSDP1 keeps: the training
    # model must still be freed before sample generation.
    assert "eval/loss" in read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    assert json.loads((tmp_path / "at_generation.json").read_text()) == {"live_fsdp_objects": 0}


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_packed_sequences_keep_the_sliding_window(family):
    """Two packed examples (position_ids restarting at 0, no attention_mask, as the trainer passes them): the
    logits equal those of each example alone, so the mask is both block-diagonal and sliding."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[family][2], dtype=torch.float32).eval()
    model.config.use_cache = False  # as load_model does: with a cache, transformers ignores position_ids for masks
    first, second = (torch.randint(5, TINY["vocab_size"], (1, n), generator=torch.Generator().manual_seed(n))
                     for n in (20, 24))
    packed = torch.cat([first, second], dim=1)
    position_ids = torch.cat([torch.arange(20), torch.arange(24)])[None]
    with torch.no_grad():
        logits = model(input_ids=packed, position_ids=position_ids).logits
        alone = torch.cat([model(input_ids=first).logits, model(input_ids=second).logits], dim=1)
    torch.testing.assert_close(logits, alone, rtol=1e-5, atol=1e-5)


def test_router_loss_keys_are_refused_for_a_dense_model(tmp_path):
    llama = write_model(tmp_path / "llama", FAMILIES["llama"][2])
    cfg = parse_config(["--model_name_or_path", str(llama), "--dataset_name", "data.jsonl",
                        "--output_router_logits", "true"])
    with pytest.raises(ConfigError, match="output_router_logits is set, but llama models have no such setting"):
        load_model(cfg)
    # MoE models whose forward computes no router loss (Llama 4), or weighs it by another coefficient (JetMoE's
    # aux_loss_coef, which the trainer does not read): refused, not trained without the loss or failing at step 1.
    for model_type, model_class in [("llama4_text", "Llama4ForCausalLM"), ("jetmoe", "JetMoeForCausalLM")]:
        AutoConfig.for_model(model_type).save_pretrained(tmp_path / model_type)
        for keys in (["--output_router_logits", "true"], ["--router_aux_loss_coef", "0.01"]):
            with pytest.raises(ConfigError, match=f"^{keys[0][2:]} is set, but {model_class} does not compute the "
                                                  "router load-balancing loss that the trainer weighs .* Remove it"):
                load_model(parse_config(["--model_name_or_path", str(tmp_path / model_type), "--dataset_name", "d",
                                         *keys]))
        off = parse_config(["--model_name_or_path", str(tmp_path / model_type), "--dataset_name", "d",
                            "--output_router_logits", "false"])
        assert model_config_overrides(off)[0] == {"output_router_logits": False}  # off: nothing to weigh
    # The checkpoint's own model code (auto_map) over a native config class: what it computes is not known here.
    config = json.loads((tmp_path / "llama4_text" / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_own.OwnForCausalLM"}
    (tmp_path / "llama4_text" / "config.json").write_text(json.dumps(config))
    own = parse_config(["--model_name_or_path", str(tmp_path / "llama4_text"), "--dataset_name", "d",
                        "--output_router_logits", "true", "--trust_remote_code", "true"])
    assert model_config_overrides(own)[0] == {"output_router_logits": True}


def test_router_loss_keys_a_model_cannot_take_are_refused_before_the_data_are_tokenized(tmp_path):
    # With the model's family and attention, from config.json alone: not at the model load, after the data.
    llama = write_model(tmp_path / "llama", FAMILIES["llama"][2])
    cfg = parse_config(["--model_name_or_path", str(llama), "--dataset_name", "d", "--output_router_logits", "true"])
    with pytest.raises(ConfigError, match="^output_router_logits is set, but llama models have no such setting"):
        check_model_type(cfg, None, "recipes/sft.py")


def test_router_loss_coefficient_without_router_logits_is_refused(tmp_path):
    moe = write_model(tmp_path / "moe", FAMILIES["qwen3_moe"][2])  # output_router_logits: false, as on the Hub
    args = ["--model_name_or_path", str(moe), "--dataset_name", "data.jsonl", "--router_aux_loss_coef", "0.01"]
    with pytest.raises(ConfigError, match="router_aux_loss_coef is set, but the model's config.json has "
                                          "output_router_logits false.*add --output_router_logits true"):
        load_model(parse_config(args))
    assert load_model(parse_config([*args, "--output_router_logits", "true"])).config.router_aux_loss_coef == 0.01
    # Turned off on purpose (e.g. over qwen3_moe_sft.yaml, which sets both): no router loss, no error.
    assert not load_model(parse_config([*args, "--output_router_logits", "false"])).config.output_router_logits
    # A config.json that turns the router logits on: the coefficient alone weighs them, no error.
    config = json.loads((moe / "config.json").read_text())
    (moe / "config.json").write_text(json.dumps({**config, "output_router_logits": True}))
    assert model_config_overrides(parse_config(args))[0] == {"router_aux_loss_coef": 0.01}


def test_sync_copies_the_shared_part_into_every_recipe(tmp_path):
    gemma = (REPO / "recipes" / "gemma_sft.py").read_text()
    outdated = gemma.replace("    plan = resolve_plan(cfg)\n", "")
    (tmp_path / "gemma_sft.py").write_text(outdated)
    (tmp_path / "llama_sft.py").symlink_to(REPO / "recipes" / "llama_sft.py")  # the reference is not rewritten
    (tmp_path / "helpers.py").write_text("STOP_WORDS = ()\n")  # a module the recipes import: not a recipe
    proc = run([sys.executable, "-m", "fsdp_recipes.new_recipe", "--sync", "--recipes_dir", tmp_path])
    # What it replaced is printed, as a diff: here the line the outdated copy lacks (an edit would show as well).
    lines = gemma.splitlines()
    at = lines.index("    plan = resolve_plan(cfg)")
    assert proc.stdout.splitlines() == [
        f'skipped {tmp_path}/helpers.py: not a recipe (no line starts with "{OWN_START}" or "{OWN_END}")',
        f"--- {tmp_path}/gemma_sft.py", f"+++ {tmp_path}/gemma_sft.py (synced)", f"@@ -{at - 2},6 +{at - 2},7 @@",
        *(f" {line}" for line in lines[at - 3:at]), f"+{lines[at]}", *(f" {line}" for line in lines[at + 1:at + 4]),
        f"wrote {tmp_path}/gemma_sft.py"]
    assert (tmp_path / "gemma_sft.py").read_text() == gemma
    assert sync_recipes(str(tmp_path)) == ({}, [str(tmp_path / "helpers.py")])
    # A file that fails the check stops the sync before any recipe is rewritten, whatever their order.
    (tmp_path / "gemma_sft.py").write_text(outdated)
    (tmp_path / "phi3_sft.py").write_text("".join(split_recipe(gemma)[1:]))  # markers, but no docstring
    with pytest.raises(SystemExit, match=f"error: {tmp_path}/phi3_sft.py holds a recipe's markers but does not "
                                         "start with its docstring, as every recipe does: add it; no recipe was "
                                         "rewritten"):
        sync_recipes(str(tmp_path))
    assert (tmp_path / "gemma_sft.py").read_text() == outdated
    # A recipe that lost one marker line is refused as such, not skipped as a helper with its stale shared part.
    (tmp_path / "phi3_sft.py").write_text(outdated.replace(OWN_END, "# ---- Shared part"))
    with pytest.raises(SystemExit) as error:
        sync_recipes(str(tmp_path))
    assert str(error.value) == (f'error: {tmp_path}/phi3_sft.py has 0 lines that start with "{OWN_END}" after its '
                                f'docstring, where a recipe has one (see llama_sft.py): add it; no recipe was rewritten')
    assert (tmp_path / "gemma_sft.py").read_text() == outdated


def test_a_recipe_copied_before_the_checkpoint_split_is_told_where_its_imports_went_and_sync_updates_it(tmp_path):
    llama = (REPO / "recipes" / "llama_sft.py").read_text()
    old = llama.replace("from fsdp_recipes.output_dir import prepare_output_dir, remove_earlier_run\n", "").replace(
        "from fsdp_recipes.resume import resolve_resume\n", "").replace(
        "from fsdp_recipes.model import", "from fsdp_recipes.checkpoint import prepare_output_dir, remove_earlier_run, "
        "resolve_resume\nfrom fsdp_recipes.model import")
    (tmp_path / "my_sft.py").write_text(old)
    failed = run([sys.executable, tmp_path / "my_sft.py", "--help"], expect_rc=1)
    assert failed.stderr.splitlines()[-1] == (
        "ImportError: prepare_output_dir is in fsdp_recipes.output_dir, no longer in fsdp_recipes.checkpoint: a recipe "
        "copied before 2026-12-06 imports it from there; `python -m fsdp_recipes.new_recipe --sync --recipes_dir "
        "<the recipe's folder>` updates its shared part")
    run([sys.executable, "-m", "fsdp_recipes.new_recipe", "--sync", "--recipes_dir", tmp_path])
    assert (tmp_path / "my_sft.py").read_text() == llama
    assert "--resume_from_checkpoint" in run([sys.executable, tmp_path / "my_sft.py", "--help"]).stdout


def test_sync_of_a_folder_without_recipes_says_so_and_of_recipes_in_sync_says_that(tmp_path):
    """A mistyped --recipes_dir (a missing folder, the recipes' configs/) synced nothing and printed nothing, exit 0,
    as a folder whose recipes were already in sync did: each now says which it is."""
    sync = [sys.executable, "-m", "fsdp_recipes.new_recipe", "--sync", "--recipes_dir"]
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "gemma2_sft.yaml").write_text("seed: 1\n")
    (tmp_path / "configs" / "helpers.py").write_text("STOP_WORDS = ()\n")
    proc = run([*sync, tmp_path / "nope"], expect_rc=1)
    assert proc.stderr == (f"error: --recipes_dir {tmp_path}/nope: no such folder ({tmp_path}/nope): give the folder "
                           f"that holds the recipes to sync\n")
    proc = run([*sync, tmp_path / "configs"], expect_rc=1)
    assert (proc.stdout, proc.stderr) == ("", f'error: {tmp_path}/configs holds no recipe to sync (a .py file with the '
                                              f'"{OWN_START}" and "{OWN_END}" markers, as llama_sft.py has): give the '
                                              f'folder of your recipes as --recipes_dir\n')
    assert (tmp_path / "configs" / "helpers.py").read_text() == "STOP_WORDS = ()\n"
    shutil.copy(REPO / "recipes" / "gemma_sft.py", tmp_path / "my_gemma.py")
    proc = run([*sync, tmp_path])
    assert proc.stdout == (f"every recipe in {tmp_path} already has the shared part of "
                           f"{REPO}/recipes/llama_sft.py\n")
    # A new recipe, unlike --sync, is written into a folder that does not exist yet: created, its configs/ too.
    proc = run([sys.executable, "-m", "fsdp_recipes.new_recipe", "olmo2", "--recipes_dir", tmp_path / "mine"])
    assert proc.stdout == f"wrote {tmp_path}/mine/olmo2_sft.py\nwrote {tmp_path}/mine/configs/olmo2_sft.yaml\n"


def test_sync_splits_a_recipe_at_its_marker_lines_after_the_docstring(tmp_path):
    """The docstring may quote a marker, follow a shebang, or use '''; a layout that cannot be split, or whose synced
    text would not parse, stops the sync before any recipe is rewritten, with what to change."""
    doc, head, own, tail = split_recipe((REPO / "recipes" / "gemma_sft.py").read_text())
    stale_tail = tail.replace("    plan = resolve_plan(cfg)\n", "")
    assert doc.count('\n"""\n') == 1 and stale_tail != tail
    quoting = doc.replace('\n"""\n', f'\n{OWN_START} opens the block below.\n"""\n')
    synced = {"quoting_sft.py": quoting + head + own + tail,
              "shebang_sft.py": "#!/usr/bin/env python\n" + doc.replace('"""', "'''") + head + own + tail}
    for name, text in synced.items():
        (tmp_path / name).write_text(text.replace(tail, stale_tail))
    assert list(sync_recipes(str(tmp_path))[0]) == [str(tmp_path / name) for name in synced]
    for name, text in synced.items():
        assert (tmp_path / name).read_text() == text
        ast.parse(text)

    end_line, rest = tail.split("\n", 1)
    stale = doc + head + own + stale_tail
    for broken, problem in [
            (doc + head + own + own + tail, f'has 2 lines that start with "{re.escape(OWN_START)}" after its '
                                            r'docstring, where a recipe has one \(see llama_sft.py\): remove the '
                                            r'others'),
            (doc + head + tail + own, f'has its "{re.escape(OWN_END)}" line before its "{re.escape(OWN_START)}" '
                                      "line: the recipe's own block lies between them, as in llama_sft.py"),
            # The shared part's end marker inside a string that the old shared part closes.
            (doc + head + own + 'NOTE = """\n' + end_line + '\n"""\n' + rest,
             r"would not be valid Python once synced \(line \d+: .*\): its own block, between the markers, must "
             r"hold whole statements, as llama_sft.py's does"),
            (doc + head + own + tail + "def broken(:\n", r"is not valid Python \(line \d+: .*\): fix it")]:
        (tmp_path / "quoting_sft.py").write_text(stale)
        (tmp_path / "shebang_sft.py").write_text(broken)
        with pytest.raises(SystemExit, match=f"^error: {tmp_path}/shebang_sft.py {problem}; no recipe was rewritten$"):
            sync_recipes(str(tmp_path))
        assert (tmp_path / "quoting_sft.py").read_text() == stale


def test_new_recipe_refuses_a_model_type_with_a_recipe_or_its_files(tmp_path):
    """A second recipe of a family would lack its YAML config's defaults (Qwen3-MoE's router loss), and a new
    recipe's files would overwrite another's: each is refused with what to do instead, and nothing is written."""
    recipes = tmp_path / "recipes"
    (recipes / "configs").mkdir(parents=True)
    shutil.copy(REPO / "recipes" / "gemma_sft.py", recipes)
    shutil.copy(REPO / "recipes" / "configs" / "gemma3_sft.yaml", recipes / "configs")

    def refusal(model_type: str) -> str:
        return run([sys.executable, "-m", "fsdp_recipes.new_recipe", model_type, "--recipes_dir", recipes],
                   expect_rc=1).stderr

    # A recipe of the folder trains it under another file name (gemma_sft.py: Gemma 3 text).
    assert refusal("gemma3_text") == (f"error: {recipes}/gemma_sft.py trains gemma3_text models: run it (or a copy "
                                      f"of it), with its YAML config from {recipes}/configs\n")
    # Only the project's recipes/ trains it: the recipe is there.
    assert refusal("qwen3_moe") == (f"error: {REPO}/recipes/qwen3_moe_sft.py trains qwen3_moe models: run it (or a "
                                    f"copy of it), with its YAML config from {REPO}/recipes/configs\n")
    # "-" for "_": a recipe for a model type that config.json never spells, beside the family's (gemma3_text_sft.py
    # under a free file name; for qwen3-moe, advice to add it to qwen3_moe_sft.py, whose file name it takes).
    for spelled, folder, recipe in [("gemma3-text", recipes, "gemma_sft.py"),
                                    ("qwen3-moe", REPO / "recipes", "qwen3_moe_sft.py")]:
        right = spelled.replace("-", "_")
        assert refusal(spelled) == (f"error: config.json spells this model type {right}, not {spelled}: "
                                    f"{folder}/{recipe} trains {right} models: run it (or a copy of it), with its "
                                    f"YAML config from {folder}/configs\n")
    # Gemma 1: the recipe of its file name is Gemma 2's and 3's.
    assert refusal("gemma") == (f'error: add "gemma" to MODEL_TYPES in {recipes}/gemma_sft.py if its YAML config\'s '
                                f'defaults suit it (`make new-recipe MODEL=gemma` cannot write that file: it exists), '
                                f'or run the generic recipes/sft.py\n')
    # A multimodal Gemma 3: the YAML config of its file name is Gemma 3 text's.
    assert refusal("gemma3") == (f'error: run the generic recipes/sft.py, or add "gemma3" to the MODEL_TYPES of the '
                                 f'recipe whose YAML config is {recipes}/configs/gemma3_sft.yaml (`make new-recipe '
                                 f'MODEL=gemma3` cannot write that file: it exists)\n')
    # The recipes' configs/ for the recipes folder: the recipe would land among the YAML, its YAML in configs/configs.
    with pytest.raises(SystemExit) as error:
        new_recipe("olmo2", str(recipes / "configs"))
    assert str(error.value) == (f"error: --recipes_dir {recipes}/configs is the YAML configs folder of the recipes in "
                                f"{recipes}: give --recipes_dir {recipes}, and the new YAML config goes into its "
                                f"configs/")
    assert sorted(p.name for p in recipes.rglob("*")) == ["configs", "gemma3_sft.yaml", "gemma_sft.py"]
    assert (recipes / "gemma_sft.py").read_text() == (REPO / "recipes" / "gemma_sft.py").read_text()
    # A recipe copied into a folder of its own, its YAML beside it: no configs/ folder that is not there is named.
    (tmp_path / "mine").mkdir()
    shutil.copy(REPO / "recipes" / "llama_sft.py", tmp_path / "mine" / "train.py")
    with pytest.raises(SystemExit) as error:
        new_recipe("llama", str(tmp_path / "mine"))
    assert str(error.value) == (f"error: {tmp_path}/mine/train.py trains llama models: run it (or a copy of it), "
                                "with its YAML config")
    # A recipe that lists config.json's hyphenated spelling, asked for with an underscore (a file being edited beside
    # it is no recipe to point to, and no reason to stop).
    (tmp_path / "mine" / "modernbert.py").write_text('MODEL_TYPES = {"modernbert-decoder": None}\n')
    (tmp_path / "mine" / "editing.py").write_text("def broken(:\n")
    with pytest.raises(SystemExit) as error:
        new_recipe("modernbert_decoder", str(tmp_path / "mine"))
    assert str(error.value) == (f"error: config.json spells this model type modernbert-decoder, not modernbert_decoder: "
                                f"{tmp_path}/mine/modernbert.py trains modernbert-decoder models: run it (or a copy of "
                                f"it), with its YAML config")
    # A folder named configs is the recipes' YAML folder only beside a recipe, not beside a helper module alone.
    (tmp_path / "work" / "configs").mkdir(parents=True)
    (tmp_path / "work" / "helpers.py").write_text("STOP_WORDS = ()\n")
    assert new_recipe("olmo2", str(tmp_path / "work" / "configs"))[0] == f"{tmp_path}/work/configs/olmo2_sft.py"


def test_new_recipe_refuses_a_model_type_that_is_no_file_name_and_both_a_model_type_and_sync(tmp_path, monkeypatch,
                                                                                                capsys):
    """A MODEL that is a path ('../olmo2') would write outside the recipes folder; a model type beside --sync would be
    left undone without a word; neither has nothing to do. Each is refused, and nothing is written."""
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    for model_type in ("../olmo2", "olmo 2", ""):
        with pytest.raises(SystemExit, match=rf"^error: MODEL must be a model_type as config.json spells it \(e.g. "
                                             rf"olmo2\), got {re.escape(repr(model_type))}$"):
            new_recipe(model_type, str(recipes))
    proc = run([sys.executable, "-m", "fsdp_recipes.new_recipe", "olmo2", "--sync", "--recipes_dir", recipes],
               expect_rc=2)
    assert proc.stderr.endswith("error: give a model_type, or --sync\n")
    monkeypatch.setattr(sys, "argv", ["new_recipe", "--recipes_dir", str(recipes)])  # neither: not a traceback
    with pytest.raises(SystemExit) as error:
        new_recipe_module.main()
    assert error.value.code == 2 and capsys.readouterr().err.endswith("error: give a model_type, or --sync\n")
    # A clone without llama_sft.py, the recipe a new one copies: one line, not a FileNotFoundError's traceback.
    monkeypatch.setattr(new_recipe_module, "REFERENCE", str(tmp_path / "llama_sft.py"))
    with pytest.raises(SystemExit) as error:
        new_recipe("olmo2", str(recipes))
    assert str(error.value) == (f"error: recipes/llama_sft.py, the recipe a new one copies, is not at {tmp_path}/"
                                f"llama_sft.py: restore it in the clone, or reinstall the package from a clone that "
                                f"has it")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["recipes"]


def test_a_new_recipe_names_its_files_from_the_repository_root_and_takes_the_generic_defaults(tmp_path, monkeypatch):
    """Its docstring's command runs from the clone's root; its YAML config holds sft.yaml's defaults, its own
    output_dir, and no hub id yet. The generic recipe is named from the clone's root there, absolutely elsewhere."""
    monkeypatch.setattr(new_recipe_module, "REPO", str(tmp_path))  # a recipes folder inside the clone
    recipe, config = new_recipe("olmo2", str(tmp_path / "recipes"))
    assert ("\n    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/olmo2_sft.py \\\n        "
            "--config recipes/configs/olmo2_sft.yaml --model_name_or_path <hub id> --dataset_name <data>\n\n"
            in split_recipe(Path(recipe).read_text())[0])
    generic = yaml.safe_load((REPO / "recipes" / "configs" / "sft.yaml").read_text())
    assert yaml.safe_load(Path(config).read_text()) == {**generic, "model_name_or_path": None,
                                                        "output_dir": "outputs/olmo2_sft"}
    monkeypatch.chdir(tmp_path)
    assert new_recipe_module.generic_recipe() == f"{REPO}/recipes/sft.py"
    monkeypatch.chdir(REPO)
    assert new_recipe_module.generic_recipe() == "recipes/sft.py"


def test_the_built_package_holds_the_recipes_and_new_recipe_runs_from_it(tmp_path):
    """pip install (no clone beside the package): the wheel holds every recipe and YAML config, and new_recipe
    writes and syncs a recipe from them, in any directory; it asks for --recipes_dir rather than write into the
    installed package."""
    source = tmp_path / "source"  # built from a copy: pip builds in the tree, writing build/ and *.egg-info there
    for name in ("fsdp_recipes", "recipes"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "requirements.txt"):
        shutil.copy(REPO / name, source)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", source,
         "-w", tmp_path / "dist"])
    [wheel] = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        held = set(archive.namelist())
        archive.extractall(tmp_path / "site-packages")
    recipes = {f"fsdp_recipes/{path.relative_to(REPO).as_posix()}"
               for pattern in ("recipes/*.py", "recipes/configs/*.yaml") for path in REPO.glob(pattern)}
    assert len(recipes) > 10 and recipes <= held
    installed = tmp_path / "site-packages" / "fsdp_recipes" / "recipes"

    def new_recipe_command(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "fsdp_recipes.new_recipe", *args], cwd=tmp_path, text=True,
                              env=subprocess_env(PYTHONPATH=str(tmp_path / "site-packages")), capture_output=True)

    proc = new_recipe_command("olmo2", "--recipes_dir", "mine")
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout == "wrote mine/olmo2_sft.py\nwrote mine/configs/olmo2_sft.yaml\n"
    _, head, own, tail = split_recipe((tmp_path / "mine" / "olmo2_sft.py").read_text())
    _, llama_head, _, llama_tail = split_recipe((REPO / "recipes" / "llama_sft.py").read_text())
    assert (head, tail) == (llama_head, llama_tail) and 'MODEL_TYPES = {"olmo2": None}' in own
    proc = new_recipe_command("--sync", "--recipes_dir", "mine")
    assert (proc.returncode, proc.stdout) == (0, f"every recipe in mine already has the shared part of "
                                                 f"{installed}/llama_sft.py\n")
    # The generic recipe a model type without one is pointed to is the installed package's.
    proc = subprocess.run([sys.executable, "-c", "from fsdp_recipes.new_recipe import generic_recipe; "
                           "print(generic_recipe())"], cwd=tmp_path, text=True, capture_output=True, check=True,
                          env=subprocess_env(PYTHONPATH=str(tmp_path / "site-packages")))
    assert proc.stdout == "site-packages/fsdp_recipes/recipes/sft.py\n"
    proc = new_recipe_command("qwen2")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.endswith(f"error: give --recipes_dir, the folder of your recipes (the installed package's own "
                                f"recipes, in {installed}, are its copies of the project's)\n")
    assert sorted(p.name for p in installed.glob("*.py")) == sorted(p.name for p in (REPO / "recipes").glob("*.py"))


def test_a_relative_path_that_is_not_there_names_the_directory_it_was_looked_for_in(tmp_path, monkeypatch):
    """A copied recipe started from another directory than its YAML's paths assume: relative paths are read from the
    working directory, and each error says which one it was (it said only 'no such file or folder')."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=f"^cannot read --config configs/my_sft.yaml: No such file or directory in "
                                          f"{tmp_path}$"):
        parse_config(["--config", "configs/my_sft.yaml"])
    with pytest.raises(ConfigError, match=f"^dataset_name data/train.jsonl: no such file or folder in {tmp_path}$"):
        load_split("data/train.jsonl", None, "train")
    cfg = parse_config(["--model_name_or_path", "./models/base", "--tokenizer_name_or_path", "./models/tok",
                        "--dataset_name", "data/train.jsonl"])
    with pytest.raises(ConfigError, match=f"^model_name_or_path ./models/base: no such folder in {tmp_path}$"):
        check_model_type(cfg, {"llama": None}, "my_sft.py")
    with pytest.raises(ConfigError, match=f"^tokenizer_name_or_path ./models/tok: no such folder in {tmp_path}$"):
        load_tokenizer(cfg)
    # Without './': more than one '/' is no Hub id (namespace/name), which the Hub client's error said it must be.
    cfg = parse_config(["--model_name_or_path", "outputs/run1/final", "--dataset_name", "data/chats/part1"])
    with pytest.raises(ConfigError, match=f"^model_name_or_path outputs/run1/final: no such folder in {tmp_path}$"):
        check_model_type(cfg, {"llama": None}, "my_sft.py")
    with pytest.raises(ConfigError, match=f"^tokenizer_name_or_path outputs/run1/final: no such folder in {tmp_path}$"):
        load_tokenizer(cfg)
    with pytest.raises(ConfigError, match=f"^dataset_name data/chats/part1: no such file or folder in {tmp_path}$"):
        load_split("data/chats/part1", None, "train")


def test_code_of_its_own_for_a_model_type_transformers_has_runs_only_with_trust_remote_code(tmp_path):
    """As Phi-3.5's config.json names modeling_phi3.py: transformers' class trains unless trust_remote_code is set."""
    model_dir = write_model(tmp_path / "model", FAMILIES["llama"][2])
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "auto_map": {
        "AutoModelForCausalLM": "modeling_own.OwnForCausalLM"}}))
    (model_dir / "modeling_own.py").write_text(
        "from transformers import LlamaForCausalLM\n\n\nclass OwnForCausalLM(LlamaForCausalLM):\n    pass\n")
    args = ["--model_name_or_path", str(model_dir), "--dataset_name", "d"]
    check_model_type(parse_config(args), {"llama": None}, "recipes/llama_sft.py")
    assert type(load_model(parse_config(args))).__name__ == "LlamaForCausalLM"
    assert type(load_model(parse_config([*args, "--trust_remote_code", "true"]))).__name__ == "OwnForCausalLM"


def test_a_model_config_that_cannot_be_read_says_what_to_change(tmp_path):
    # A model with code of its own: the recipe key, not transformers' Python keyword and Hub URL for a local folder.
    (tmp_path / "custom").mkdir()
    (tmp_path / "custom" / "config.json").write_text(json.dumps(
        {"model_type": "my_custom", "auto_map": {"AutoConfig": "configuration_my_custom.MyConfig"}}))
    args = ["--model_name_or_path", str(tmp_path / "custom"), "--dataset_name", "data.jsonl"]
    with pytest.raises(ConfigError) as error:
        check_model_type(parse_config(args), None, "recipes/sft.py")
    assert str(error.value) == (f"model_name_or_path {tmp_path}/custom ships its own model code (auto_map in its "
                                f"config.json): read it, then pass --trust_remote_code true to run it (the recipe key "
                                f"trust_remote_code: true)")
    # With trust_remote_code, a folder that lacks the code files: transformers' words give a Hub URL for the folder.
    args = ["--model_name_or_path", str(tmp_path / "custom"), "--dataset_name", "data.jsonl", "--trust_remote_code",
            "true"]
    with pytest.raises(ConfigError) as error:
        check_model_type(parse_config(args), None, "recipes/sft.py")
    assert str(error.value) == (f"model_name_or_path {tmp_path}/custom: its config.json runs model code from "
                                f"configuration_my_custom.py (auto_map), which the folder lacks: copy the model's .py "
                                f"files beside its config.json")
    # The configuration code there, the model code not: found at the model load, said the same way.
    (tmp_path / "custom" / "configuration_my_custom.py").write_text(
        "from transformers import PretrainedConfig\n\n\nclass MyConfig(PretrainedConfig):\n    model_type = 'my_custom'\n")
    (tmp_path / "custom" / "config.json").write_text(json.dumps(
        {"model_type": "my_custom", "auto_map": {"AutoConfig": "configuration_my_custom.MyConfig",
                                                 "AutoModelForCausalLM": "modeling_my_custom.MyForCausalLM"}}))
    check_model_type(parse_config(args), None, "recipes/sft.py")
    for rank0_loads in ("false", "true"):
        with pytest.raises(ConfigError) as error:
            run_cfg = parse_config([*args, "--fsdp_cpu_ram_efficient_loading", rank0_loads])
            load_sharded_model(run_cfg, resolve_plan(run_cfg), torch.device("cpu"))
        assert str(error.value) == (f"model_name_or_path {tmp_path}/custom: its config.json runs model code from "
                                    f"modeling_my_custom.py (auto_map), which the folder lacks: copy the model's .py "
                                    f"files beside its config.json")
    # A folder without config.json: transformers' words are about a model_type key in it.
    (tmp_path / "weights_only").mkdir()
    with pytest.raises(ConfigError) as error:
        check_model_type(parse_config(["--model_name_or_path", str(tmp_path / "weights_only"), "--dataset_name",
                                       "data.jsonl"]), None, "recipes/sft.py")
    assert str(error.value) == (f"model_name_or_path {tmp_path}/weights_only is a folder without config.json: give "
                                f"the folder that save_pretrained wrote (config.json beside the weights)")
    # A mistyped local folder on an offline node reads as a Hub id: the error says both, not "check your connection".
    proc = run([sys.executable, "recipes/llama_sft.py", "--model_name_or_path", "demo/base_modle", "--dataset_name",
                "data.jsonl", "--output_dir", tmp_path / "out"], expect_rc=2, HF_HUB_OFFLINE="1")
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: model_name_or_path demo/base_modle: no such folder in {REPO}, nor in the Hugging Face cache "
        f"{huggingface_hub.constants.HF_HUB_CACHE}, and the Hub cannot be reached (HF_HUB_OFFLINE is set) to download "
        f"it: download it into that cache where the Hub can be reached (hf download demo/base_modle, with the same "
        f"HF_HOME or HF_HUB_CACHE), or set HF_HOME (or HF_HUB_CACHE) to the cache that holds it")
