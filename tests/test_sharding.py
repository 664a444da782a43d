"""Sharding proven by numbers: every engine and strategy trains with the losses of one unsharded process, and each
rank holds half of the parameters, gradients and optimizer state.

One 2-process launch trains every variant below for 10 steps (accumulation 2, a fresh model each), one single
process trains the unsharded reference on the same global batch (2 x 4 sequences per micro-batch = 1 x 8).
"""

import json
import os
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import XGLMConfig, XGLMForCausalLM

from fsdp_recipes import demo, fsdp1
from fsdp_recipes.config import ConfigError, parse_config
from fsdp_recipes.model import load_model, load_sharded_model
from fsdp_recipes.plan import resolve_plan

from conftest import read_metrics, run, torchrun, write_tiny_model

PROFILED = {"profile_training": True}  # tests/drivers/sharding_run.py counts the trainer's reduce-scatters
PARITY = {  # fp32: per-step losses must equal the unsharded reference within 1e-5 relative
    "fsdp1_full_shard": {"fsdp_version": 1, **PROFILED},
    "fsdp1_shard_grad_op": {"fsdp_version": 1, "fsdp_sharding_strategy": "SHARD_GRAD_OP"},
    "fsdp1_no_shard": {"fsdp_version": 1, "fsdp_sharding_strategy": "NO_SHARD"},
    "fsdp1_hybrid_shard": {"fsdp_version": 1, "fsdp_sharding_strategy": "HYBRID_SHARD"},  # 1 node: mesh 1 x 2
    "fsdp2_reshard": {"fsdp_version": 2, **PROFILED},
    "fsdp2_no_reshard": {"fsdp_reshard_after_forward": "false"},
    "fsdp2_hsdp": {"dp_replicate_size": 2},  # mesh 2 x 1: replicate across the 2 ranks
    "fsdp1_sync_last": {"fsdp_version": 1, "gradient_sync": "last_micro_batch", **PROFILED},
    "fsdp2_sync_last": {"gradient_sync": "last_micro_batch", **PROFILED},
    "fsdp1_shard_grad_op_sync_last": {"fsdp_version": 1, "fsdp_sharding_strategy": "SHARD_GRAD_OP",
                                      "gradient_sync": "last_micro_batch", **PROFILED},
    "fsdp2_no_reshard_sync_last": {"fsdp_reshard_after_forward": "false", "gradient_sync": "last_micro_batch",
                                   **PROFILED},
    "fsdp1_ac": {"fsdp_version": 1, "fsdp_activation_checkpointing": "true"},
    "fsdp2_ac": {"fsdp_activation_checkpointing": "true"},
    "fsdp2_offload": {"fsdp_offload_params": "true"},
    "fsdp1_size_wrap": {"fsdp_version": 1, "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": 20000},
    "fsdp2_size_wrap": {"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": 20000},
    # A unit inside another: FSDP2 shards the MLP first, then the rest of its layer.
    "fsdp1_nested_units": {"fsdp_version": 1, "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer,LlamaMLP"},
    "fsdp2_nested_units": {"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer,LlamaMLP"},
    "fsdp2_nested_units_ac": {"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer,LlamaMLP",
                              "fsdp_activation_checkpointing": "true"},
    "fsdp1_rank0_load": {"fsdp_version": 1, "fsdp_cpu_ram_efficient_loading": "true"},
    "fsdp2_rank0_load": {"fsdp_cpu_ram_efficient_loading": "true"},
    # NO_SHARD keeps each parameter whole: the broadcast copies into the original shapes, not 1-D shard slices.
    "fsdp1_no_shard_rank0_load": {"fsdp_version": 1, "fsdp_sharding_strategy": "NO_SHARD",
                                  "fsdp_cpu_ram_efficient_loading": "true"},
}
BF16 = {  # against the fp32 reference, within BF16_TOLERANCE
    "fsdp1_bf16": {"fsdp_version": 1, "mixed_precision": "bf16"},
    "fsdp2_bf16": {"mixed_precision": "bf16"},
    "fsdp2_pure_bf16": {"mixed_precision": "pure_bf16"},
}
TIED = {  # the tied-embeddings model, against its own unsharded reference
    "fsdp1_tied": {"fsdp_version": 1},
    "fsdp2_tied": {"fsdp_version": 2},
    "fsdp1_tied_rank0_load": {"fsdp_version": 1, "fsdp_cpu_ram_efficient_loading": "true"},
    "fsdp2_tied_rank0_load": {"fsdp_cpu_ram_efficient_loading": "true"},
    # The embedding and lm_head stay in the root unit, as with FSDP2 (FSDP1's own size policy split them).
    "fsdp1_tied_size_wrap": {"fsdp_version": 1, "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
                             "fsdp_min_num_params": 20000},
}
PARITY_TOLERANCE = 1e-5
BF16_TOLERANCE = 1e-2  # measured: 1.1e-3 (bf16 compute) and 1.4e-3 (pure bf16) over the 10 steps
NOT_SHARDED = ["fsdp1_no_shard", "fsdp1_no_shard_rank0_load", "fsdp2_hsdp"]
SHARDED = [n for n in {**PARITY, **BF16, **TIED} if n not in NOT_SHARDED]


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("sharding")
    common = ["--dataset_name", tiny["data"], "--max_steps", "10", "--gradient_accumulation_steps", "2",
              "--mixed_precision", "no", "--learning_rate", "1e-2", "--max_seq_length", "64", "--logging_steps", "1"]
    tied = {"model_name_or_path": str(tiny["tied_model"])}
    variants = {**PARITY, **BF16, **{name: {**flags, **tied} for name, flags in TIED.items()}}
    torchrun("tests/drivers/sharding_run.py", out, json.dumps(variants), "--model_name_or_path", tiny["model"],
             "--per_device_train_batch_size", "4", *common)
    # One process: FSDP1 on one rank is NO_SHARD (torch switches to it), as on a one-GPU machine.
    reference = {"unsharded": {}, "unsharded_tied": tied,
                 "one_process_fsdp1_rank0_load": {"fsdp_version": 1, "fsdp_cpu_ram_efficient_loading": "true"}}
    run([sys.executable, "tests/drivers/sharding_run.py", out, json.dumps(reference), "--model_name_or_path", tiny["model"],
         "--per_device_train_batch_size", "8", *common])

    def load(name):
        ranks = [json.loads((out / name / f"rank{r}.json").read_text()) for r in range(2 if name in variants else 1)]
        return {"losses": [m["loss"] for m in read_metrics(out / name / "metrics.jsonl")],
                "grad_norms": [m["grad_norm"] for m in read_metrics(out / name / "metrics.jsonl")], "ranks": ranks}

    return {name: load(name) for name in [*variants, *reference]}


