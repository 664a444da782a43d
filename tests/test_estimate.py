"""The memory planner: its parameter, gradient and optimizer figures equal the bytes a sharded run holds, its
parameter counts equal the published ones, its activation formula stays close to what autograd saves, its logits
row is the peak of the loss's backward, and the README's example is its real output."""

import json
import re
import shlex
import sys
import weakref

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import (AutoConfig, AutoModelForCausalLM, BioGptConfig, Gemma2Config, GPT2Config, Gemma3Config,
                          Gemma3TextConfig, Gemma4Config, Gemma4TextConfig, Gemma4VisionConfig, GPTNeoConfig,
                          LlamaConfig, MambaConfig, MixtralConfig, Phi3Config, Qwen3Config, Qwen3MoeConfig, T5Config)

from conftest import REPO, run, torchrun
from fsdp_recipes.config import ConfigError, parse_config
from fsdp_recipes.estimate import (COMPUTE_DTYPE, Setting, build_meta_model, estimate, fsdp_groups, load_config,
                                   main, measure_activations, parse_args, recommend)
from fsdp_recipes.families import check_model_type
from fsdp_recipes.plan import resolve_plan
from fsdp_recipes.sharding import MASTER_DTYPE, build_mesh, check_master_dtype, find_layer_classes
from fsdp_recipes.trainer import token_loss_sum
from test_accelerate_configs import launched_env, process_group_of
from test_export import REMOTE_CONFIG, REMOTE_MODEL
from test_launch import launch_node_env

# config.json of meta-llama/Llama-3.1-8B and -70B as published on the Hub.
LLAMA_3_1 = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}
LLAMA_3_1_8B = {**LLAMA_3_1, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                "num_hidden_layers": 32}
LLAMA_3_1_70B = {**LLAMA_3_1, "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
                 "num_hidden_layers": 80}

# Odd sizes, so that dim-0 shards are uneven on 2 ranks: vocabulary 101 rows, MLP 75, experts 3.
UNEVEN = dict(vocab_size=101, hidden_size=40, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
VARIANTS = {
    "llama_fp32_full_shard": ("llama", "no", "FULL_SHARD", False),
    "llama_bf16_full_shard": ("llama", "bf16", "FULL_SHARD", False),
    "llama_pure_bf16_shard_grad_op": ("llama", "pure_bf16", "SHARD_GRAD_OP", False),
    "llama_fp32_hsdp": ("llama", "no", "HSDP", False),  # 2 nodes x 1 GPU: each rank holds everything
    "llama_fp32_offload": ("llama", "no", "FULL_SHARD", True),
    "tied_fp32_full_shard": ("tied", "no", "FULL_SHARD", False),
    "mixtral_fp32_full_shard": ("mixtral", "no", "FULL_SHARD", False),
    # Trained on text: its vision tower gets no gradients and no AdamW states.
    "gemma3_multimodal_bf16_full_shard": ("gemma3_multimodal", "bf16", "FULL_SHARD", False),
    "gemma3_multimodal_fp32_offload": ("gemma3_multimodal", "no", "FULL_SHARD", True),
}
GEMMA3_MULTIMODAL = Gemma3Config(
    text_config=dict(hidden_size=40, intermediate_size=75, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=10, vocab_size=301),
    vision_config=dict(hidden_size=24, intermediate_size=50, num_hidden_layers=2, num_attention_heads=2,
                       image_size=28, patch_size=14),
    mm_tokens_per_image=4)


def write_config(path, config: dict):
    path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("estimate_configs")
    (root / "llama_8b").mkdir()
    return {
        "llama": write_config(root / "llama.json", LlamaConfig(intermediate_size=75, **UNEVEN).to_dict()),
        "tied": write_config(root / "tied.json",
                             LlamaConfig(intermediate_size=75, tie_word_embeddings=True, **UNEVEN).to_dict()),
        "mixtral": write_config(root / "mixtral.json", MixtralConfig(intermediate_size=32, num_local_experts=3,
                                                                     num_experts_per_tok=2, **UNEVEN).to_dict()),
        "8b": write_config(root / "llama_8b" / "config.json", LLAMA_3_1_8B),
        "70b": write_config(root / "llama_70b.json", LLAMA_3_1_70B),
        "gemma3_multimodal": write_config(root / "gemma3_multimodal.json", GEMMA3_MULTIMODAL.to_dict()),
    }


@pytest.fixture(scope="module")
def held(configs, tmp_path_factory):
    """What each of 2 gloo ranks holds after one AdamW step, per variant."""
    out = tmp_path_factory.mktemp("estimate_held")
    specs = {name: {"config": str(configs[model]), "mixed_precision": precision, "strategy": strategy,
                    "offload": offload} for name, (model, precision, strategy, offload) in VARIANTS.items()}
    torchrun("tests/drivers/estimate_held.py", out, json.dumps(specs))
    return {name: [json.loads((out / f"{name}_rank{r}.json").read_text()) for r in range(2)] for name in VARIANTS}


@pytest.mark.parametrize("name", VARIANTS)
def test_sharded_state_equals_the_bytes_the_largest_rank_holds(configs, held, name):
    model_name, precision, strategy, offload = VARIANTS[name]
    config = load_config(str(configs[model_name]))
    model = build_meta_model(config, MASTER_DTYPE[precision])
    saved = measure_activations(config, "bf16", 1, 16, "sdpa")  # activations play no part in these rows
    est = estimate(model, Setting(strategy, False, offload), num_gpus=2, num_nodes=2 if strategy == "HSDP" else 1,
                   mixed_precision=precision, saved=saved)
    ranks = held[name]
    for figure, kind in [(est.params, "params"), (est.grads, "grads"), (est.optimizer, "optimizer_state")]:
        assert figure == max(rank[kind] for rank in ranks) == ranks[0][kind], kind
    full = sum(p.numel() for p in model.parameters()) * MASTER_DTYPE[precision].itemsize
    if strategy == "HSDP":
        assert ranks[0]["mesh"] == [2, 1] and est.params == full
    else:
        # Uneven shards: rank 0 holds the padded size, rank 1 the rest; nothing is lost or duplicated.
        assert ranks[0]["params"] > ranks[1]["params"]
        assert ranks[0]["params"] + ranks[1]["params"] == full


def test_llama_3_1_parameter_counts_equal_the_published_ones(configs):
    # A model folder (as from_pretrained reads it) and a config.json file.
    for model_path, published in [(configs["8b"].parent, 8_030_261_248), (configs["70b"], 70_553_706_496)]:
        model = build_meta_model(load_config(str(model_path)), torch.float32)
        assert sum(p.numel() for p in model.parameters()) == published
        assert all(p.is_meta for p in model.parameters())
    # 8B on 8 GPUs: every dim-0 divides by 8, so each GPU holds exactly an eighth, in fp32 master weights.
    config = load_config(str(configs["8b"]))
    model = build_meta_model(config, torch.float32)
    saved = measure_activations(config, "bf16", 1, 2048, "sdpa")
    est = estimate(model, Setting("FULL_SHARD", False, False), 8, 1, "bf16", saved)
    assert (est.params, est.grads, est.optimizer) == (8_030_261_248 // 2, 8_030_261_248 // 2, 8_030_261_248)
    hsdp = estimate(model, Setting("HSDP", False, False), 16, 2, "bf16", saved)
    assert hsdp.params == est.params  # sharded within a node of 8


# Each family's quirks: GQA, q/k norms (Qwen3, Gemma 3), four norms and soft-capped eager attention (Gemma 2),
# sliding windows (Gemma 3), routed experts (Qwen3-MoE), multi-head latent attention (DeepSeek V3).
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)
# DeepSeek V3's multi-head latent attention: q and k of 16 + 8 per head, v of as many.
DEEPSEEK_V3 = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                   topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16,
                   qk_rope_head_dim=8, v_head_dim=24)
