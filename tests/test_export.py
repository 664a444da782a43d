"""The exported Hugging Face folder holds exactly the trained weights: logits are bit-equal after a reload."""

import errno
import json
import os
import re
import shutil
import sys

import pytest
import torch
import safetensors.torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, Gemma3Config,
                          Gemma3ForConditionalGeneration, GPTNeoXConfig, get_scheduler)

from fsdp_recipes import convert as convert_module, demo
from fsdp_recipes.checkpoint import save_checkpoint
from fsdp_recipes.config import ConfigError, parse_config
from fsdp_recipes.convert import convert, set_config_dtype_in_json
from fsdp_recipes.export import (WriteError, save_hf_model, space_left, write_failure, write_hf_weights,
                                 write_model_files)
from fsdp_recipes.model import export_dtype, load_sharded_model, load_tokenizer
from fsdp_recipes.plan import resolve_plan
from fsdp_recipes.sharding import kept_in_fp32
from fsdp_recipes.trainer import build_optimizer

from conftest import file_size_limit, read_metrics, run, torchrun


@pytest.mark.parametrize("model_key, fsdp_version", [("model", 2), ("tied_model", 2), ("tied_model", 1)])
def test_export_reloads_with_logits_equal_to_gathered_weights(tiny, tmp_path, model_key, fsdp_version):
    torchrun("tests/drivers/export_check.py", tmp_path, "--model_name_or_path", tiny[model_key],
             "--fsdp_version", str(fsdp_version),
             "--dataset_name", tiny["data"], "--output_dir", tmp_path / "run", "--max_steps", "3",
             "--per_device_train_batch_size", "4", "--learning_rate", "1e-2")
    gathered = torch.load(tmp_path / "gathered.pt", weights_only=True)
    config = AutoConfig.from_pretrained(tiny[model_key])
    inputs = torch.randint(5, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))

    for dtype, folder in [(torch.bfloat16, "final_bf16"), (torch.float32, "final_fp32")]:
        path = tmp_path / folder
        for name in ["config.json", "model.safetensors", "tokenizer.json", "generation_config.json"]:
            assert (path / name).is_file(), f"{folder} lacks {name}"
        assert json.loads((path / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            stored = set(f.keys())
            assert {f.get_tensor(k).dtype for k in stored} == {dtype}
        reloaded = AutoModelForCausalLM.from_pretrained(path).eval()
        assert next(reloaded.parameters()).dtype == dtype

        reference = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        missing, unexpected = reference.load_state_dict({k: v.to(dtype) for k, v in gathered.items()}, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}
        if config.tie_word_embeddings:
            assert "lm_head.weight" not in stored  # written once
            assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
        with torch.no_grad():
            assert torch.equal(reloaded(inputs).logits, reference(inputs).logits)
        # The weights did move away from the initial checkpoint: the check compares trained weights.
        initial = AutoModelForCausalLM.from_pretrained(tiny[model_key], dtype=dtype).eval()
        with torch.no_grad():
            assert not torch.equal(initial(inputs).logits, reference(inputs).logits)


@pytest.mark.parametrize("fsdp_version", [1, 2])
def test_rank0_loading_exports_the_hub_layout(tmp_path, fsdp_version, one_process_group):
    # GPT-NeoX's output layer is embed_out on the Hub and lm_head in transformers 5: the export renames it back,
    # also when rank 0 alone read the weights into a model built from its config.
    tokenizer = demo.build_tokenizer()
    config = GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "source")
    tokenizer.save_pretrained(tmp_path / "source")
    cfg = parse_config(["--model_name_or_path", str(tmp_path / "source"), "--dataset_name", "x", "--mixed_precision",
                        "no", "--fsdp_version", str(fsdp_version), "--fsdp_cpu_ram_efficient_loading", "true"])
    model = load_sharded_model(cfg, resolve_plan(cfg), torch.device("cpu"))
    save_hf_model(model, tokenizer, str(tmp_path / "final"), torch.float32)
    source, final = (safe_open(str(tmp_path / d / "model.safetensors"), "pt") for d in ["source", "final"])
    assert "embed_out.weight" in source.keys()
    assert set(final.keys()) == set(source.keys())
    assert all(torch.equal(final.get_tensor(k), source.get_tensor(k)) for k in source.keys())


def test_a_model_whose_hub_layout_joins_tensors_is_exported_in_its_own_layout(tmp_path, one_process_group, capsys):
    # HRM's Hub files hold gate_up_proj, which transformers splits into gate_proj and up_proj on load. Reverted one
    # tensor at a time, each half would be written as the whole gate_up_proj (one overwriting the other): the export
    # keeps the split tensors, which from_pretrained loads as they are.
    tokenizer = demo.build_tokenizer()
    config = AutoConfig.for_model("hrm_text", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                  num_attention_heads=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "source")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "source")
    capsys.readouterr()
    save_hf_model(model, tokenizer, str(tmp_path / "final"), torch.float32)
    assert capsys.readouterr().out == (
        "export: HrmTextForCausalLM's original layout joins several tensors into one: its weights are written in "
        "transformers' in-memory layout, which from_pretrained also loads\n")
    written = safetensors.torch.load_file(tmp_path / "final" / "model.safetensors")
    expected = model.state_dict()
    assert "model.L_module.layers.0.mlp.gate_proj.weight" in written and written.keys() == expected.keys()
    assert all(torch.equal(written[name], tensor) for name, tensor in expected.items())