def max_relative_deviation(losses, reference):
    assert len(losses) == len(reference) == 10
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


@pytest.mark.parametrize("name", PARITY)
def test_fp32_losses_equal_the_unsharded_process(runs, name):
    reference = runs["unsharded"]
    assert max_relative_deviation(runs[name]["losses"], reference["losses"]) <= PARITY_TOLERANCE
    # Clipping sees the global norm: the reference's, on both ranks.
    assert max_relative_deviation(runs[name]["grad_norms"], reference["grad_norms"]) <= PARITY_TOLERANCE
    assert reference["losses"][-1] < 0.8 * reference["losses"][0]  # the runs compared do learn
    # The norm each rank computes (one extra backward of an unnormalised loss sum, which FSDP averages over the 2
    # ranks: half the single process's), bit-equal on both ranks.
    norms = [rank["grad_norm"] for rank in runs[name]["ranks"]]
    assert norms[0] == norms[1]
    assert abs(norms[0] - reference["ranks"][0]["grad_norm"] / 2) <= PARITY_TOLERANCE * norms[0]


def test_fsdp1_rank0_load_on_one_process_equals_the_unsharded_process(runs):
    losses, reference = runs["one_process_fsdp1_rank0_load"]["losses"], runs["unsharded"]["losses"]
    assert max_relative_deviation(losses, reference) <= PARITY_TOLERANCE


@pytest.mark.parametrize("name", [*PARITY, *BF16, *TIED, "unsharded"])
def test_clipping_scales_the_global_norm_to_max_grad_norm(runs, name):
    for rank in runs[name]["ranks"]:  # clipped to a quarter of the norm measured before
        assert abs(rank["clipped_grad_norm"] - rank["grad_norm"] / 4) <= 1e-5 * rank["grad_norm"]