ARCHITECTURES = {
    "llama sdpa": (LlamaConfig(**SMALL), "sdpa"),
    "qwen3 sdpa": (Qwen3Config(**SMALL), "sdpa"),
    "phi3 sdpa": (Phi3Config(**SMALL, pad_token_id=0), "sdpa"),  # fused qkv: v is a view that keeps q and k alive
    # Phi-3.5's long-context rotary embedding, which reads position values in transformers 5.17.
    "phi3 longrope sdpa": (Phi3Config(**SMALL, pad_token_id=0, max_position_embeddings=131072,
                                      original_max_position_embeddings=4096,
                                      rope_scaling={"type": "longrope", "long_factor": [1.5] * 8,
                                                    "short_factor": [1.0] * 8}), "sdpa"),
    "gemma2 eager": (Gemma2Config(**SMALL), "eager"),
    "gemma3 sdpa": (Gemma3TextConfig(**SMALL, sliding_window=32, layer_types=["sliding_attention", "full_attention"]),
                    "sdpa"),
    "qwen3_moe sdpa": (Qwen3MoeConfig(**SMALL, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
                       "sdpa"),
    # Multi-head latent attention (dense layers: the CPU's sdpa runs a fused kernel only for v as wide as q).
    "deepseek_v3 sdpa": (AutoConfig.for_model("deepseek_v3", **dict(DEEPSEEK_V3, first_k_dense_replace=2)), "sdpa"),
    # Its routed experts, whose router's top-k branch of the graph is freed during the forward.
    "deepseek_v3 moe sdpa": (AutoConfig.for_model("deepseek_v3", **DEEPSEEK_V3), "sdpa"),
}


class Saved:
    """A tensor autograd saved, as its graph holds it (weakly referenced to see whether the graph still does)."""
    def __init__(self, tensor):
        self.tensor = tensor


def bytes_autograd_saves_per_layer(config, attn_implementation: str, batch: int, seq_len: int, layout: str
                                   ) -> list[int]:
    """Run the real bf16 model on the CPU (its fused sdpa kernel, or eager) on a packed batch (two examples a row),
    a padded one (the last row half padding) or a full one (no mask), and add up the distinct storages autograd
    saves while each decoder layer runs, parameters excluded."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=attn_implementation)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    layers, running, saves = [m for m in model.modules() if isinstance(m, find_layer_classes(model, None))], [], []
    for index, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda module, args, index=index: running.append(index))
        layer.register_forward_hook(lambda module, args, output: running.clear())

    def pack(tensor):
        packed = Saved(tensor)
        if running:
            saves.append((weakref.ref(packed), running[0]))
        return packed

    inputs = {"input_ids": torch.randint(0, config.vocab_size, (batch, seq_len))}
    if layout == "packed":
        inputs["position_ids"] = torch.arange(seq_len // 2).repeat(batch, 2)
    elif layout == "padded":
        inputs["attention_mask"] = torch.ones(batch, seq_len, dtype=torch.long)
        inputs["attention_mask"][-1, seq_len // 2:] = 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda packed: packed.tensor):
        logits = model(**inputs, use_cache=False).logits  # as in training
    # What the graph still holds once the forward has ended: a MoE router's top-k branch is freed before.
    per_layer, seen = [0] * len(layers), set()
    for ref, index in saves:
        packed = ref()
        pointer = None if packed is None else packed.tensor.untyped_storage().data_ptr()
        if pointer is not None and pointer not in weights and pointer not in seen:
            seen.add(pointer)
            per_layer[index] += packed.tensor.untyped_storage().nbytes()
    del logits
    return per_layer


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_activations_measured_on_the_meta_device_equal_what_autograd_saves(name):
    config, attn_implementation = ARCHITECTURES[name]
    saved = measure_activations(config, "bf16", batch=2, seq_len=64, attn_implementation=attn_implementation)
    packed, padded, full = (bytes_autograd_saves_per_layer(config, attn_implementation, 2, 64, layout)
                            for layout in ("packed", "padded", "full"))
    assert list(saved.per_layer) == list(map(max, packed, full))  # the larger of the two batches measured
    if attn_implementation == "sdpa":  # with the mask: k and v repeated, the mask's bias
        assert all(p > f for p, f in zip(packed, full))
    # A padded batch: without position_ids, one row's rotary tables serve every row (1.3% less here).
    assert all(0 <= measured - real <= 0.02 * real for measured, real in zip(saved.per_layer, padded))
    assert saved.tokens == 128 and saved.layer_input == 128 * 64 * 2  # bf16 hidden states


def test_a_model_that_looks_for_padding_in_its_input_ids_is_measured():
    # GPT-2 with a pad token looks for it in the input ids (to warn of padding without an attention mask), values the
    # meta device lacks: the estimate stopped with "Tensor.item() cannot be called on meta tensors".
    config = GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, pad_token_id=0, attn_pdrop=0.0,
                        resid_pdrop=0.0, embd_pdrop=0.0)  # no dropout: the CPU's sdpa would keep the L x L scores
    saved = measure_activations(config, "bf16", batch=2, seq_len=64, attn_implementation="sdpa")
    real = map(max, *(bytes_autograd_saves_per_layer(config, "sdpa", 2, 64, layout) for layout in ("packed", "full")))
    # Each layer's 2 LayerNorms keep their mean and 1/std per token in fp32 on a GPU (and the meta device), in bf16 on
    # the CPU: 2 x 2 x 2 bytes per token more.
    assert [measured - cpu for measured, cpu in zip(saved.per_layer, real)] == [2 * 2 * 2 * 128] * 2


def test_a_model_that_builds_its_own_attention_mask_is_measured(tmp_path, capsys):
    # BioGPT builds an all-ones attention mask and reads it to skip it, values the meta device lacks: the estimate
    # stopped with "Tensor.item() cannot be called on meta tensors". It declares no _no_split_modules: the layers
    # found are named once, not once per module of each measurement.
    config = BioGptConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    saved = measure_activations(config, "bf16", 2, 64, "sdpa", layer_names=["BioGptDecoderLayer"])
    real = map(max, *(bytes_autograd_saves_per_layer(config, "sdpa", 2, 64, layout) for layout in ("packed", "full")))
    # As GPT-2's above: the LayerNorms' statistics, fp32 on a GPU and the meta device, bf16 on the CPU.
    assert [measured - cpu for measured, cpu in zip(saved.per_layer, real)] == [2 * 2 * 2 * 128] * 2
    capsys.readouterr()
    main(["--model", str(write_config(tmp_path / "biogpt.json", config.to_dict())), "--num_gpus", "2",
          "--seq_len", "64"])
    assert capsys.readouterr().out.count("wrapping: BioGptForCausalLM declares no _no_split_modules") == 1



def test_a_float_mask_that_every_layer_shares_is_counted_once():
    # Falcon-RW's ALiBi reaches sdpa as one bf16 bias of B x heads x L x L that every layer's fused kernel keeps as
    # given; a copy per layer was counted (512 bytes a token more per layer here: 23 GiB for Falcon-RW-1B at 4 x 2048).
    config = AutoConfig.for_model("falcon", vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  alibi=True, new_decoder_architecture=False, multi_query=False, parallel_attn=False)
    saved = measure_activations(config, "bf16", 2, 64, "sdpa")
    real = map(max, *(bytes_autograd_saves_per_layer(config, "sdpa", 2, 64, layout) for layout in ("packed", "full")))
    # As GPT-2's: the 2 LayerNorms' statistics, fp32 on a GPU and the meta device, bf16 on the CPU.
    assert [measured - cpu for measured, cpu in zip(saved.per_layer, real)] == [2 * 2 * 2 * 128] * 2

def test_a_config_without_kv_cache_is_measured_alike():
    # Many fine-tuned checkpoints ship use_cache: false; on the meta device that path read tensor values.
    assert measure_activations(LlamaConfig(**SMALL, use_cache=False), "bf16", 2, 64, "sdpa") == \
        measure_activations(LlamaConfig(**SMALL), "bf16", 2, 64, "sdpa")


def test_moe_activations_follow_the_expert_width_and_eager_attention_its_scores():
    def per_token(config, attn_implementation="sdpa", seq_len=64):
        return measure_activations(config, "bf16", 1, seq_len, attn_implementation).per_layer[0] / seq_len

    # Each token's 2 experts keep gate, up, act(gate) and their product, in bf16: 16 bytes per unit of width.
    moe = dict(SMALL, num_experts=4, num_experts_per_tok=2)
    assert per_token(Qwen3MoeConfig(**moe, moe_intermediate_size=64)) - per_token(
        Qwen3MoeConfig(**moe, moe_intermediate_size=32)) == 2 * 4 * 32 * 2
    # Eager attention keeps each head's fp32 softmax and its bf16 copy: 6 bytes per head per key, on top of sdpa's.
    llama = LlamaConfig(**SMALL)
    eager = per_token(llama, "eager", 128) - per_token(llama, "eager", 64)
    assert eager == 4 * 64 * 6
    # sdpa keeps no scores, only the batch's mask as a bf16 bias (one for all heads): 2 bytes per key.
    assert per_token(llama, "sdpa", 128) - per_token(llama, "sdpa", 64) == 64 * 2


def test_multi_head_latent_attention_keeps_outputs_of_v_width():
    # DeepSeek V3's v narrower than q and k (16 against 16 + 8): 8 fewer columns per head, in bf16, in the
    # up-projected k and v (which v is a view of), in the fused kernel's output (laid out as q, which DeepSeek V3
    # concatenates per head: transformers' transpose then copies it), and in that copy, which o_proj keeps.
    def per_layer(v_head_dim, attn_implementation):
        config = AutoConfig.for_model("deepseek_v3", **dict(DEEPSEEK_V3, first_k_dense_replace=2,
                                                           v_head_dim=v_head_dim))
        return measure_activations(config, "bf16", 2, 64, attn_implementation).per_layer

    for attn_implementation in ("sdpa", "flash_attention_2", "flex_attention"):
        narrow, wide = per_layer(16, attn_implementation), per_layer(24, attn_implementation)
        assert [w - n for w, n in zip(wide, narrow)] == [2 * 64 * 4 * 8 * 2 * 3] * 2


def test_flash_and_flex_keep_no_scores_and_fp32_grouped_query_sdpa_does():
    def per_token(config, attn_implementation, mixed_precision="bf16", seq_len=64):
        return measure_activations(config, mixed_precision, 1, seq_len, attn_implementation).per_layer[0] / seq_len

    llama, gemma2 = LlamaConfig(**SMALL), Gemma2Config(**SMALL)  # 4 query heads, 2 key/value heads
    for attn_implementation in ("flash_attention_2", "flex_attention"):
        # sdpa, given the batch's mask, takes k and v repeated to the 4 query heads (2 more heads x 16 x k and v,
        # in bf16) and keeps the mask as a bf16 bias (2 bytes per key); the rest is the same.
        assert per_token(llama, attn_implementation) == per_token(llama, "sdpa") - 2 * 16 * 2 * 2 - 64 * 2
        # Gemma 2 (soft-capping): no L x L scores, unlike its eager attention.
        assert per_token(gemma2, attn_implementation, seq_len=128) <= per_token(gemma2, attn_implementation)
    assert per_token(gemma2, "eager", seq_len=128) > per_token(gemma2, "eager")
    # fp32 with grouped-query attention, in a batch without a mask: no fused kernel takes it, sdpa's math path keeps
    # one fp32 score per head and key; with as many key/value heads as query heads the memory-efficient kernel
    # keeps none, and a masked batch's fp32 bias (4 bytes per key) is the larger.
    assert per_token(llama, "sdpa", "no", 128) - per_token(llama, "sdpa", "no", 64) == 4 * 64 * 4
    mha = LlamaConfig(**{**SMALL, "num_key_value_heads": 4})
    assert per_token(mha, "sdpa", "no", 128) - per_token(mha, "sdpa", "no", 64) == 64 * 4



def test_a_flash_attention_class_of_the_models_own_is_refused_with_eager_proposed():
    # GPT-Neo picks its flash attention class by name from a table of its own, which has no entry for the estimate's
    # attention function: the estimate stopped with "KeyError: 'fsdp_recipes_estimate_fused'".
    config = GPTNeoConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=64,
                          attention_types=[[["global", "local"], 1]])
    assert config_error(measure_activations, config, "bf16", 2, 64, "flash_attention_2") == (
        "gpt_neo runs flash_attention_2 through an attention class of its own, which the estimate cannot run on the "
        "meta device: estimate it with --attn_implementation eager, an upper bound: eager keeps the L x L scores, "
        "which flash attention does not")
    assert len(measure_activations(config, "bf16", 2, 64, "eager").per_layer) == 2


def test_layers_measured_through_the_pytorch_stand_ins_of_cuda_kernels_are_named(tmp_path, capsys):
    # Mamba's layers call mamba-ssm's and causal-conv1d's CUDA kernels where installed; on the meta device
    # transformers' PyTorch code stands in (Mamba's scan keeps fp32 states per token), and its figure, an upper bound,
    # was printed as measured without a word. Only once a process does transformers say so itself.
    mamba = MambaConfig(vocab_size=128, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4)
    for _ in range(2):
        assert measure_activations(mamba, "bf16", 1, 16, "eager").stand_ins == {"causal_conv1d", "mamba_ssm"}
    main(["--model", str(write_config(tmp_path / "mamba.json", mamba.to_dict())), "--num_gpus", "2", "--seq_len", "16",
          "--attn_implementation", "eager"])
    assert capsys.readouterr().out.startswith(
        "note: the activations are measured through transformers' PyTorch code in place of the CUDA kernels of "
        "causal_conv1d, mamba_ssm, as a GPU without them runs; with those installed, these layers keep less for "
        "backward (Mamba's scan far less): an upper bound\nmodel: MambaForCausalLM, ")
    assert measure_activations(LlamaConfig(**SMALL), "bf16", 1, 16, "sdpa").stand_ins == frozenset()

class PeakBytes(TorchDispatchMode):
    """The most bytes held at once by `held` and by the tensors that the ops run under this mode make, forward and
    backward: each storage counts once, from the op that makes it until it is freed; checked after each op."""

    def __init__(self, *held: torch.Tensor):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.bytes = 0
        self.add(held)

    def add(self, tensors):
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                ref = StorageWeakRef(tensor.untyped_storage())
                self.live[ref.cdata] = (ref, tensor.untyped_storage().nbytes())
        self.live = {key: (ref, size) for key, (ref, size) in self.live.items() if not ref.expired()}
        self.bytes = max(self.bytes, sum(size for _, size in self.live.values()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.add(tree_leaves(out))
        return out


@pytest.mark.parametrize("mixed_precision, reduce_bytes", [("bf16", 4), ("pure_bf16", 2)])
def test_gathered_parameters_and_gradient_buffers_of_uneven_shards(configs, mixed_precision, reduce_bytes):
    # The UNEVEN Llama on 2 GPUs, counted by hand: FSDP2 all-gathers padded shards, so a dim-0 of 101 or 75 rows
    # takes 102 or 76. Root: embed_tokens and lm_head (102 x 40 each), the final norm (40). A layer: q and o (40 x 40),
    # k and v (20 x 40), gate and up (76 x 40), down (40 x 75), two norms (40).
    root = 2 * 102 * 40 + 40
    layer = 2 * 40 * 40 + 2 * 20 * 40 + 2 * 76 * 40 + 40 * 75 + 2 * 40
    config = load_config(str(configs["llama"]))
    saved = measure_activations(config, "bf16", 1, 16, "sdpa")
    est = estimate(build_meta_model(config, MASTER_DTYPE[mixed_precision]), Setting("FULL_SHARD", False, False), 2,
                   1, mixed_precision, saved)
    # bf16 compute: the root and two layers (the running and the prefetched one) gathered; the root's gradient and
    # one layer's, with its reduce-scatter input in fp32 (bf16 mixed precision) or bf16 (pure bf16).
    assert est.gathered == 2 * (root + 2 * layer)
    assert est.grad_buffers == 2 * root + layer * (2 + reduce_bytes)


@pytest.mark.parametrize("softcapping", [None, 30.0])
@pytest.mark.parametrize("mixed_precision", ["bf16", "no"])
def test_logits_and_loss_are_the_peak_of_the_loss_backward(mixed_precision, softcapping):
    config = Gemma2Config(**SMALL, final_logit_softcapping=softcapping)  # a vocabulary of 128
    saved = measure_activations(config, mixed_precision, batch=2, seq_len=64, attn_implementation="eager")
    est = estimate(build_meta_model(config, MASTER_DTYPE[mixed_precision]), Setting("FULL_SHARD", False, False), 8,
                   1, mixed_precision, saved)
    # The trainer's loss on logits in the compute dtype: bf16 logits take 2 + 12 bytes each at the peak, fp32 ones
    # (their own fp32 copy) 4 + 12; soft-capping keeps its tanh's output too.
    c = COMPUTE_DTYPE[mixed_precision].itemsize
    assert est.logits == 2 * 64 * 128 * (c + 12 + (c if softcapping else 0))
    logits = torch.randn(2, 64, 128, dtype=COMPUTE_DTYPE[mixed_precision], requires_grad=True)
    # Soft-capped: the model's output is the capped logits, and the lm_head's output is freed (nothing saves it).
    with PeakBytes(*([] if softcapping else [logits])) as peak:
        capped = torch.tanh(logits / softcapping) * softcapping if softcapping else logits  # as Gemma 2's forward
        token_loss_sum(capped, torch.randint(0, 128, (2, 64))).backward()
    assert est.logits == pytest.approx(peak.bytes, rel=1e-2)  # the rest: the labels, 8 bytes per token


# A multimodal Gemma 4 as on the Hub (no vocab_size of its own): a language model of 2 layers (a sliding and a full
# one, each with its head_dim), and a vision tower of 4 layers, which does not run on text.
GEMMA4_TEXT = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=8,
                   vocab_size_per_layer_input=500)
GEMMA4_MULTIMODAL = Gemma4Config(text_config=GEMMA4_TEXT, audio_config=None,
                                 vision_config=Gemma4VisionConfig(num_hidden_layers=4, hidden_size=32,
                                                                  intermediate_size=64, num_attention_heads=2))


def test_a_multimodal_model_is_estimated_by_its_language_model(tmp_path, capsys):
    saved = measure_activations(GEMMA4_MULTIMODAL, "bf16", batch=1, seq_len=64, attn_implementation="sdpa")
    text = measure_activations(Gemma4TextConfig(**GEMMA4_TEXT), "bf16", 1, 64, "sdpa")
    assert (saved.tokens, saved.per_layer, saved.layer_input) == (text.tokens, text.per_layer, text.layer_input)
    # Trained: the language model's parameters, none of the vision tower's.
    assert {name.replace("model.language_model.", "model.") for name in saved.trained} == text.trained
    assert saved.per_layer == (370_562, 462_850) and saved.layer_input == 64 * 64 * 2
    model = build_meta_model(GEMMA4_MULTIMODAL, torch.float32)
    est = estimate(model, Setting("FULL_SHARD", True, False), 2, 1, "bf16", saved)
    # Checkpointed: the inputs of the 2 language model layers, and the larger one recomputed; the logits over the
    # language model's vocabulary of 1000.
    assert est.activations == 2 * 64 * 64 * 2 + 462_850
    assert est.logits == 64 * 1000 * (2 + 12)
    # Gathered in bf16, on 1 GPU (no padding): the root and the language model's layers, never the vision tower's
    # (its patch embedder, a unit of 679,936 parameters, is 13 times the largest language model layer).
    _, root = fsdp_groups(model)
    text_layers = [sum(p.numel() for p in layer.parameters()) for layer in model.model.language_model.layers]
    for strategy, kept in [("FULL_SHARD", 2 * max(text_layers)), ("SHARD_GRAD_OP", sum(text_layers))]:
        one_gpu = estimate(model, Setting(strategy, False, False), 1, 1, "bf16", saved)
        assert one_gpu.gathered == 2 * (sum(p.numel() for p in root) + kept)
        # Gradient buffers: the language model's part of the root (not the vision embedder's projection, which
        # gets no gradient), and the largest language model layer's, in bf16 with its fp32 reduce-scatter input.
        text_root = sum(p.numel() for name, p in model.named_parameters()
                        if any(p is q for q in root) and name.startswith("model.language_model."))
        assert text_root < sum(p.numel() for p in root)
        assert one_gpu.grad_buffers == 2 * text_root + (2 + 4) * max(text_layers)
        # fp32 master weights of the whole model, towers included (1,098,856 parameters); gradients and AdamW's two
        # states of the language model's 161,896 alone, which the text forward uses.
        assert (one_gpu.params, one_gpu.grads, one_gpu.optimizer) == (4 * 1_098_856, 4 * 161_896, 8 * 161_896)
        assert sum(p.numel() for name, p in model.named_parameters()
                   if name.startswith("model.language_model.")) == 161_896
    main(["--model", str(write_config(tmp_path / "gemma4.json", GEMMA4_MULTIMODAL.to_dict())), "--num_gpus", "2",
          "--seq_len", "64", "--batch", "1", "--activation_checkpointing"])
    total = sum(p.numel() for p in model.parameters())
    assert capsys.readouterr().out.startswith(
        f"model: Gemma4ForConditionalGeneration, {total:,} parameters, 2 decoder layers\n")


def test_a_model_with_its_own_code_is_estimated_with_trust_remote_code(tmp_path, capsys):
    llama = write_config(tmp_path / "llama.json", LlamaConfig(**SMALL).to_dict())
    own_code = tmp_path / "estimate_own_code"  # the folder names the module transformers imports the code as
    own_code.mkdir()
    (own_code / "configuration_foo.py").write_text(REMOTE_CONFIG)
    (own_code / "modeling_foo.py").write_text(REMOTE_MODEL)
    write_config(own_code / "config.json", {
        **LlamaConfig(**SMALL).to_dict(), "model_type": "foo", "architectures": ["FooForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_foo.FooConfig",
                     "AutoModelForCausalLM": "modeling_foo.FooForCausalLM"}})
    with pytest.raises(ConfigError) as error:
        main(["--model", str(own_code), "--num_gpus", "2"])
    assert str(error.value) == (f"--model {own_code} ships its own model code: pass --trust_remote_code to run it, "
                                f"as the recipe key trust_remote_code: true does")
    main(["--model", str(own_code), "--num_gpus", "2", "--seq_len", "64", "--trust_remote_code"])
    own_report = capsys.readouterr().out
    main(["--model", str(llama), "--num_gpus", "2", "--seq_len", "64"])
    # A Llama under another name: the same report but for the name.
    assert own_report == capsys.readouterr().out.replace("model: LlamaForCausalLM, ", "model: FooForCausalLM, ")


@pytest.fixture(scope="module")
def llama_70b(configs):
    """Llama 3.1 70B on the meta device, and what a micro-batch of 4 x 2048 tokens saves for backward."""
    config = load_config(str(configs["70b"]))
    return build_meta_model(config, torch.float32), measure_activations(config, "bf16", 4, 2048, "sdpa")


def test_70b_needs_offload_on_8_gpus_and_nothing_fits_on_2(configs, llama_70b):
    model, saved = llama_70b
    args = parse_args(["--model", str(configs["70b"]), "--num_gpus", "8"])
    # fp32 weights, gradients and two Adam states: 16 bytes per parameter, in the CPU RAM of the node's 8 GPUs.
    assert recommend(model, args, saved).startswith(
        "recommended: FULL_SHARD with activation checkpointing and CPU offload")
    assert f"and {16 * 70_553_706_496 / 2**30:.1f} GiB of CPU RAM per node" in recommend(model, args, saved)
    # With offload, what stays on a GPU does not depend on the number of GPUs: more of them would not help.
    for gpus in (2, 64):
        args = parse_args(["--model", str(configs["70b"]), "--num_gpus", str(gpus), "--gpu_memory", "24"])
        cheapest = estimate(model, Setting("FULL_SHARD", True, True), gpus, 1, "bf16", saved)
        assert recommend(model, args, saved) == (
            f"nothing fits in 24 GiB per GPU on {gpus} GPUs: even with activation checkpointing and CPU offload, a GPU "
            f"holds {cheapest.gpu_total / 2**30:.1f} GiB, more than the 21.6 usable (90%), that more GPUs do not "
            f"shrink (activations "
            f"{cheapest.activations / 2**30:.1f}, logits and loss {cheapest.logits / 2**30:.1f}, gathered layers and "
            f"their gradients {(cheapest.gathered + cheapest.grad_buffers) / 2**30:.1f}): lower --batch or --seq_len, "
            f"which activations and logits grow with")
        assert cheapest.gpu_total > 24 * 2**30 and cheapest.logits > 10 * 2**30


def test_a_setting_fits_in_90_percent_of_the_gpu_and_the_cheapest_that_fits_is_proposed(configs):
    # Llama 3.1 8B on 8 GPUs at 4 x 2048 tokens (the README's example), with GPU sizes placed around its totals.
    config = load_config(str(configs["8b"]))
    model, saved = build_meta_model(config, torch.float32), measure_activations(config, "bf16", 4, 2048, "sdpa")

    def total(strategy, activation_checkpointing, offload):
        return estimate(model, Setting(strategy, activation_checkpointing, offload), 8, 1, "bf16", saved).gpu_total

    def proposal(gpu_memory):
        args = parse_args(["--model", str(configs["8b"]), "--num_gpus", "8", "--gpu_memory", repr(gpu_memory)])
        return recommend(model, args, saved)

    plain = total("FULL_SHARD", False, False)
    assert total("SHARD_GRAD_OP", False, False) > plain / 0.89 * 0.9  # fits in none of the GPUs below
    # 95% of the GPU is more than the 90% a setting may take: not proposed; in 89%, it is.
    assert proposal(plain / 0.95 / 2**30).startswith("recommended: SHARD_GRAD_OP with activation checkpointing: ")
    assert proposal(plain / 0.89 / 2**30).startswith(
        "recommended: FULL_SHARD without activation checkpointing or offload: ")
    # A GPU in which both activation checkpointing and offload fit (but neither alone nor FULL_SHARD without
    # either): checkpointing, which costs compute only, before offload, which moves every step over PCIe.
    offloaded = total("SHARD_GRAD_OP", False, True)
    between = (offloaded + plain) / 2 / 0.9 / 2**30
    assert offloaded < plain and total("SHARD_GRAD_OP", True, False) < offloaded
    assert proposal(between).startswith("recommended: SHARD_GRAD_OP with activation checkpointing: ")


def test_offload_on_2_nodes_needs_a_whole_replica_per_node_for_hsdp(configs, llama_70b, capsys):
    # 16 bytes per parameter (fp32 weights, gradients, two Adam states) in the CPU RAM of a node's 8 GPUs: HSDP
    # holds a whole replica on each node, FULL_SHARD and SHARD_GRAD_OP half of the model (sharded over 16 GPUs).
    main(["--model", str(configs["8b"]), "--num_gpus", "16", "--num_nodes", "2", "--offload"])
    rows = {line[:36].strip(): line[36:].split() for line in capsys.readouterr().out.splitlines()}
    assert rows["parameters (exact, CPU)"] == [f"{4 * 8_030_261_248 / d / 2**30:.2f}" for d in (16, 16, 8)]
    assert rows["CPU RAM per node (offloaded state)"] == [f"{16 * 8_030_261_248 / d / 2**30:.2f}" for d in (2, 2, 1)]
    # 70B on 2 nodes x 8 GPUs of 80 GiB: offloaded, HSDP first (its all-gathers stay within a node).
    model, saved = llama_70b
    args = parse_args(["--model", str(configs["70b"]), "--num_gpus", "16", "--num_nodes", "2"])
    assert recommend(model, args, saved).startswith(
        "recommended: HSDP with activation checkpointing and CPU offload: ")
    assert f"and {16 * 70_553_706_496 / 2**30:.1f} GiB of CPU RAM per node" in recommend(model, args, saved)


def plan_under_launch_node(recipe_keys: str, tmp_path, monkeypatch):
    """The plan, mesh included, that a recipe config holding `recipe_keys` (as the estimate prints them) gets on
    2 nodes x 8 GPUs under slurm/launch_node.sh, which sets accelerate's dp_replicate_size to the node count."""
    for key, value in launch_node_env(tmp_path, nnodes=2, gpus_per_node=8).items():
        monkeypatch.setenv(key, value)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("\n".join(recipe_keys.split(", ")))
    plan = resolve_plan(parse_config(["--config", str(recipe), "--model_name_or_path", "m", "--dataset_name", "d"]))
    with process_group_of(16):
        build_mesh(plan, torch.device("cpu"))
    return plan


def test_70b_on_2_nodes_gets_full_shard_over_all_16_gpus(configs, llama_70b, tmp_path, monkeypatch):
    """HSDP 2 x 8 does not fit in 141 GiB; the FULL_SHARD proposed must not become it under the launcher."""
    args = parse_args(["--model", str(configs["70b"]), "--num_gpus", "16", "--num_nodes", "2", "--gpu_memory", "141"])
    model, saved = llama_70b
    proposal = recommend(model, args, saved)
    assert proposal.startswith("recommended: FULL_SHARD with activation checkpointing: ")
    [keys] = re.findall(r"\(recipe config: (.*)\)$", proposal)
    assert keys == ("fsdp_version: 2, fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP, fsdp_reshard_after_forward: true, "
                    "dp_replicate_size: 1, fsdp_activation_checkpointing: true, fsdp_offload_params: false, "
                    "gradient_sync: every_micro_batch, mixed_precision: bf16, per_device_train_batch_size: 4, "
                    "max_seq_length: 2048, attn_implementation: sdpa")
    plan = plan_under_launch_node(keys, tmp_path, monkeypatch)
    assert plan.mesh_shape == (16,) and plan.reshard_after_forward and plan.activation_checkpointing
    assert plan.mixed_precision == "bf16"
    assert "dp_replicate_size: recipe config 1 overrides accelerate config 2" in plan.overrides


@pytest.mark.parametrize("strategy, mesh", [("FULL_SHARD", (16,)), ("SHARD_GRAD_OP", (16,)), ("HSDP", (2, 8))])
def test_recipe_keys_on_2_nodes_shard_as_estimated_under_the_launcher(tmp_path, monkeypatch, strategy, mesh):
    # The estimate shards HSDP over the 8 GPUs of a node, FULL_SHARD and SHARD_GRAD_OP over all 16.
    plan = plan_under_launch_node(Setting(strategy, False, True).recipe_keys(2), tmp_path, monkeypatch)
    assert plan.mesh_shape == mesh
    assert plan.reshard_after_forward == (strategy != "SHARD_GRAD_OP") and plan.offload_params
    assert not plan.activation_checkpointing  # said explicitly: a recipe YAML's true would not fit the estimate


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_recipe_keys_under_an_fsdp1_accelerate_config_run_fsdp2_as_estimated(tmp_path, monkeypatch, strategy):
    # The estimate models FSDP2: its keys choose it over fsdp1.yaml (and over accelerate's default, 1), where
    # fsdp_reshard_after_forward alone was refused as an FSDP2 setting.
    for key, value in launched_env("fsdp1.yaml").items():
        monkeypatch.setenv(key, value)
    (tmp_path / "recipe.yaml").write_text("\n".join(Setting(strategy, True, False).recipe_keys(1).split(", ")))
    plan = resolve_plan(parse_config(["--config", str(tmp_path / "recipe.yaml"), "--model_name_or_path", "m",
                                      "--dataset_name", "d"]))
    assert (plan.fsdp_version, plan.sharding_strategy, plan.activation_checkpointing) == (2, strategy, True)
    assert plan.overrides[0] == "fsdp_version: recipe config 2 overrides accelerate config 1"


def test_recipe_keys_override_a_recipe_configs_settings_the_estimate_does_not_model(tmp_path):
    # A copied recipe YAML with size-based units and full gradients held between micro-batches, the keys given on
    # the command line: the run is the one estimated.
    (tmp_path / "recipe.yaml").write_text("fsdp_auto_wrap_policy: SIZE_BASED_WRAP\ngradient_sync: last_micro_batch\n"
                                          "gradient_accumulation_steps: 4\n")
    keys = [f"--{key}={value}" for key, value in (pair.split(": ") for pair in
                                                  Setting("FULL_SHARD", False, False).recipe_keys(1).split(", "))]
    plan = resolve_plan(parse_config(["--config", str(tmp_path / "recipe.yaml"), "--model_name_or_path", "m",
                                      "--dataset_name", "d", *keys]))
    assert (plan.fsdp_version, plan.auto_wrap_policy, plan.gradient_sync) == (2, "TRANSFORMER_BASED_WRAP",
                                                                             "every_micro_batch")


def test_recipe_keys_on_one_node_override_a_recipe_configs_replicas(tmp_path, monkeypatch):
    # A copied recipe YAML that runs HSDP within a node (2 replicas of 4 GPUs): the one-node proposal, estimated
    # sharded over all 8 GPUs, gives the replica count as every other setting it assumes.
    monkeypatch.setenv("WORLD_SIZE", "8")
    (tmp_path / "recipe.yaml").write_text("dp_replicate_size: 2\n")
    keys = [f"--{key}={value}" for key, value in (pair.split(": ") for pair in
                                                  Setting("FULL_SHARD", False, False).recipe_keys(1).split(", "))]
    plan = resolve_plan(parse_config(["--config", str(tmp_path / "recipe.yaml"), "--model_name_or_path", "m",
                                      "--dataset_name", "d", *keys]))
    assert plan.dp_replicate_size == 1


def test_recipe_keys_of_every_precision_read_back_as_a_recipe_config(configs, llama_70b, tmp_path):
    model, saved = llama_70b
    for precision in ("bf16", "no", "pure_bf16"):
        args = parse_args(["--model", str(configs["70b"]), "--num_gpus", "64", "--gpu_memory", "141",
                           "--mixed_precision", precision])
        [keys] = re.findall(r"\(recipe config: (.*)\)$", recommend(model, args, saved))
        (tmp_path / "recipe.yaml").write_text("\n".join(keys.split(", ")))
        cfg = parse_config(["--config", str(tmp_path / "recipe.yaml"), "--model_name_or_path", "m", "--dataset_name",
                            "d"])
        assert (cfg.mixed_precision, cfg.per_device_train_batch_size, cfg.max_seq_length) == (precision, 4, 2048)


def test_bad_input_is_one_clear_line(tmp_path):
    gemma2 = write_config(tmp_path / "gemma2.json", Gemma2Config(**SMALL).to_dict())
    with pytest.raises(ConfigError) as error:
        main(["--model", str(gemma2), "--num_gpus", "8"])
    assert str(error.value) == ("gemma2 needs attention with soft-capping: pass --attn_implementation eager or "
                                "flash_attention_2 or flex_attention (see fsdp_recipes/families.py), not sdpa")
    # A model class without sdpa, the default: one line, not from_config's traceback with advice for Python code.
    bloom = write_config(tmp_path / "bloom.json", AutoConfig.for_model("bloom", n_embed=32, n_layer=1).to_dict())
    with pytest.raises(ConfigError, match="^BloomForCausalLM does not implement attn_implementation sdpa: set "
                                          "attn_implementation to one it does"):
        main(["--model", str(bloom), "--num_gpus", "8"])
    moe = write_config(tmp_path / "qwen3_moe.json", ARCHITECTURES["qwen3_moe sdpa"][0].to_dict())
    with pytest.raises(ConfigError) as error:
        main(["--model", str(moe), "--num_gpus", "8", "--mixed_precision", "no"])
    assert str(error.value) == ("the activations are measured through transformers' grouped_mm experts, which take "
                                "bf16 only: estimate qwen3_moe with --mixed_precision bf16 or pure_bf16")
    t5 = write_config(tmp_path / "t5.json", T5Config(d_model=32, num_layers=1, num_heads=2, d_ff=64).to_dict())
    with pytest.raises(ConfigError, match=f"^--model {t5} is a t5 model, which AutoModelForCausalLM does not load"):
        main(["--model", str(t5), "--num_gpus", "8"])
    for memory in ("nan", "inf", "0"):
        with pytest.raises(ConfigError, match=f"^--gpu_memory must be a positive number \\(GiB per GPU\\), got "
                                              f"{memory}$"):
            parse_args(["--model", "x", "--num_gpus", "8", "--gpu_memory", memory])
    for name in ("num_gpus", "num_nodes", "seq_len", "batch"):  # a count of 0 would divide by zero or plan nothing
        with pytest.raises(ConfigError, match=f"^--{name} must be at least 1, got 0$"):
            parse_args(["--model", "x", "--num_gpus", "8", f"--{name}", "0"])
    with pytest.raises(ConfigError, match="--num_gpus 6 is not divisible by --num_nodes 4"):
        parse_args(["--model", "x", "--num_gpus", "6", "--num_nodes", "4"])
    proc = run([sys.executable, "-m", "fsdp_recipes.estimate", "--model", "no/such/dir/config.json",
                "--num_gpus", "8"], expect_rc=2)
    assert proc.stderr == (f"error: --model no/such/dir/config.json: no such file or folder in {REPO}; give a hub "
                           f"id, a model folder or a config.json\n")
    # A run's output_dir has no config.json: transformers' error would ask for a model_type key in it.
    (tmp_path / "run" / "final").mkdir(parents=True)
    with pytest.raises(ConfigError) as error:
        main(["--model", str(tmp_path / "run"), "--num_gpus", "8"])
    assert str(error.value) == (f"--model {tmp_path}/run is a folder without config.json: give a model folder "
                                f"(config.json beside the weights) or a config.json")
    write_config(tmp_path / "run" / "final" / "config.json", ARCHITECTURES["llama sdpa"][0].to_dict())
    with pytest.raises(ConfigError) as error:
        main(["--model", str(tmp_path / "run"), "--num_gpus", "8"])
    assert str(error.value).endswith(f"or a config.json, such as this run's export {tmp_path}/run/final")


def test_a_flash_kernel_in_fp32_is_refused_as_the_run_refuses_it():
    # The run stops at start (plan.resolve_plan): the kernel takes bf16 or fp16 only.
    for parse in (lambda *args: parse_args(["--model", "x", "--num_gpus", "8", *args]),
                  lambda *args: resolve_plan(parse_config(["--model_name_or_path", "m", "--dataset_name", "d", *args]))):
        with pytest.raises(ConfigError) as error:
            parse("--attn_implementation", "flash_attention_2", "--mixed_precision", "no")
        assert str(error.value) == ("attn_implementation flash_attention_2 computes in bf16 or fp16 only, and "
                                    "mixed_precision no runs the model in fp32: use mixed_precision bf16 (fp32 master "
                                    "weights, bf16 compute), or attn_implementation sdpa")
    assert parse_args(["--model", "x", "--num_gpus", "8", "--attn_implementation", "flash_attention_2"]
                      ).mixed_precision == "bf16"


def test_a_sequence_beyond_the_position_table_is_refused_and_beyond_the_rotary_context_warned(tmp_path, capsys):
    # GPT-2's learned positions have no row past n_positions (the run refuses such a max_seq_length at start).
    gpt2 = write_config(tmp_path / "gpt2.json", GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=2,
                                                           n_positions=32, bos_token_id=0, eos_token_id=0).to_dict())
    with pytest.raises(ConfigError) as error:
        main(["--model", str(gpt2), "--num_gpus", "2", "--seq_len", "33"])
    assert str(error.value) == ("--seq_len 33 is longer than the model's position table (32 positions): set --seq_len "
                                "32 or less")
    main(["--model", str(gpt2), "--num_gpus", "2", "--seq_len", "32"])
    assert capsys.readouterr().out.startswith("model: GPT2LMHeadModel, ")
    # Rotary positions: beyond the trained context is estimated, with the run's warning.
    llama = write_config(tmp_path / "llama.json", LlamaConfig(**SMALL, max_position_embeddings=32).to_dict())
    main(["--model", str(llama), "--num_gpus", "2", "--seq_len", "64"])
    assert capsys.readouterr().out.startswith(
        "warning: --seq_len 64 is longer than the 32 positions the model was trained for (max_position_embeddings, "
        "with its rope scaling): it has never seen the positions beyond; to extend its context, add rope scaling "
        "(e.g. YaRN) to its config.json\nmodel: LlamaForCausalLM, ")