KEEPS_FP32 = {  # models whose classes keep some weights in fp32 (_keep_in_fp32_modules_strict) in bf16
    # The router's e_score_correction_bias (and gate.weight, in transformers 5.24), named as on the Hub.
    "glm4_moe": dict(intermediate_size=64, moe_intermediate_size=16, first_k_dense_replace=1, num_key_value_heads=1,
                     head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1),
    # As GLM-4.5; transformers 5.17's from_config leaves the bias in bf16 (rank-0 loading builds the model so).
    "deepseek_v3": dict(intermediate_size=64, moe_intermediate_size=16, q_lora_rank=None, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1,
                        num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1),
    # Hyper-connections and attention sinks, which transformers renames on load (hc_attn_fn is attn_hc.fn).
    "deepseek_v4": dict(moe_intermediate_size=16, head_dim=16, q_lora_rank=16, qk_rope_head_dim=8,
                        n_routed_experts=4, num_experts_per_tok=2, o_groups=1, o_lora_rank=16, index_n_heads=2,
                        index_head_dim=16, index_topk=4, num_nextn_predict_layers=0, hc_mult=2),
}


def safetensors_dtypes(folder) -> dict[str, str]:
    dtypes = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            dtypes.update({name: f.get_slice(name).get_dtype() for name in f.keys()})
    return dtypes


@pytest.mark.parametrize("model_type", KEEPS_FP32)
def test_the_weights_kept_in_fp32_are_those_from_pretrained_keeps_in_bf16_and_in_fp16(tmp_path, model_type):
    config = AutoConfig.for_model(model_type, vocab_size=32, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, **KEEPS_FP32[model_type])
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    for dtype in (torch.bfloat16, torch.float16):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype)
        kept = kept_in_fp32(loaded, dtype)
        state = {name: t for name, t in loaded.state_dict().items() if t.is_floating_point()}
        fp32 = {name for name, t in state.items() if t.dtype == torch.float32}
        assert fp32 and {name for name in state if kept.search(name)} == fp32, dtype