def test_weight_decay_groups_hold_the_parameters_of_the_unsharded_model(runs):
    """FSDP1's FULL_SHARD parameters are 1-D slices on 2 ranks: which decay goes by the shapes before sharding, so
    every engine's groups (weight decay, parameter count) are the unsharded model's (one process cannot show it: FSDP1
    turns NO_SHARD there, and DTensors keep their shapes)."""
    for name in [*PARITY, *BF16, *TIED]:
        reference = runs["unsharded_tied" if "tied" in name else "unsharded"]["ranks"][0]["optimizer_groups"]
        assert len(reference) == 2  # decayed and not: a single group would not tell the two apart
        for rank in runs[name]["ranks"]:
            assert rank["optimizer_groups"] == reference, name


@pytest.mark.parametrize("name", BF16)
def test_bf16_stays_close_to_fp32(runs, name):
    deviation = max_relative_deviation(runs[name]["losses"], runs["unsharded"]["losses"])
    assert 0 < deviation <= BF16_TOLERANCE  # > 0: bf16 compute did happen


def test_master_weights_and_optimizer_state_dtypes(runs):
    for name in ["fsdp1_bf16", "fsdp2_bf16", "fsdp2_reshard"]:
        for rank in runs[name]["ranks"]:
            assert rank["param_dtypes"] == rank["state_dtypes"] == ["torch.float32"]
    for rank in runs["fsdp2_pure_bf16"]["ranks"]:
        assert rank["param_dtypes"] == rank["state_dtypes"] == ["torch.bfloat16"]


@pytest.mark.parametrize("name", SHARDED)
def test_each_rank_holds_half_of_params_grads_and_optimizer_state(runs, name):
    reference = runs["unsharded_tied" if "tied" in name else "unsharded"]["ranks"][0]
    for kind in ["params", "grads", "optimizer_state"]:
        total = reference[kind]
        if "pure_bf16" in name:
            total //= 2  # bf16 instead of fp32
        held = [rank[kind] for rank in runs[name]["ranks"]]
        # Exactly half (nothing duplicated, nothing missing), as the README says: FSDP1 pads a flat parameter to a
        # multiple of the world size, which the tiny model's are already, and the padding is not counted (its original
        # parameters are views).
        assert [h * 2 for h in held] == [total, total], kind


def test_no_shard_and_replicated_hsdp_hold_everything(runs):
    reference = runs["unsharded"]["ranks"][0]
    for name in NOT_SHARDED:
        for rank in runs[name]["ranks"]:
            assert [rank[k] for k in ("params", "grads", "optimizer_state")] == \
                [reference[k] for k in ("params", "grads", "optimizer_state")]


def test_the_trainer_reduces_gradients_as_gradient_sync_says(runs):
    """10 steps of 2 micro-batches, 3 units: each unit reduce-scatters its gradients in every micro-batch, or
    only in the last one of a step with gradient_sync last_micro_batch."""
    for name, per_step in [("fsdp2_reshard", 2), ("fsdp2_sync_last", 1), ("fsdp2_no_reshard_sync_last", 1),
                           ("fsdp1_full_shard", 2), ("fsdp1_sync_last", 1), ("fsdp1_shard_grad_op_sync_last", 1)]:
        assert [r["reduce_scatters_in_training"] for r in runs[name]["ranks"]] == [10 * 3 * per_step] * 2, name