def config_error(function, *args) -> str | None:
    try:
        function(*args)
    except ConfigError as error:
        return str(error)
    return None



def test_alibi_falcon_with_flash_attention_is_refused_as_the_run_refuses_it(tmp_path):
    # Falcon-RW's ALiBi is added to the attention mask, which flash attention does not take: the estimate stopped with
    # "AttributeError: 'NoneType' object has no attribute 'dtype'", and the run stops at its first forward, once the
    # model is loaded. Both now refuse it at start.
    falcon = AutoConfig.for_model("falcon", vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  alibi=True, new_decoder_architecture=False, multi_query=True, parallel_attn=True)
    falcon.save_pretrained(tmp_path / "falcon")
    estimate_refusal = config_error(main, ["--model", str(tmp_path / "falcon"), "--num_gpus", "2", "--seq_len", "64",
                                           "--attn_implementation", "flash_attention_2"])
    assert estimate_refusal == ("falcon needs attention with ALiBi: pass --attn_implementation eager or sdpa (see "
                                "fsdp_recipes/families.py), not flash_attention_2")
    run = ["--config", "recipes/configs/sft.yaml", "--model_name_or_path", str(tmp_path / "falcon"), "--dataset_name",
           "d", "--attn_implementation", "flash_attention_2"]
    assert config_error(check_model_type, parse_config(run), None, "recipes/sft.py") == (
        "falcon models need attn_implementation eager or sdpa (see fsdp_recipes/families.py: attention ALiBi), got "
        "flash_attention_2")
    assert config_error(main, ["--model", str(tmp_path / "falcon"), "--num_gpus", "2", "--seq_len", "64"]) is None
    # Falcon without ALiBi (Falcon-7B's rotary positions) takes flash attention, in the run as in the estimate.
    falcon.alibi = False
    falcon.save_pretrained(tmp_path / "rotary_falcon")
    run[3] = str(tmp_path / "rotary_falcon")
    assert config_error(check_model_type, parse_config(run), None, "recipes/sft.py") is None