@pytest.mark.parametrize("model_type", KEEPS_FP32)
def test_weights_kept_in_fp32_are_exported_and_converted_as_save_pretrained_writes_them(tmp_path, model_type,
                                                                                        one_process_group):
    # bf16 would round what the model keeps in fp32 (the expert choice's scores, for a router).
    tokenizer = demo.build_tokenizer()
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, **KEEPS_FP32[model_type])
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # 1 + 2^-12 and more: bf16 rounds every value, zero-initialised ones included
        for tensor in source.state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(1 + 2 ** -12)
    source.save_pretrained(tmp_path / "source")
    tokenizer.save_pretrained(tmp_path / "source")
    # The reference: transformers' own bf16 load, saved.
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "source", dtype=torch.bfloat16)
    reference.save_pretrained(tmp_path / "reference")
    expected = safetensors_dtypes(tmp_path / "reference")
    kept = {name for name, dtype in expected.items() if dtype == "F32"}
    assert kept and {"F32", "BF16"} <= set(expected.values())  # and DeepSeek V4's int64 tid2eid
    args = ["--model_name_or_path", str(tmp_path / "source"), "--dataset_name", "x", "--attn_implementation", "eager"]
    cfg = parse_config([*args, "--output_dir", str(tmp_path / "run"), "--mixed_precision", "no",
                        "--save_steps", "1", "--save_state_dict_type", "sharded"])
    model = load_sharded_model(cfg, resolve_plan(cfg), torch.device("cpu"))
    save_hf_model(model, tokenizer, str(tmp_path / "final"), torch.bfloat16)
    optimizer = build_optimizer(model, cfg)
    checkpoint = save_checkpoint(cfg, model, optimizer, get_scheduler("constant", optimizer), tokenizer, step=1,
                                 epoch=0, wandb_run=None)
    convert(checkpoint, str(tmp_path / "converted"), torch.bfloat16)
    with safe_open(str(tmp_path / "source" / "model.safetensors"), "pt") as f:
        fp32 = {name: f.get_tensor(name) for name in kept}
    for folder in ["final", "converted"]:
        assert safetensors_dtypes(tmp_path / folder) == expected
        with safe_open(str(tmp_path / folder / "model.safetensors"), "pt") as f:
            assert all(torch.equal(f.get_tensor(name), fp32[name]) for name in kept)
    # Pure bf16 holds every weight in bf16: it cannot train a parameter kept in fp32. A buffer kept in fp32 (the
    # router bias, in transformers 5.17) stays fp32 on either loading path.
    kept_params = [name for name, p in reference.named_parameters() if p.dtype == torch.float32]
    kept_buffers = {name: b for name, b in reference.named_buffers() if b.dtype == torch.float32}
    for rank0_loading in ["false", "true"]:
        pure = parse_config([*args, "--mixed_precision", "pure_bf16", "--fsdp_cpu_ram_efficient_loading",
                             rank0_loading])
        if kept_params:
            with pytest.raises(ConfigError, match=rf"^{kept_params[0]} is kept in fp32 by {model_type} models "
                                                  r"\(transformers' _keep_in_fp32_modules_strict\), and "
                                                  r"mixed_precision pure_bf16 holds every weight in torch.bfloat16: "
                                                  r"use mixed_precision bf16"):
                load_sharded_model(pure, resolve_plan(pure), torch.device("cpu"))
            continue
        buffers = dict(load_sharded_model(pure, resolve_plan(pure), torch.device("cpu")).named_buffers())
        assert all(torch.equal(buffers[name], value) for name, value in kept_buffers.items())


def test_a_source_in_transformers_layout_is_exported_and_converted_in_it(tmp_path, one_process_group):
    # A mixture of experts: the Hub holds per-expert matrices, transformers fuses them on load, and a full checkpoint
    # of a run (a source to fine-tune further) holds the fused ones. final/ and the converter keep the source's layout.
    tokenizer = demo.build_tokenizer()
    config = AutoConfig.for_model("qwen3_moe", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                  moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hub")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hub")
    loaded.config.architectures = ["Qwen3MoeModel"]  # a mislabelled source: the folders name the class trained
    loaded.config.save_pretrained(tmp_path / "fused")
    save_file({name: tensor.contiguous() for name, tensor in loaded.state_dict().items()},
              str(tmp_path / "fused" / "model.safetensors"))
    for source, experts in [("hub", "model.layers.0.mlp.experts.0.gate_proj.weight"),
                            ("fused", "model.layers.0.mlp.experts.gate_up_proj")]:
        tokenizer.save_pretrained(tmp_path / source)
        names = set(safetensors_dtypes(tmp_path / source))
        assert experts in names
        cfg = parse_config(["--model_name_or_path", str(tmp_path / source), "--dataset_name", "x", "--output_dir",
                            str(tmp_path / f"run_{source}"), "--mixed_precision", "no"])
        model = load_sharded_model(cfg, resolve_plan(cfg), torch.device("cpu"))
        save_hf_model(model, tokenizer, str(tmp_path / f"final_{source}"), torch.float32)
        optimizer = build_optimizer(model, cfg)
        checkpoint = save_checkpoint(cfg, model, optimizer, get_scheduler("constant", optimizer), tokenizer, step=1,
                                     epoch=0, wandb_run=None)
        convert(checkpoint, str(tmp_path / f"converted_{source}"), torch.float32)
        for folder in [f"final_{source}", f"converted_{source}"]:
            assert set(safetensors_dtypes(tmp_path / folder)) == names, folder
            config_json = json.loads((tmp_path / folder / "config.json").read_text())
            assert config_json["architectures"] == ["Qwen3MoeForCausalLM"], folder