def test_all_gathers_and_reduce_scatters_per_micro_batch(runs):
    """What each engine all-gathers and reduce-scatters in one micro-batch of the 2-layer model: 3 units, the root
    (embeddings, final norm, lm_head) and one per layer. The root is never resharded after forward, as backward
    starts with its lm_head. Without gradient sync (here the second such micro-batch) the root stays gathered for
    the next micro-batch, and so do the layers of a model that keeps them gathered from forward to backward (FSDP1
    SHARD_GRAD_OP, FSDP2 reshard_after_forward=False), which then runs no collective at all."""
    def all_gathers_and_reduce_scatters(name, phase):  # the same on both ranks
        per_rank = {tuple(sum(n for op, n in rank[phase].items() if kind in op) for kind in ("allgather", "reduce_scatter"))
                    for rank in runs[name]["ranks"]}
        assert len(per_rank) == 1, (name, phase, per_rank)
        return per_rank.pop()

    expected = {  # (synced, second without sync), each (all-gathers, reduce-scatters)
        # FSDP2: the root once, each layer in forward and again in backward; without sync the root stays gathered.
        "fsdp2_reshard": ((1 + 2 * 2, 3), (2 * 2, 0)),
        "fsdp2_no_reshard": ((3, 3), (0, 0)),
        # FSDP1's no_sync gathers its root again in the next micro-batch.
        "fsdp1_full_shard": ((1 + 2 * 2, 3), (1 + 2 * 2, 0)),
        "fsdp1_shard_grad_op": ((3, 3), (0, 0)),
    }
    measured = {name: tuple(all_gathers_and_reduce_scatters(name, phase) for phase in
                            ("collectives_in_synced_micro_batch", "collectives_in_second_micro_batch_without_sync"))
                for name in expected}
    assert measured == expected


def test_activation_checkpointing_recomputes_each_layer_with_clean_keys(runs):
    # 2 decoder layers: 2 forward calls without checkpointing, 4 with (each layer runs again in backward).
    assert runs["fsdp2_reshard"]["ranks"][0]["layer_forward_calls"] == 2
    for name in ["fsdp1_ac", "fsdp2_ac"]:
        assert [r["layer_forward_calls"] for r in runs[name]["ranks"]] == [4, 4]
        assert runs[name]["ranks"][0]["state_dict_keys"] == runs["unsharded"]["ranks"][0]["state_dict_keys"]
        assert "activation checkpointing: each decoder layer" in runs[name]["ranks"][0]["plan"]


def test_offload_keeps_state_on_cpu(runs):
    rank = runs["fsdp2_offload"]["ranks"][0]
    assert "offload: parameters, gradients and optimizer state on CPU" in rank["plan"]
    assert rank["param_devices"] == ["cpu"]
    # The CPU is also where an unoffloaded run keeps them: each unit's policy is what shows the offload.
    assert rank["offload_policies"] == ["CPUOffloadPolicy"] * 3  # 2 decoder layers and the root
    assert runs["fsdp2_reshard"]["ranks"][0]["offload_policies"] == ["OffloadPolicy"] * 3
    assert runs["fsdp1_full_shard"]["ranks"][0]["offload_policies"] == ["FSDP1 offload_params=False"] * 3


@pytest.mark.parametrize("name", TIED)
def test_tied_embeddings_shard_train_and_stay_tied(runs, name):
    reference = runs["unsharded_tied"]
    assert reference["ranks"][0]["tied"] is True
    assert max_relative_deviation(runs[name]["losses"], reference["losses"]) <= PARITY_TOLERANCE
    assert [rank["tied"] for rank in runs[name]["ranks"]] == [True, True]
    assert runs[name]["ranks"][0]["state_dict_keys"] == reference["ranks"][0]["state_dict_keys"]


def test_printed_plan_describes_the_engine(runs):
    plans = {name: runs[name]["ranks"][0]["plan"] for name in PARITY}
    assert "engine: FSDP1 (FullyShardedDataParallel) over 2 ranks" in plans["fsdp1_full_shard"]
    assert "wrapped: 2 x LlamaDecoderLayer, then the root" in plans["fsdp1_full_shard"]
    assert "strategy: HYBRID_SHARD, mesh 1 x 2" in plans["fsdp1_hybrid_shard"]
    assert "strategy: shard mesh 2, reshard_after_forward=False" in plans["fsdp2_no_reshard"]
    assert "strategy: HSDP (replicate x shard) mesh 2 x 1, reshard_after_forward=True" in plans["fsdp2_hsdp"]
    for engine in ("fsdp1", "fsdp2"):  # the same units
        assert "wrapped: 3 x size-based (20,000 parameters or more), then the root" in plans[f"{engine}_size_wrap"]
        assert "wrapped: 4 x LlamaDecoderLayer, LlamaMLP, then the root" in plans[f"{engine}_nested_units"]
    assert "loading: rank 0 reads the weights, broadcast while sharding" in plans["fsdp2_rank0_load"]
    assert "parameters: 80,192 total, 40,096 on rank 0" in plans["fsdp2_reshard"]
    assert "gradient sync: every micro-batch" in plans["fsdp2_reshard"]
    assert "gradient sync: last micro-batch of each step, full gradients accumulate in between" in plans["fsdp1_sync_last"]