def test_pure_bf16_is_refused_for_a_weight_kept_in_fp32_as_the_run_refuses_it(tmp_path):
    config = AutoConfig.for_model("deepseek_v3", **DEEPSEEK_V3)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "deepseek")
    # The run's check, on the model as it loads it: the router's gate.weight in fp32 (transformers 5.24 and later;
    # 5.17 keeps only the router's bias, a buffer, which pure_bf16 does not train).
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "deepseek", dtype=torch.bfloat16)
    kept = [name for name, p in loaded.named_parameters() if p.dtype == torch.float32]
    pure = parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--mixed_precision", "pure_bf16"])
    run_refusal = config_error(check_master_dtype, loaded, resolve_plan(pure))
    estimate_refusal = config_error(main, ["--model", str(tmp_path / "deepseek"), "--num_gpus", "2", "--seq_len",
                                           "16", "--mixed_precision", "pure_bf16"])
    assert estimate_refusal == run_refusal
    assert run_refusal == (kept and f"{kept[0]} is kept in fp32 by deepseek_v3 models (transformers' "
                                    f"_keep_in_fp32_modules_strict), and mixed_precision pure_bf16 holds every weight "
                                    f"in torch.bfloat16: use mixed_precision bf16 (fp32 master weights, bf16 compute)"
                           or None)