MOE_FAMILIES = {  # fused on load by transformers 5: gate_up_proj and down_proj, one row per expert
    "qwen3_moe": dict(intermediate_size=64, moe_intermediate_size=16, num_key_value_heads=1, head_dim=16,
                      num_experts=4, num_experts_per_tok=2),
    "mixtral": dict(intermediate_size=16, num_key_value_heads=1, num_local_experts=3, num_experts_per_tok=2),
    # Dense first layer, then routed experts beside a shared one.
    "deepseek_v3": KEEPS_FP32["deepseek_v3"],
}


@pytest.mark.parametrize("model_type", MOE_FAMILIES)
def test_fused_experts_are_written_per_expert_as_the_source_holds_them(tmp_path, model_type, one_process_group):
    # The export and the converter (of either checkpoint format) split each fused expert tensor one expert at a
    # time: every per-expert matrix must land under its own expert's name, bit-equal to the source's.
    tokenizer = demo.build_tokenizer()
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, **MOE_FAMILIES[model_type])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "source")
    tokenizer.save_pretrained(tmp_path / "source")
    source = safetensors.torch.load_file(tmp_path / "source" / "model.safetensors")
    assert "model.layers.1.mlp.experts.2.down_proj.weight" in source or (
        "model.layers.1.block_sparse_moe.experts.2.w2.weight" in source)
    folders, checkpoints = ["final"], {}
    for fmt in ["sharded", "full"]:
        cfg = parse_config(["--model_name_or_path", str(tmp_path / "source"), "--dataset_name", "x", "--output_dir",
                            str(tmp_path / fmt), "--mixed_precision", "no", "--save_steps", "1",
                            "--save_state_dict_type", fmt])
        model = load_sharded_model(cfg, resolve_plan(cfg), torch.device("cpu"))
        if fmt == "sharded":
            save_hf_model(model, tokenizer, str(tmp_path / "final"), torch.float32)
        optimizer = build_optimizer(model, cfg)
        checkpoints[fmt] = save_checkpoint(cfg, model, optimizer, get_scheduler("constant", optimizer), tokenizer,
                                           step=1, epoch=0, wandb_run=None)
        convert(checkpoints[fmt], str(tmp_path / f"converted_{fmt}"), torch.float32)
        folders.append(f"converted_{fmt}")
    # A DCP layout the direct reader does not handle: each fused tensor is read whole, once, through dcp.load.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(convert_module, "read_chunk_into", lambda *args: False)
        convert(checkpoints["sharded"], str(tmp_path / "converted_dcp_load"), torch.float32)
    folders.append("converted_dcp_load")
    for folder in folders:
        written = {}
        for file in (tmp_path / folder).glob("*.safetensors"):
            written.update(safetensors.torch.load_file(file))
        assert written.keys() == source.keys(), folder
        assert all(torch.equal(written[name], tensor) for name, tensor in source.items()), folder


@pytest.mark.parametrize("rank0_loading", ["false", "true"])
def test_the_router_loss_is_on_for_training_only(tmp_path, rank0_loading, one_process_group):
    """final/ keeps config.json's router settings (off, coefficient 0.001), with which batched generate works,
    whichever rank reads the weights: rank-0 loading builds the model from its config, not through load_model."""
    tokenizer = demo.build_tokenizer()
    config = AutoConfig.for_model("qwen3_moe", vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, **MOE_FAMILIES["qwen3_moe"])
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "source")
    cfg = parse_config(["--model_name_or_path", str(tmp_path / "source"), "--dataset_name", "x", "--mixed_precision",
                        "no", "--output_router_logits", "true", "--router_aux_loss_coef", "0.02",
                        "--fsdp_cpu_ram_efficient_loading", rank0_loading])
    model = load_sharded_model(cfg, resolve_plan(cfg), torch.device("cpu"))
    assert (model.config.output_router_logits, model.config.router_aux_loss_coef) == (True, 0.02)
    save_hf_model(model, tokenizer, str(tmp_path / "final"), torch.float32)
    saved = json.loads((tmp_path / "final" / "config.json").read_text())
    assert (saved["output_router_logits"], saved["router_aux_loss_coef"]) == (False, 0.001)