def test_rank0_loading_leaves_other_ranks_with_shards_only(tmp_path):
    """A 31.5M-parameter Llama (126 MB in fp32): with rank-0 loading the second rank's peak memory while loading
    stays under 0.8 x the model (its shards are 0.5 x, plus one full tensor in flight), where reading the weights
    on every rank costs it more than 1 x; and every rank's shards equal the checkpoint."""
    model = write_tiny_model(tmp_path / "model", hidden_size=512, intermediate_size=2048, num_hidden_layers=8)
    # Freed tensors go back to the OS at once (glibc would otherwise keep raising its mmap threshold).
    torchrun("tests/drivers/sharding_rank0_load.py", tmp_path, "--model_name_or_path", model, "--dataset_name", "x",
             MALLOC_MMAP_THRESHOLD_="65536")
    result = {(name, r): json.loads((tmp_path / f"{name}_rank{r}.json").read_text())
              for name in ["fsdp2_rank0", "fsdp1_rank0", "fsdp2_every_rank"] for r in (0, 1)}
    full = result["fsdp2_rank0", 0]["full_bytes"]
    assert full == 31_515_136 * 4
    assert all(r["equal_to_checkpoint"] for r in result.values())
    for name in ["fsdp2_rank0", "fsdp1_rank0"]:
        assert result[name, 1]["peak_rss_increase"] < 0.8 * full  # measured 0.66 (FSDP2), 0.63 (FSDP1)
        assert result[name, 0]["peak_rss_increase"] > full  # rank 0 did read the whole model
    assert result["fsdp2_every_rank", 1]["peak_rss_increase"] > full  # measured 1.5: the measurement can tell


def test_ranks_reading_the_weights_each_wait_for_the_slowest_on_the_long_wait_group(tiny, tmp_path):
    """Rank 1 reads the weights 12 s longer than rank 0, past the training group's 6 s timeout (wide enough for a
    loaded machine once both have read): the ranks meet on the long-wait group before sharding, so neither times out
    in the first collective."""
    proc = torchrun("tests/drivers/model_load_wait.py", "12", "6", "--model_name_or_path", tiny["model"],
                    "--dataset_name", "x", timeout=180)
    for rank in (0, 1):
        assert f"rank {rank}: sharded, past the training group's barrier" in proc.stdout, proc.stdout + proc.stderr