@pytest.mark.parametrize("model_type, part", [("llama4", "Llama4ForCausalLM"), ("qwen3_5", "Qwen3_5ForCausalLM")])
def test_a_model_loaded_in_part_is_refused_as_the_run_refuses_it(tmp_path, model_type, part):
    # AutoModelForCausalLM builds the text model alone from these multimodal configs: the run refuses them at start.
    config = AutoConfig.for_model(model_type)
    config.save_pretrained(tmp_path / model_type)
    with pytest.raises(ConfigError) as error:
        main(["--model", str(tmp_path / model_type), "--num_gpus", "8"])
    text_type = config.get_text_config().model_type
    assert str(error.value) == (
        f"--model {tmp_path / model_type} is a {model_type} model, of which AutoModelForCausalLM loads the {part} part "
        f"alone: the run would train and export it without the rest of the checkpoint (its vision or audio model). "
        f"Not supported: train a model that AutoModelForCausalLM loads whole, such as a checkpoint of that part alone "
        f"(model_type {text_type})")
    run = parse_config(["--model_name_or_path", str(tmp_path / model_type), "--dataset_name", "d"])
    with pytest.raises(ConfigError) as run_error:
        check_model_type(run, None, "recipes/sft.py")
    assert str(run_error.value) == str(error.value).removeprefix("--model ")