def test_an_export_starts_afresh_from_what_a_killed_one_left(tmp_path, one_process_group):
    # A killed export of a larger model (or with a smaller max_shard_size) left final.tmp with an index and its
    # shards: kept beside the new model.safetensors, the index would make from_pretrained load the stale shards.
    tokenizer = demo.build_tokenizer()
    model = demo.LlamaForCausalLM(demo.tiny_llama_config(tokenizer, hidden_size=16, intermediate_size=32,
                                                         num_hidden_layers=1))
    (tmp_path / "final.tmp").mkdir()
    (tmp_path / "final.tmp" / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (tmp_path / "final.tmp" / "model-00001-of-00002.safetensors").write_text("stale")
    save_hf_model(model, tokenizer, str(tmp_path / "final"), torch.float32)
    assert sorted(p.name for p in (tmp_path / "final").glob("model*")) == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_an_export_onto_a_full_disk_says_so_and_leaves_no_unfinished_folder(tmp_path, one_process_group):
    # A failed write showed only OSError's traceback, naming neither final/ nor what to do, and left final.tmp, which
    # kept the room on a full disk.
    tokenizer = demo.build_tokenizer()
    model = demo.LlamaForCausalLM(demo.tiny_llama_config(tokenizer, hidden_size=16, intermediate_size=32,
                                                         num_hidden_layers=1))
    (tmp_path / "final").mkdir()  # an earlier export, which a failed one must leave as it is
    (tmp_path / "final" / "config.json").write_text("{}")
    with file_size_limit(4096), pytest.raises(WriteError) as error:
        save_hf_model(model, tokenizer, str(tmp_path / "final"), torch.float32)
    assert re.fullmatch(
        f"writing {tmp_path}/final failed \\(OSError: \\[Errno 27\\] File too large\\), with [0-9.,]+ MiB free on the "
        f"file system of {tmp_path} \\(its unfinished folder removed\\): make room, then run again with "
        f"--resume_from_checkpoint auto, which writes final/ from the run's last checkpoint without training again "
        f"\\(a run without --save_steps has none: it trains again\\)", str(error.value)), str(error.value)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["config.json", "final"]


def test_a_failed_write_asks_for_room_only_when_the_disk_or_a_quota_is_full(tmp_path):
    # The tests above fill a file size limit (EFBIG); a full disk is ENOSPC, a user's quota EDQUOT.
    for code, remedy in [(errno.ENOSPC, "make room"), (errno.EDQUOT, "make room"), (errno.EFBIG, "make room"),
                         (errno.EACCES, "fix what it names"), (errno.EROFS, "fix what it names")]:
        error = OSError(code, os.strerror(code))
        message = write_failure(str(tmp_path / "final"), error)
        assert re.fullmatch(f"writing {tmp_path}/final failed \\({type(error).__name__}: {re.escape(str(error))}\\), "
                            f"with [0-9.,]+ MiB free on the file system of {tmp_path}: {remedy}", message), message
    # Of the nearest folder that exists: a full disk can stop the output folder's creation.
    assert re.fullmatch(f"[0-9.,]+ MiB free on the file system of {tmp_path}", space_left(str(tmp_path / "a" / "b")))


def test_integer_tensors_are_written_as_stored(tmp_path, one_process_group):
    # DeepSeek V4's hash routing reads expert ids from a persistent int64 table (tid2eid): written in bf16, 257
    # would come back as 256.
    tokenizer = demo.build_tokenizer()
    model = demo.LlamaForCausalLM(demo.tiny_llama_config(tokenizer, hidden_size=16, intermediate_size=32,
                                                         num_hidden_layers=1))
    table = torch.arange(1000, dtype=torch.int64).reshape(10, 100) * 3 + 1
    model.model.layers[0].mlp.register_buffer("tid2eid", table.clone())
    save_hf_model(model, tokenizer, str(tmp_path / "final"), torch.bfloat16)
    folders = [tmp_path / "final"]
    for fmt in ["full", "sharded"]:
        cfg = parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", str(tmp_path / fmt),
                            "--save_steps", "1", "--save_state_dict_type", fmt])
        optimizer = build_optimizer(model, cfg)
        checkpoint = save_checkpoint(cfg, model, optimizer, get_scheduler("constant", optimizer), tokenizer, step=1,
                                     epoch=0, wandb_run=None)
        convert(checkpoint, str(tmp_path / f"{fmt}_converted"), torch.bfloat16)
        folders.append(tmp_path / f"{fmt}_converted")
    for folder in folders:
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
            assert dtypes.pop("model.layers.0.mlp.tid2eid") == "I64"
            assert set(dtypes.values()) == {"BF16"}
            assert torch.equal(f.get_tensor("model.layers.0.mlp.tid2eid"), table)