def test_hsdp_on_a_2x2_mesh_matches_and_shards_within_each_replica(runs, tiny, tmp_path):
    """4 processes: 2 replicas x 2 shards, the multi-node layout in miniature (2 x 2 sequences = 1 x 8)."""
    variants = {"fsdp2_hsdp": {"dp_replicate_size": 2},
                "fsdp1_hybrid_shard": {"fsdp_version": 1, "fsdp_sharding_strategy": "HYBRID_SHARD",
                                       "dp_replicate_size": 2}}
    torchrun("tests/drivers/sharding_run.py", tmp_path, json.dumps(variants), "--model_name_or_path", tiny["model"],
             "--dataset_name", tiny["data"], "--max_steps", "10", "--gradient_accumulation_steps", "2",
             "--mixed_precision", "no", "--learning_rate", "1e-2", "--max_seq_length", "64",
             "--per_device_train_batch_size", "2", nproc=4)
    reference = runs["unsharded"]
    for name in variants:
        losses = [m["loss"] for m in read_metrics(tmp_path / name / "metrics.jsonl")]
        assert max_relative_deviation(losses, reference["losses"]) <= PARITY_TOLERANCE
        ranks = [json.loads((tmp_path / name / f"rank{r}.json").read_text()) for r in range(4)]
        assert "mesh 2 x 2" in ranks[0]["plan"]
        for kind in ["params", "grads", "optimizer_state"]:
            assert [rank[kind] for rank in ranks] == [reference["ranks"][0][kind] // 2] * 4  # measured: exact


def test_every_rank_reading_the_weights_initialises_those_the_checkpoint_lacks(tiny, tmp_path, monkeypatch,
                                                                              one_process_group):
    """Under accelerate launch with its fsdp_cpu_ram_efficient_loading true (every shipped config, and accelerate's
    default) and the recipe config's false, every rank reads the weights: transformers must still initialise a weight
    the checkpoint lacks (here lm_head) on a rank other than local rank 0, as it does on rank 0."""
    folder = tmp_path / "no_lm_head"
    shutil.copytree(tiny["model"], folder)
    weights = load_file(folder / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = parse_config(["--model_name_or_path", str(folder), "--dataset_name", "x"])
    torch.manual_seed(0)
    expected = load_model(cfg).lm_head.weight
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")
    monkeypatch.setenv("LOCAL_RANK", "1")
    torch.manual_seed(0)
    assert torch.equal(load_model(cfg).lm_head.weight, expected)
    assert os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true"  # left as accelerate set it


@pytest.mark.parametrize("fsdp_version", [2, 1])
def test_rank0_loading_gives_the_model_from_pretrained_gives(tiny, fsdp_version, one_process_group):
    """Built on the meta device and filled from rank 0's weights: the lm_head stays tied to the embedding (it would
    train apart), and the buffers that to_empty emptied (the rotary frequencies) are the model's, so the logits are
    from_pretrained's; the KV cache is off, as load_model turns it off for training. One process: the 2-process runs
    above show it in the losses, after minutes."""
    cfg = parse_config(["--model_name_or_path", str(tiny["tied_model"]), "--dataset_name", "x", "--mixed_precision",
                        "no", "--fsdp_version", str(fsdp_version), "--fsdp_cpu_ram_efficient_loading", "true"])
    model = load_sharded_model(cfg, resolve_plan(cfg), torch.device("cpu"))
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    inputs = torch.arange(1, 33).unsqueeze(0)
    with torch.no_grad():
        output = model(inputs)
        assert torch.equal(output.logits, load_model(cfg)(inputs).logits)
    assert list(output.keys()) == ["logits"]  # no cache (transformers 5.25 names it cache, 5.17 past_key_values)


def test_fsdp1_casts_each_layers_inputs_to_bf16_as_fsdp2_does(tmp_path, one_process_group):
    """XGLM adds its sinusoidal positions, an fp32 buffer, to the bf16 embeddings: FSDP1's decoder layers got fp32
    hidden states for their bf16 weights, and the run stopped at its first step ("mixed dtype (CPU): expect parameter
    to have scalar type of Float"), where each FSDP2 unit casts its inputs to bf16."""
    tokenizer = demo.build_tokenizer()
    torch.manual_seed(0)
    XGLMForCausalLM(XGLMConfig(vocab_size=len(tokenizer), d_model=64, ffn_dim=128, attention_heads=4,
                               num_layers=2)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    ids = torch.arange(1, 17).unsqueeze(0)
    losses = []
    for version in ("1", "2"):
        cfg = parse_config(["--model_name_or_path", str(tmp_path), "--dataset_name", "x", "--fsdp_version", version,
                            "--mixed_precision", "bf16", "--attn_implementation", "eager"])
        loss = load_sharded_model(cfg, resolve_plan(cfg), torch.device("cpu"))(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == losses[1]


def test_fsdp1_on_one_rank_refuses_bf16_last_micro_batch_sync_of_tied_weights(tiny, one_process_group, monkeypatch):
    """FSDP1 on 1 rank runs NO_SHARD, whose no_sync gives a tied embedding a bf16 gradient that torch refuses at the
    second micro-batch (a 2-rank FSDP1 run resumed on 1 rank met it): refused when the model is sharded, naming the
    weight, and for that combination only."""
    def shard(model: str, sync: str):
        cfg = parse_config(["--model_name_or_path", str(tiny[model]), "--dataset_name", "x", "--fsdp_version", "1",
                            "--mixed_precision", "bf16", "--gradient_accumulation_steps", "2", "--gradient_sync", sync])
        return load_sharded_model(cfg, resolve_plan(cfg), torch.device("cpu"))

    def two_micro_batches(model):
        ids = torch.arange(1, 17).unsqueeze(0)
        with model.no_sync():
            for _ in range(2):
                model(input_ids=ids, labels=ids).loss.backward()

    with pytest.raises(ConfigError, match=r"^FSDP1 on 1 rank \(which torch runs as NO_SHARD\) with mixed_precision "
                                          r"bf16 and gradient_sync last_micro_batch fails at the first step for a "
                                          r"model with tied weights \(lm_head\.weight\): torch's no_sync gives them "
                                          r"bf16 gradients it cannot assign\. Use gradient_sync every_micro_batch, or "
                                          r"fsdp_version 2$"):
        shard("tied_model", "last_micro_batch")
    shard("tied_model", "every_micro_batch")
    # With offload (GPU only) FSDP1 needs last_micro_batch to accumulate: the error gives the other way out alone.
    cfg = parse_config(["--model_name_or_path", str(tiny["tied_model"]), "--dataset_name", "x", "--fsdp_version", "1",
                        "--mixed_precision", "bf16", "--gradient_accumulation_steps", "2", "--gradient_sync",
                        "last_micro_batch", "--fsdp_offload_params", "true"])
    with pytest.raises(ConfigError, match=r"it cannot assign\. Use fsdp_version 2$"):
        fsdp1.check_no_shard_tied_bf16_sync(load_model(cfg), resolve_plan(cfg))
    two_micro_batches(shard("model", "last_micro_batch"))  # untied: trains
    # What the refusal spares (once torch assigns the gradient, this fails and the refusal can go).
    monkeypatch.setattr(fsdp1, "check_no_shard_tied_bf16_sync", lambda model, plan: None)
    # Up to 'a tensor': torch 2.13 then names the tensor's grad_dtype, which older versions' check may not have.
    with pytest.raises(RuntimeError, match=r"attempting to assign a gradient with dtype 'c10::BFloat16' to a tensor"):
        two_micro_batches(shard("tied_model", "last_micro_batch"))


@pytest.mark.parametrize("rank0_loading", ["false", "true"])
def test_weights_the_checkpoint_lacks_are_refused_but_a_new_output_layer(tiny, tmp_path, rank0_loading,
                                                                         one_process_group, capsys):
    """A config.json without num_hidden_layers builds transformers' default of 32 layers, 30 of which the weights
    do not hold: the run would fine-tune them from random values. A checkpoint of the model without its head (saved
    from LlamaModel) gets a new output layer, with a line that says so."""
    broken = shutil.copytree(tiny["model"], tmp_path / "no_layer_count")
    config = json.loads((broken / "config.json").read_text())
    del config["num_hidden_layers"]
    (broken / "config.json").write_text(json.dumps(config))
    headless = tmp_path / "headless"
    load_model(parse_config(["--model_name_or_path", str(tiny["model"]), "--dataset_name", "x"])).model.save_pretrained(
        headless)
    shutil.copy(tiny["model"] / "tokenizer.json", headless)

    def load(path):
        cfg = parse_config(["--model_name_or_path", str(path), "--dataset_name", "x", "--mixed_precision", "no",
                            "--fsdp_cpu_ram_efficient_loading", rank0_loading])
        return load_sharded_model(cfg, resolve_plan(cfg), torch.device("cpu"))

    with pytest.raises(ConfigError, match=rf"^{broken} holds no weights for 270 of the model's 291 parameters "
                                          r"\(model\.layers\.2\.self_attn\.q_proj\.weight, model\.layers\.2\.self_attn"
                                          r"\.k_proj\.weight, model\.layers\.2\.self_attn\.v_proj\.weight and 267 more\), "
                                          r"which would train from random values: its config\.json does not match its "
                                          r"weights \(the model built from it has 32 layers\), or a weight file is "
                                          r"missing$"):
        load(broken)
    capsys.readouterr()
    model = load(headless)
    assert capsys.readouterr().out.count(f"warning: {headless} holds no lm_head.weight: the output layer starts from "
                                         f"random values\n") == 1
    load(tiny["model"])
    assert "warning" not in capsys.readouterr().out  # a checkpoint that holds its output layer
    assert model.get_output_embeddings().weight.shape == model.get_input_embeddings().weight.shape