def test_readme_example_prints_the_output_the_readme_shows(configs):
    readme = (REPO / "README.md").read_text()
    command, shown = re.search(r"```bash\n(python -m fsdp_recipes\.estimate [^\n]*)\n```\n\n```text\n(.*?)```",
                               readme, flags=re.S).groups()
    args = shlex.split(command)
    assert args[3:5] == ["--model", "meta-llama/Llama-3.1-8B"]
    args[4] = str(configs["8b"])  # no Hub here: the published config.json, written locally
    proc = run([sys.executable, *args[1:]])
    assert proc.stdout == shown
    assert "recommended: " in proc.stdout


def test_a_recipe_config_is_estimated_as_the_run_it_describes(tmp_path, capsys):
    """--config reads the YAML as the recipe does, its built-in defaults where the YAML leaves a key out; a flag
    overrides it; a setting the estimate does not model is named."""
    model = write_config(tmp_path / "llama.json", LlamaConfig(**SMALL).to_dict())
    yaml = tmp_path / "run.yaml"
    yaml.write_text(f"model_name_or_path: {model}\ndataset_name: null\nper_device_train_batch_size: 2\n"
                    f"mixed_precision: 'no'\nattn_implementation: eager\nfsdp_activation_checkpointing: true\n")
    flags = ["--model", str(model), "--batch", "2", "--seq_len", "1024", "--mixed_precision", "no",
             "--attn_implementation", "eager", "--activation_checkpointing"]  # max_seq_length: the recipe's 1024
    outputs = []
    for argv in (["--config", str(yaml)], flags):
        main([*argv, "--num_gpus", "2"])
        outputs.append(capsys.readouterr().out)
    from_config, from_flags = outputs
    assert from_config == from_flags
    assert "micro-batch per GPU: 2 x 1024 tokens, activation checkpointing on, offload off, eager" in from_config

    # The recipe's built-in defaults for what a YAML leaves out.
    (tmp_path / "model_only.yaml").write_text(f"model_name_or_path: {model}\n")
    args = parse_args(["--config", str(tmp_path / "model_only.yaml"), "--num_gpus", "2"])
    assert (args.batch, args.seq_len, args.mixed_precision, args.activation_checkpointing) == (1, 1024, "bf16", False)

    main(["--config", str(yaml), "--num_gpus", "2", "--seq_len", "64", "--no-activation_checkpointing"])
    assert "micro-batch per GPU: 2 x 64 tokens, activation checkpointing off, offload off, eager" in \
        capsys.readouterr().out

    # Offload from the YAML's fsdp_offload_params, turned off by --no-offload; the size-based wrap is named.
    (tmp_path / "offload.yaml").write_text(f"model_name_or_path: {model}\nfsdp_offload_params: true\n"
                                           f"fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n")
    args = parse_args(["--config", str(tmp_path / "offload.yaml"), "--num_gpus", "2"])
    assert args.offload and args.notes == [
        f"note: {tmp_path}/offload.yaml sets fsdp_auto_wrap_policy: SIZE_BASED_WRAP, which the estimate does not "
        f"model: the figures are for one unit per decoder layer"]
    assert not parse_args(["--config", str(tmp_path / "offload.yaml"), "--num_gpus", "2", "--no-offload"]).offload

    with yaml.open("a") as f:
        f.write("fsdp_version: 1\ngradient_sync: last_micro_batch\ngradient_accumulation_steps: 2\n")
    main(["--config", str(yaml), "--num_gpus", "2"])
    assert capsys.readouterr().out.startswith(
        f"note: {yaml} sets fsdp_version: 1, which the estimate does not model: the figures are for FSDP2\n"
        f"note: {yaml} sets gradient_sync: last_micro_batch, which the estimate does not model: the figures are for "
        f"gradient_sync every_micro_batch\nmodel: LlamaForCausalLM, ")