def test_written_tensor_bytes_start_8_byte_aligned_as_safetensors_writes_them(tmp_path):
    # The header is padded so that the tensor bytes start at a multiple of 8, as safetensors' own writer does: a reader
    # that maps the file can view them in place. Names of 1 to 8 letters give every header length modulo 8.
    for length in range(1, 9):
        name = "w" * length
        write_hf_weights(str(tmp_path), {name: torch.Size([3])}, {name: torch.float64}, "5GB",
                         lambda _: torch.arange(3.0))
        data = (tmp_path / "model.safetensors").read_bytes()
        assert len(data) % 8 == 0 and data == safetensors.torch.save({name: torch.arange(3.0, dtype=torch.float64)},
                                                                     metadata={"format": "pt"}), name


def test_shards_stay_under_max_shard_size_and_the_index_names_the_file_of_each_tensor(tmp_path):
    # Five 40 KB tensors in files of at most 100 KB: two to a file. A tensor over the limit gets a file of its own;
    # cast to bf16 4 MB at a time, its 2**20 + 3 elements end in a partial slice.
    torch.manual_seed(0)
    tensors = {f"w{i}": torch.randn(10_000) for i in range(5)} | {"big": torch.randn(2**20 + 3)}
    dtypes = {name: torch.float32 for name in tensors} | {"big": torch.bfloat16}
    write_hf_weights(str(tmp_path), {name: t.shape for name, t in tensors.items()}, dtypes, "100KB",
                     tensors.__getitem__)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert index["weight_map"] == {"w0": files[0], "w1": files[0], "w2": files[1], "w3": files[1], "big": files[2],
                                   "w4": files[3]}
    assert index["metadata"] == {"total_size": 5 * 40_000 + (2**20 + 3) * 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*files, "model.safetensors.index.json"])
    for name, file in index["weight_map"].items():
        assert torch.equal(safetensors.torch.load_file(tmp_path / file)[name], tensors[name].to(dtypes[name])), name
    # A loader that gives another shape than the one planned (the header already written) is an error, not a file
    # whose bytes do not match its header.
    with pytest.raises(ValueError, match=r"^w0 has shape \(3,\), expected \(10000,\)$"):
        write_hf_weights(str(tmp_path), {"w0": torch.Size([10_000])}, {"w0": torch.float32}, "5GB",
                         lambda _: torch.zeros(3))
    # A source's own dtype that safetensors files here cannot hold: refused before any file is opened.
    (tmp_path / "fp8").mkdir()
    with pytest.raises(ValueError, match=r"^cannot write torch.float8_e4m3fn tensors: safetensors files here hold "
                                         r"torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64"):
        write_hf_weights(str(tmp_path / "fp8"), {"w": torch.Size([2])}, {"w": torch.float8_e4m3fn}, "5GB",
                         lambda _: torch.zeros(2))
    assert os.listdir(tmp_path / "fp8") == []