def test_a_recipe_configs_layer_classes_are_the_units_estimated(tmp_path, capsys):
    """fsdp_transformer_layer_cls_to_wrap, from the YAML or as a flag, chooses the units the estimate gathers and
    measures, and is given back in the recommendation; torch_compile, not modelled, is named."""
    model = write_config(tmp_path / "llama.json", LlamaConfig(**SMALL).to_dict())
    yaml = tmp_path / "run.yaml"
    yaml.write_text(f"model_name_or_path: {model}\nfsdp_transformer_layer_cls_to_wrap: LlamaMLP\ntorch_compile: true\n")
    outputs = []
    for argv in (["--config", str(yaml)], ["--model", str(model), "--seq_len", "1024", "--batch", "1",
                                           "--fsdp_transformer_layer_cls_to_wrap", "LlamaMLP"],
                 ["--model", str(model), "--seq_len", "1024", "--batch", "1"]):
        main([*argv, "--num_gpus", "2"])
        outputs.append(capsys.readouterr().out)
    from_config, from_flag, decoder_layers = outputs
    assert from_config == (f"note: {yaml} sets torch_compile: true, which the estimate does not model: the figures "
                           f"are for layers run without torch.compile, which often saves less for backward\n"
                           + from_flag)
    assert from_flag != decoder_layers
    assert "attn_implementation: sdpa, fsdp_transformer_layer_cls_to_wrap: LlamaMLP)" in from_flag
    assert "fsdp_transformer_layer_cls_to_wrap" not in decoder_layers
    # Each MLP is a unit: 3 x 64 x 96 weights; the attention and norms join the embeddings in the root.
    meta = build_meta_model(LlamaConfig(**SMALL), torch.float32)
    layers, root = fsdp_groups(meta, ["LlamaMLP"])
    assert [sum(p.numel() for p in layer) for layer in layers] == [3 * 64 * 96] * 2
    assert sum(p.numel() for p in root) == sum(p.numel() for p in meta.parameters()) - 2 * 3 * 64 * 96
    with pytest.raises(ConfigError, match="^fsdp_transformer_layer_cls_to_wrap names Nope, which is not a module "
                                          "class of LlamaForCausalLM"):
        main(["--model", str(model), "--num_gpus", "2", "--fsdp_transformer_layer_cls_to_wrap", "Nope"])
    # The table, and what a GPU holds when nothing fits, are of the units named. 8 layers of 41.9M attention and
    # 12.6M MLP weights: FULL_SHARD gathers the root and 2 units, (1.05M + 8 x 41.9M + 2 x 12.6M) x 2 bytes = 0.67 GiB
    # with MLP units (the attention joins the root), (1.05M + 2 x 54.5M) x 2 = 0.21 GiB with decoder layers; and
    # checkpointing recomputes the MLPs only, not the attention's activations.
    big = write_config(tmp_path / "big.json", LlamaConfig(vocab_size=128, hidden_size=4096, intermediate_size=1024,
                                                          num_hidden_layers=8, num_attention_heads=32,
                                                          num_key_value_heads=8, head_dim=128).to_dict())
    reports = []
    for units in (["--fsdp_transformer_layer_cls_to_wrap", "LlamaMLP"], []):
        main(["--model", str(big), "--seq_len", "64", "--batch", "1", "--num_gpus", "2", "--gpu_memory", "0.1",
              "--activation_checkpointing", *units])
        reports.append(capsys.readouterr().out.splitlines())
    mlp_units, layer_units = reports
    assert "gathered parameters (estimate)                 0.67           0.81           0.67" in mlp_units
    assert "gathered parameters (estimate)                 0.21           0.81           0.21" in layer_units
    assert "activations (measured)                         0.05           0.05           0.05" in mlp_units
    assert "activations (measured)                         0.01           0.01           0.01" in layer_units
    assert "a GPU holds 1.4 GiB" in mlp_units[-1] and "a GPU holds 0.5 GiB" in layer_units[-1]
    # As the recipe reads the key: a space after a comma is no part of a name.
    assert parse_args(["--model", str(big), "--num_gpus", "2", "--fsdp_transformer_layer_cls_to_wrap",
                       "LlamaMLP, LlamaAttention"]).layer_names == ["LlamaMLP", "LlamaAttention"]


def test_what_the_decoder_layers_save_outside_their_units_is_measured():
    """With fsdp_transformer_layer_cls_to_wrap LlamaMLP, only what the MLPs saved was counted: the attention's
    activations, most of each layer's, were left out of every estimate (0.00 GiB for a run that needs 0.01)."""
    config = LlamaConfig(**SMALL)
    layers = measure_activations(config, "bf16", batch=2, seq_len=64, attn_implementation="sdpa")
    mlps = measure_activations(config, "bf16", batch=2, seq_len=64, attn_implementation="sdpa",
                               layer_names=["LlamaMLP"])
    # Each MLP keeps its bf16 input (64 per token) and 4 of its 96-wide intermediates: 896 bytes per token.
    assert (mlps.per_layer, mlps.layer_input) == ((128 * 896,) * 2, 128 * 64 * 2)
    assert layers.outside == 0 and mlps.outside == sum(layers.per_layer) - 2 * 128 * 896 == 407552
    model = build_meta_model(config, torch.float32)
    off, on = (estimate(model, Setting("FULL_SHARD", checkpointing, False), 2, 1, "bf16", mlps, ["LlamaMLP"])
               .activations for checkpointing in (False, True))
    assert off == sum(layers.per_layer)  # the same tensors, whichever units
    # Checkpointing recomputes the MLPs (their inputs kept, one recomputed at a time), not the attention.
    assert on == mlps.outside + 2 * 128 * 64 * 2 + 128 * 896



def test_the_decoder_layers_of_a_class_not_named_as_units_are_measured():
    """With fsdp_transformer_layer_cls_to_wrap JambaAttentionDecoderLayer, Jamba's Mamba layers (the root unit's)
    were left out of every estimate: 84% of its activations here."""
    config = AutoConfig.for_model("jamba", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
                                  attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8,
                                  mamba_dt_rank=8)
    mamba, attention = measure_activations(config, "bf16", 2, 64, "sdpa").per_layer
    named = measure_activations(config, "bf16", 2, 64, "sdpa", layer_names=["JambaAttentionDecoderLayer"])
    assert (named.per_layer, named.outside) == ((attention,), mamba) and mamba > 3 * attention
    model = build_meta_model(config, torch.float32)
    off, on = (estimate(model, Setting("FULL_SHARD", checkpointing, False), 2, 1, "bf16", named,
                        ["JambaAttentionDecoderLayer"]).activations for checkpointing in (False, True))
    # Checkpointing recomputes the attention layer (its input kept, 128 tokens x 64 in bf16), not the Mamba layer.
    assert (off, on) == (mamba + attention, mamba + 128 * 64 * 2 + attention)

def test_a_recipe_configs_values_are_named_in_their_errors(tmp_path):
    yaml = tmp_path / "run.yaml"
    yaml.write_text(f"model_name_or_path: {tmp_path / 'absent'}\n")
    with pytest.raises(ConfigError) as error:
        main(["--config", str(yaml), "--num_gpus", "2"])
    assert str(error.value).startswith(f"model_name_or_path (from {yaml}) {tmp_path}/absent: no such file or folder")
    gpt2 = write_config(tmp_path / "gpt2.json", GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=2,
                                                           n_positions=32, bos_token_id=0, eos_token_id=0).to_dict())
    yaml.write_text(f"model_name_or_path: {gpt2}\nattn_implementation: kernels-community/flash-attn3\n")
    with pytest.raises(ConfigError) as error:
        main(["--config", str(yaml), "--num_gpus", "2"])
    assert str(error.value) == (f"attn_implementation (from {yaml}) is kernels-community/flash-attn3, which the "
                                f"estimate does not measure: pass --attn_implementation with one of sdpa, "
                                f"flash_attention_2, flex_attention, eager")
    with pytest.raises(ConfigError) as error:
        main(["--config", str(yaml), "--num_gpus", "2", "--attn_implementation", "sdpa"])
    assert str(error.value) == (f"max_seq_length (from {yaml}) 1024 is longer than the model's position table (32 "
                                f"positions): set max_seq_length (from {yaml}) 32 or less")
    with pytest.raises(ConfigError, match="^--model is required: give a hub id, a model folder or a config.json, or "
                                          "--config with a recipe YAML that sets model_name_or_path$"):
        parse_args(["--num_gpus", "2"])
    # The model's kind is refused naming the YAML's key too.
    AutoConfig.for_model("t5", d_model=32, num_layers=1, num_heads=2, d_ff=64).save_pretrained(tmp_path / "t5")
    yaml.write_text(f"model_name_or_path: {tmp_path / 't5'}\n")
    with pytest.raises(ConfigError, match=f"^model_name_or_path \\(from {yaml}\\) {tmp_path}/t5 is a t5 model, "):
        main(["--config", str(yaml), "--num_gpus", "2"])
    # A flag given besides the YAML is named as the flag, in either spelling.
    for flag in (["--seq_len", "0"], ["--seq_len=0"]):
        with pytest.raises(ConfigError, match="^--seq_len must be at least 1, got 0$"):
            parse_args(["--config", str(yaml), "--num_gpus", "2", *flag])
    # The recipe's own checks of its YAML.
    yaml.write_text("max_seq_lenght: 64\n")
    with pytest.raises(ConfigError, match="max_seq_lenght"):
        parse_args(["--config", str(yaml), "--model", "x", "--num_gpus", "2"])
    yaml.write_text("mixed_precision: no\n")
    with pytest.raises(ConfigError, match=r"^mixed_precision must be one of bf16, no, pure_bf16 or null, got False "
                                          r"\(YAML reads an unquoted yes, no, on or off as true or false: quote it\)$"):
        parse_args(["--config", str(yaml), "--model", "x", "--num_gpus", "2"])
    yaml.write_text("per_device_train_batch_size: 0\n")
    with pytest.raises(ConfigError, match=rf"^per_device_train_batch_size \(from {yaml}\) must be at least 1, got 0$"):
        parse_args(["--config", str(yaml), "--model", "x", "--num_gpus", "2"])


def test_every_recipe_config_gives_the_estimate_its_micro_batch():
    import yaml

    for path in sorted((REPO / "recipes" / "configs").glob("*.yaml")):
        values = yaml.safe_load(path.read_text())
        model = values.get("model_name_or_path") or "m"  # sft.yaml's is given on the command line
        args = parse_args(["--config", str(path), "--num_gpus", "8", *(["--model", "m"] if model == "m" else [])])
        assert (args.model, args.batch, args.seq_len) == (
            model, values["per_device_train_batch_size"], values["max_seq_length"]), path