def test_save_dtype_auto_is_the_dtype_config_json_records(tmp_path):
    tokenizer = demo.build_tokenizer()
    config = demo.tiny_llama_config(tokenizer, hidden_size=16, intermediate_size=32, num_hidden_layers=1)
    for dtype, expected in [("bfloat16", torch.bfloat16), ("float16", torch.float16), (None, torch.float32)]:
        config.dtype = dtype
        config.save_pretrained(tmp_path / str(dtype))
        if dtype is None:  # an older checkpoint's config.json, which records no dtype
            assert "dtype" not in json.loads((tmp_path / "None" / "config.json").read_text())
        args = ["--model_name_or_path", str(tmp_path / str(dtype)), "--dataset_name", "x"]
        assert export_dtype(parse_config(args)) == expected
        assert export_dtype(parse_config([*args, "--save_dtype", "float16"])) == torch.float16
    # transformers 4's name for it
    saved = json.loads((tmp_path / "None" / "config.json").read_text())
    (tmp_path / "None" / "config.json").write_text(json.dumps({**saved, "torch_dtype": "bfloat16"}))
    assert export_dtype(parse_config(["--model_name_or_path", str(tmp_path / "None"), "--dataset_name", "x"])) == (
        torch.bfloat16)


REMOTE_CONFIG = """from transformers import LlamaConfig


class FooConfig(LlamaConfig):
    model_type = "foo"
"""
REMOTE_MODEL = """from transformers import LlamaForCausalLM

from .configuration_foo import FooConfig


class FooForCausalLM(LlamaForCausalLM):
    config_class = FooConfig
"""


def write_model_with_its_own_code(source, path):
    """The tiny Llama as a checkpoint that ships its own model code (loaded with trust_remote_code)."""
    shutil.copytree(source, path)
    (path / "configuration_foo.py").write_text(REMOTE_CONFIG)
    (path / "modeling_foo.py").write_text(REMOTE_MODEL)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="foo", architectures=["FooForCausalLM"],
                  auto_map={"AutoConfig": "configuration_foo.FooConfig",
                            "AutoModelForCausalLM": "modeling_foo.FooForCausalLM"})
    (path / "config.json").write_text(json.dumps(config))
    return path


PREPROCESSOR_CONFIG = json.dumps({"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 28,
                                                                                      "width": 28}})


@pytest.mark.parametrize("fsdp_version", [2, 1])
def test_a_model_with_its_own_code_exports_the_code_too(tiny, tmp_path, fsdp_version):
    source = write_model_with_its_own_code(tiny["model"], tmp_path / "foo")
    # As a multimodal model's folder has: the processor files, which vLLM needs, go into final/ and checkpoints.
    (source / "preprocessor_config.json").write_text(PREPROCESSOR_CONFIG)
    out = tmp_path / "run"
    # The generic recipe; the run ends by reloading final/ for a sample, which needs the code beside the weights.
    run([sys.executable, "recipes/sft.py", "--model_name_or_path", source, "--trust_remote_code", "true",
         "--dataset_name", tiny["data"], "--output_dir", out, "--fsdp_version", str(fsdp_version),
         "--max_steps", "2", "--per_device_train_batch_size", "2", "--max_seq_length", "64",
         "--mixed_precision", "no", "--save_steps", "2", "--save_state_dict_type", "sharded",
         "--generation_prompts", "abc", "--generation_max_new_tokens", "2"])
    run([sys.executable, "-m", "fsdp_recipes.convert", out / "checkpoint-2", tmp_path / "converted"])
    assert len(read_metrics(out / "samples.jsonl")) == 1
    for folder in [out / "final", tmp_path / "converted"]:
        assert (folder / "modeling_foo.py").read_text() == REMOTE_MODEL
        assert (folder / "configuration_foo.py").read_text() == REMOTE_CONFIG
        assert (folder / "preprocessor_config.json").read_text() == PREPROCESSOR_CONFIG
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
        assert type(model).__name__ == "FooForCausalLM"


def test_a_model_with_its_own_code_and_tied_embeddings_converts_to_the_weights_of_its_export(tiny, tmp_path,
                                                                                            one_process_group):
    # The converter builds no model of its own code: config.json's tie_word_embeddings tells it that the sharded
    # checkpoint's lm_head.weight is the embedding's second name, which final/ leaves out.
    source = write_model_with_its_own_code(tiny["tied_model"], tmp_path / "foo")
    cfg = parse_config(["--model_name_or_path", str(source), "--trust_remote_code", "true", "--dataset_name", "x",
                        "--output_dir", str(tmp_path / "run"), "--mixed_precision", "no", "--save_steps", "1",
                        "--save_state_dict_type", "sharded"])
    model = load_sharded_model(cfg, resolve_plan(cfg), torch.device("cpu"))
    tokenizer = load_tokenizer(cfg)
    save_hf_model(model, tokenizer, str(tmp_path / "final"), torch.float32)
    optimizer = build_optimizer(model, cfg)
    checkpoint = save_checkpoint(cfg, model, optimizer, get_scheduler("constant", optimizer), tokenizer, step=1,
                                 epoch=0, wandb_run=None)
    convert(checkpoint, str(tmp_path / "converted"))
    final, converted = (safetensors_dtypes(tmp_path / folder) for folder in ("final", "converted"))
    assert "lm_head.weight" not in final and converted == final


@pytest.mark.parametrize("eos, expected", [("<|endoftext|>", ["<|endoftext|>", "<|im_end|>"]),
                                           ("<|im_end|>", "<|im_end|>")])
def test_generation_stops_where_the_chat_template_closes_a_turn(tmp_path, eos, expected):
    # A base model's tokenizer (Qwen2.5 base: EOS <|endoftext|>) whose ChatML template closes turns with <|im_end|>:
    # chat training teaches <|im_end|> only, so generation must stop there; an instruct tokenizer's EOS already does.
    tokenizer = demo.build_tokenizer()
    tokenizer.add_special_tokens({"eos_token": eos,
                                  "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]})
    tokenizer.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
                               "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    model = demo.LlamaForCausalLM(demo.tiny_llama_config(tokenizer, hidden_size=16, intermediate_size=32,
                                                         num_hidden_layers=1))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    # A base model's sampling default without do_sample: from_pretrained accepts it, so the export keeps it as it is.
    model.generation_config.temperature = 0.6
    write_model_files(model, tokenizer, str(tmp_path), torch.float32)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert saved["eos_token_id"] == tokenizer.convert_tokens_to_ids(expected)
    assert (saved["temperature"], saved.get("do_sample", False)) == (0.6, False)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id  # the training model's is left alone


def test_a_tokenizer_without_a_pad_token_is_exported_with_the_one_training_padded_with(tmp_path):
    # Llama 3's tokenizer has no pad token: training pads with EOS (load_tokenizer), and the export says so.
    tokenizer = demo.build_tokenizer()
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path / "source")
    model = demo.LlamaForCausalLM(demo.tiny_llama_config(tokenizer, hidden_size=16, intermediate_size=32,
                                                         num_hidden_layers=1))
    cfg = parse_config(["--model_name_or_path", str(tmp_path / "source"), "--dataset_name", "x"])
    write_model_files(model, load_tokenizer(cfg), str(tmp_path / "final"), torch.float32)
    assert AutoTokenizer.from_pretrained(tmp_path / "source").pad_token is None
    exported = AutoTokenizer.from_pretrained(tmp_path / "final")
    assert (exported.pad_token, exported.pad_token_id) == ("<|end|>", tokenizer.eos_token_id)


def test_a_multimodal_config_records_the_dtype_in_each_sub_config(tmp_path):
    # A Gemma 3 with a vision tower, loaded in fp32: its text_config and vision_config say float32 too.
    text = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, vocab_size=64, dtype="float32")
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14, dtype="float32")
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, dtype="float32")
    with torch.device("meta"):  # write_model_files reads the config and generation config only
        model = Gemma3ForConditionalGeneration(config)
    write_model_files(model, demo.build_tokenizer(), str(tmp_path), torch.bfloat16)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert [saved["dtype"], saved["text_config"]["dtype"], saved["vision_config"]["dtype"]] == ["bfloat16"] * 3
    assert model.config.text_config.dtype == torch.float32  # the training model's is left alone
    # The converter writes config.json from the checkpoint's, which says float32 (the checkpoint's dtype).
    converted, expected = config.to_dict(), config.to_dict()
    set_config_dtype_in_json(converted, "bfloat16")
    for part in (expected, expected["text_config"], expected["vision_config"]):
        part["dtype"] = "bfloat16"
    # Only there: the other dicts (id2label, rope_parameters) are no configs, and a dtype in id2label fails the load.
    assert converted == expected
