"""Plan GPU memory before launch, from the model's config alone (no weights are read):

    python -m fsdp_recipes.estimate --model <hub id, local folder or config.json> --num_gpus 8 [--num_nodes 1]
        [--offload] [--activation_checkpointing] [--seq_len 2048] [--batch 4] [--gpu_memory 80]
        [--attn_implementation sdpa|flash_attention_2|flex_attention|eager] [--trust_remote_code]
        [--fsdp_transformer_layer_cls_to_wrap <classes>]
    python -m fsdp_recipes.estimate --config recipes/configs/<recipe>.yaml --num_gpus 8 [any flag above]

With --config, the run that recipe YAML describes is estimated: its model, micro-batch, sequence length, precision,
attention, activation checkpointing, offload and layer classes (the recipe's defaults where the YAML leaves a key out,
as the run would take them); a flag given besides overrides the YAML.

It builds the model on the meta device and prints, per GPU, for FSDP2 FULL_SHARD, SHARD_GRAD_OP and HSDP as this
project applies them (`fully_shard` on each decoder layer, then the root; AdamW): the parameters, gradients and
optimizer states each rank holds (exact: FSDP2's dim-0 shards of each parameter, the largest rank's), the
activations the model's forward saves for backward (measured by running that forward on the meta device), estimates
of the transient buffers, the total, and the cheapest setting that fits.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
import weakref
from dataclasses import dataclass
from unittest import mock

import torch
from torch import nn
from transformers import (AttentionInterface, AttentionMaskInterface, AutoConfig, AutoModelForCausalLM,
                          PretrainedConfig, PreTrainedModel)
from transformers import masking_utils
from transformers.integrations import hub_kernels
from transformers.masking_utils import flash_attention_mask

from .cli import run_main
from .config import ConfigError, TrainConfig, looked_in, read_yaml_config
from .data import check_sequence_length
from .families import check_attention_implemented, check_causal_lm, check_loads_whole, exact_attention, hub_cache_miss
from .flops import build_meta_model
from .plan import PRECISIONS, check_flash_precision
from .sharding import MASTER_DTYPE, check_no_weight_kept_in_fp32, find_layer_classes

GIB = 1024**3
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HSDP")
# Kept free of the estimate: the CUDA context, NCCL buffers and the caching allocator's fragmentation.
USABLE_SHARE = 0.9
# As fsdp2.mixed_precision_policy and sharding.MASTER_DTYPE set them: compute in param_dtype, reduce in reduce_dtype.
COMPUTE_DTYPE = {"bf16": torch.bfloat16, "no": torch.float32, "pure_bf16": torch.bfloat16}
REDUCE_DTYPE = {"bf16": torch.float32, "no": torch.float32, "pure_bf16": torch.bfloat16}
ATTENTION = ("sdpa", "flash_attention_2", "flex_attention", "eager")  # those whose saved activations are measured


@dataclass(frozen=True)
class Setting:
    strategy: str  # one of STRATEGIES
    activation_checkpointing: bool
    offload: bool

    def describe(self) -> str:
        extras = [name for name, on in [("activation checkpointing", self.activation_checkpointing),
                                        ("CPU offload", self.offload)] if on]
        if not extras:
            return f"{self.strategy} without activation checkpointing or offload"
        return f"{self.strategy} with {' and '.join(extras)}"

    def recipe_keys(self, num_nodes: int) -> str:
        """Every key the setting depends on, false ones too: the recipe's YAML may set another value."""
        # The engine estimated: an FSDP1 accelerate config (or one without fsdp_version, accelerate's default 1)
        # would otherwise refuse fsdp_reshard_after_forward.
        keys = ["fsdp_version: 2", "fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP",
                f"fsdp_reshard_after_forward: {str(self.strategy != 'SHARD_GRAD_OP').lower()}"]
        # The replica count too: slurm/launch_node.sh sets accelerate's to the node count (HSDP), and a copied recipe
        # YAML may set one on one node; FULL_SHARD and SHARD_GRAD_OP, estimated over every GPU, need the recipe's 1.
        keys += [f"dp_replicate_size: {num_nodes if self.strategy == 'HSDP' else 1}"]
        # Not modelled, so ruled out: size-based units, and last_micro_batch's full gradients between micro-batches.
        keys += [f"fsdp_activation_checkpointing: {str(self.activation_checkpointing).lower()}",
                 f"fsdp_offload_params: {str(self.offload).lower()}", "gradient_sync: every_micro_batch"]
        return ", ".join(keys)


@dataclass(frozen=True)
class Estimate:
    """Bytes per GPU. params, grads and optimizer are exact (the largest rank's); the rest are estimates."""
    params: int
    grads: int
    optimizer: int
    gathered: int  # all-gathered parameters in compute dtype
    grad_buffers: int  # unsharded gradients and reduce-scatter input
    activations: int  # saved by the decoder layers for backward
    logits: int  # logits and cross-entropy's fp32 tensors
    offload: bool

    @property
    def sharded_state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def gpu_total(self) -> int:
        transient = self.gathered + self.grad_buffers + self.activations + self.logits
        return transient + (0 if self.offload else self.sharded_state)


def load_config(model: str, trust_remote_code: bool = False, flag: str = "--model") -> PretrainedConfig:
    """A hub id or a local folder through AutoConfig.from_pretrained, which also reads a config.json path. `flag`:
    where the model was named, for the errors."""
    looks_local = model.endswith(".json") or model.startswith((".", "/", "~")) or os.path.exists(model)
    path = os.path.expanduser(model)
    if looks_local and not os.path.exists(path):
        raise ConfigError(f"{flag} {model}: no such file or folder{looked_in(model)}; give a hub id, a model folder "
                          f"or a config.json")
    # transformers' words for it ("Should have a `model_type` key in its config.json") name a file that is not there.
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        final = os.path.join(model, "final")  # a run's output_dir, whose export is the model folder
        export = os.path.isfile(os.path.join(path, "final", "config.json"))
        raise ConfigError(f"{flag} {model} is a folder without config.json: give a model folder (config.json beside "
                          f"the weights) or a config.json" + (f", such as this run's export {final}" if export else ""))
    try:
        # Given explicitly, False included: left unset, transformers asks on the terminal whether to run the code.
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        if "trust_remote_code" in str(error):  # transformers' error for a checkpoint with code of its own
            raise ConfigError(f"{flag} {model} ships its own model code: pass --trust_remote_code to run it, as the "
                              f"recipe key trust_remote_code: true does") from error
        first_line = str(error).strip().splitlines()[0]
        raise ConfigError(hub_cache_miss(flag, model, error)
                          or f"{flag} {model}: cannot read its config ({first_line})") from error


def shard_rows(rows: int, shard_size: int) -> int:
    """Rows of a dim-0 shard on rank 0, the largest: torch.chunk's ceil(rows / shard_size). FSDP2 pads every
    rank's parameter and gradient shards to this size in memory (the last ranks' local tensors are shorter views);
    AdamW's states follow the local tensors."""
    return -(-rows // shard_size)


def sharded_numel(params: list[nn.Parameter], shard_size: int) -> int:
    return sum(shard_rows(p.shape[0], shard_size) * (p.numel() // p.shape[0]) if p.ndim else p.numel()
               for p in params)


def fsdp_groups(model: nn.Module, layer_names: list[str] | None = None
                ) -> tuple[list[list[nn.Parameter]], list[nn.Parameter]]:
    """The parameters of each decoder layer (one FSDP2 unit each), and those left to the root unit. `layer_names`:
    fsdp_transformer_layer_cls_to_wrap's classes (None: the model's own, as the recipe finds them)."""
    layer_classes = find_layer_classes(model, layer_names)
    layers = [list(m.parameters()) for m in model.modules() if isinstance(m, layer_classes)]
    in_layers = {id(p) for layer in layers for p in layer}
    return layers, [p for p in model.parameters() if id(p) not in in_layers]


@dataclass(frozen=True)
class SavedActivations:
    """What one micro-batch's forward leaves for backward, measured: bytes per decoder layer that ran (not a
    multimodal model's vision and audio towers, idle on text), one layer's input (all a checkpointed layer
    keeps), and the names of the parameters the forward used: only those get gradients and AdamW states.
    With fsdp_transformer_layer_cls_to_wrap naming classes inside the decoder layers (their MLPs), per_layer is per
    unit, and `outside` what the decoder layers save outside the units (their attention), which no unit's
    activation checkpointing recomputes. `stand_ins`: the kernel packages (mamba-ssm) whose PyTorch stand-ins in
    transformers ran, as they do on a GPU without them."""
    tokens: int
    per_layer: tuple[int, ...]
    layer_input: int
    trained: frozenset[str]
    outside: int
    stand_ins: frozenset[str] = frozenset()


class _FusedAttentionSaves(torch.autograd.Function):
    """What a fused attention kernel (sdpa's flash or memory-efficient kernel, flash attention) keeps for backward:
    q, k, v, its output, each query's log-sum-exp, and a mask (e.g. a sliding window's) as an additive bias in the
    compute dtype; no L x L scores. Shapes only, for the meta device."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask):
        # Laid out in memory as q, as the kernels do (transformers' transpose(1, 2).contiguous() after them copies it
        # or not as it would q), and of v's width: DeepSeek V3's multi-head latent attention has a narrower v.
        output = torch.empty_like(query[..., :1].expand(*query.shape[:-1], value.shape[-1]))
        log_sum_exp = torch.empty(query.shape[:-1], dtype=torch.float32, device=query.device)
        # A boolean mask becomes a new bias in each layer; a float one (Falcon's ALiBi) is kept as given, one tensor
        # that every layer shares.
        bias = attn_mask if attn_mask is None or attn_mask.is_floating_point() else \
            torch.empty(attn_mask.shape, dtype=query.dtype, device=query.device)
        ctx.save_for_backward(query, key, value, output, log_sum_exp, bias)
        return output


class _Saved:
    """A tensor autograd saved for backward, as its graph holds it: alive as long as backward may need it."""
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


_SDPA = torch.nn.functional.scaled_dot_product_attention


def _fused_sdpa(query, key, value, attn_mask=None, **kwargs):
    # No fused kernel takes grouped-query attention (enable_gqa, given without a mask) in fp32: flash and cuDNN need
    # 16-bit, torch 2.11's memory-efficient kernel has no GQA. sdpa then runs its math path on the GPU too, keeping
    # L x L scores. With a mask, k and v come repeated to every query head, which the memory-efficient kernel takes.
    if kwargs.get("enable_gqa") and query.dtype == torch.float32:
        return _SDPA(query, key, value, attn_mask=attn_mask, **kwargs)
    return _FusedAttentionSaves.apply(query, key, value, attn_mask)


def _flash_or_flex_attention(module, query, key, value, attention_mask, **kwargs):
    """Flash and flex attention take grouped-query attention natively and masks as block structure, no bias."""
    return _FusedAttentionSaves.apply(query, key, value, None).transpose(1, 2).contiguous(), None


# Measured through an attention function of its own: transformers refuses sdpa for some models (Gemma 2) that flash
# and flex attention compute, and neither kernel runs on the meta device.
MEASURED_FLASH_OR_FLEX = "fsdp_recipes_estimate_fused"  # a name with "flash" in it would load a flash kernel
AttentionInterface.register(MEASURED_FLASH_OR_FLEX, _flash_or_flex_attention)
AttentionMaskInterface.register(MEASURED_FLASH_OR_FLEX, flash_attention_mask)


def _static_rotary_embeddings(model: nn.Module) -> None:
    """Rotary embeddings that rescale with the sequence length (longrope, as Phi-3.5's; dynamic) compare position
    values, which the meta device lacks; the shapes of the activations do not depend on them."""
    def static(kind: str) -> str:
        return "default" if kind == "longrope" or "dynamic" in kind else kind

    for module in model.modules():
        kind = getattr(module, "rope_type", None)
        if isinstance(kind, str):
            module.rope_type = static(kind)
        elif isinstance(kind, dict):  # one per layer type (Gemma 3)
            module.rope_type = {layer_type: static(k) for layer_type, k in kind.items()}


def measure_activations(config: PretrainedConfig, mixed_precision: str, batch: int, seq_len: int,
                        attn_implementation: str, trust_remote_code: bool = False,
                        layer_names: list[str] | None = None) -> SavedActivations:
    """Run the model's own forward on the meta device (shapes only: no memory, no compute) for one micro-batch,
    and count the bytes of the distinct tensors autograd saves inside each decoder layer, parameters excluded.
    Whatever the architecture does (extra norms, soft-capping, routing to experts) is counted as it runs; for sdpa,
    which runs its math path (L x L scores) on the meta device, what the GPU's fused kernel saves instead.

    Each layer's larger figure of two batches: a packed one (with a mask, sdpa takes k and v repeated to every query
    head; a padded batch has a mask too), and one of rows that fill it (no mask: grouped-query attention as is)."""
    fused = attn_implementation in ("flash_attention_2", "flex_attention")
    measured = MEASURED_FLASH_OR_FLEX if fused else attn_implementation
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=COMPUTE_DTYPE[mixed_precision],
                                                     attn_implementation=measured, trust_remote_code=trust_remote_code)
    except KeyError as error:
        # A model that picks its attention class by name from a table of its own (GPT-Neo) has no entry for the
        # estimate's attention function, and its own flash attention class calls a kernel the meta device lacks.
        if error.args != (MEASURED_FLASH_OR_FLEX,):
            raise
        raise ConfigError(f"{config.model_type} runs {attn_implementation} through an attention class of its own, "
                          f"which the estimate cannot run on the meta device: estimate it with --attn_implementation "
                          f"eager, an upper bound: eager keeps the L x L scores, which flash attention does not"
                          ) from error
    _static_rotary_embeddings(model)
    if model.config._experts_implementation == "grouped_mm" and COMPUTE_DTYPE[mixed_precision] != torch.bfloat16:
        raise ConfigError(f"the activations are measured through transformers' grouped_mm experts, which take bf16 "
                          f"only: estimate {config.model_type} with --mixed_precision bf16 or pure_bf16")
    packed, full = (_saved_per_layer(model, batch, seq_len, layout, layer_names) for layout in ("packed", "full"))
    return SavedActivations(batch * seq_len, tuple(map(max, packed.per_layer, full.per_layer)),
                            max(packed.layer_input, full.layer_input), packed.trained | full.trained,
                            max(packed.outside, full.outside), packed.stand_ins | full.stand_ins)


def _used_parameters(model: nn.Module, output: torch.Tensor) -> frozenset[str]:
    """The names of the parameters `output`'s autograd graph reaches: those backward gives a gradient."""
    names = {id(p): name for name, p in model.named_parameters()}
    used, seen, nodes = set(), set(), [output.grad_fn]
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf, such as a parameter
        if variable is not None and id(variable) in names:
            used.add(names[id(variable)])
        nodes.extend(next_node for next_node, _ in node.next_functions)
    return frozenset(used)


def _saved_per_layer(model: nn.Module, batch: int, seq_len: int, layout: str, layer_names: list[str] | None
                     ) -> SavedActivations:
    """What one batch of the layout ("packed" or "full") leaves for backward in each decoder layer."""
    packed = layout == "packed"
    # A storage's identity (views share it); data_ptr is 0 for every storage on the meta device.
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    layer_classes = find_layer_classes(model, layer_names)
    layers = [m for m in model.modules() if isinstance(m, layer_classes)]
    # The decoder layers that are no unit: those around units named inside them (their MLPs), and those of a class
    # not named beside one that is (Jamba's Mamba layers beside its attention layers), which the root unit holds:
    # the other layers of each nn.ModuleList that holds a unit. What these save outside the units is kept too.
    # Found by structure: a model whose units are named may have layer classes the recipe cannot find by itself.
    units = {id(layer) for layer in layers}
    stacks = [m for m in model.modules() if isinstance(m, nn.ModuleList)
              and any(id(sub) in units for layer in m for sub in layer.modules())]
    decoder_layers = [layer for stack in stacks for layer in stack if id(layer) not in units]
    saves: list[tuple[weakref.ref, int | None]] = []  # each tensor saved while a unit ran, and that unit (None: none)
    fallbacks: list[str] = []  # transformers' word each time a kernel package's PyTorch stand-in runs
    inputs: list[int] = []
    running: list[int] = []  # the index of the unit whose forward is running
    in_decoder_layer: list[int] = []  # one entry per decoder layer whose forward is running
    ran: set[int] = set()

    def enter(index: int):
        def hook(module, args, kwargs):
            running.append(index)
            ran.add(index)
            inputs.append((args[0] if args else kwargs["hidden_states"]).nbytes)
        return hook

    def leave(module, args, output):
        running.pop()

    def enter_decoder_layer(module, args):
        in_decoder_layer.append(1)

    def leave_decoder_layer(module, args, output):
        in_decoder_layer.pop()

    def pack(tensor: torch.Tensor) -> _Saved:
        packed = _Saved(tensor)
        if running or in_decoder_layer:
            saves.append((weakref.ref(packed), running[-1] if running else None))
        return packed

    with torch.device("meta"):
        input_ids = torch.zeros(batch, seq_len, dtype=torch.long)
        # A packed batch's position_ids: rotary tables per row.
        extra = {"position_ids": torch.zeros(batch, seq_len, dtype=torch.long)} if packed else {}
    handles = [h for i, layer in enumerate(layers)
               for h in (layer.register_forward_pre_hook(enter(i), with_kwargs=True),
                         layer.register_forward_hook(leave))]
    handles += [h for layer in decoder_layers
                for h in (layer.register_forward_pre_hook(enter_decoder_layer),
                          layer.register_forward_hook(leave_decoder_layer))]
    try:
        # Without a KV cache, as in training (a cache would copy k and v: Phi-3's v would no longer keep its fused
        # qkv output alive). transformers then looks for the examples in the positions, values the meta device
        # lacks: one example a row, with a packed batch's mask, or none found. A model with a pad token (GPT-2) reads
        # the input ids too, only to warn of padding without an attention mask: skipped.
        with (mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", _fused_sdpa),
              mock.patch.object(masking_utils, "find_packed_sequence_indices",
                                torch.zeros_like if packed else lambda position_ids: None),
              mock.patch.object(PreTrainedModel, "warn_if_padding_and_no_attention_mask", lambda *args: None),
              # A model that builds an all-ones attention mask itself (BioGPT) reads it to skip the mask: the batches
              # measured have no padding.
              mock.patch.object(masking_utils, "fast_all", lambda tensor: True),
              # Kernel packages (mamba-ssm) run on CUDA only: on the meta device their PyTorch stand-ins run, and
              # transformers says so, once a process; each time here, to name them.
              mock.patch.object(hub_kernels.logger, "warning_once", lambda message, *args: fallbacks.append(message)),
              torch.autograd.graph.saved_tensors_hooks(pack, lambda packed: packed.tensor)):
            logits = model(input_ids=input_ids, use_cache=False, **extra).logits
    finally:
        for handle in handles:
            handle.remove()
    # Counted once the forward has ended, while logits hold the graph: a tensor saved in a branch that the output
    # does not reach (a MoE router's top-k) was freed with it, and backward never sees it.
    saved, outside = [0] * len(layers), 0
    seen: set[int] = set()  # a tensor that several layers save (the residual stream) is counted once
    for ref, index in saves:
        packed = ref()
        storage = None if packed is None else packed.tensor.untyped_storage()
        if storage is not None and storage._cdata not in weights and storage._cdata not in seen:
            seen.add(storage._cdata)
            if index is None:
                outside += storage.nbytes()
            else:
                saved[index] += storage.nbytes()
    # "`mamba_inner_fn` is falling back to its reference PyTorch implementation because `mamba-ssm` is ..."
    stand_ins = frozenset(re.sub(r".*? because `([^`]+)`.*", r"\1", message, flags=re.S) for message in fallbacks)
    return SavedActivations(batch * seq_len, tuple(saved[i] for i in sorted(ran)), max(inputs),
                            _used_parameters(model, logits), outside, stand_ins)


def estimate(model: nn.Module, setting: Setting, num_gpus: int, num_nodes: int, mixed_precision: str,
             saved: SavedActivations, layer_names: list[str] | None = None) -> Estimate:
    master = MASTER_DTYPE[mixed_precision].itemsize
    compute = COMPUTE_DTYPE[mixed_precision].itemsize
    shard_size = num_gpus // num_nodes if setting.strategy == "HSDP" else num_gpus
    params = sharded_numel(list(model.parameters()), shard_size) * master
    # A multimodal model's vision and audio towers do not run on text: no gradients, no AdamW states, never
    # gathered (their decoder layers), nor any gradient buffer.
    trained_ids = {id(p) for name, p in model.named_parameters() if name in saved.trained}
    trained = [p for p in model.parameters() if id(p) in trained_ids]
    state = sharded_numel(trained, shard_size) * master

    layers, root = fsdp_groups(model, layer_names)
    layers = [layer for layer in layers if any(id(p) in trained_ids for p in layer)]

    def gathered_numel(group: list[nn.Parameter]) -> int:  # all-gather output: padded shards x shard_size
        return sharded_numel(group, shard_size) * shard_size

    largest_layer = max((gathered_numel(layer) for layer in layers), default=0)
    # The root unit (embeddings, final norm, lm_head) stays gathered through forward and backward: its forward
    # spans the whole model. Layers: FULL_SHARD and HSDP free each after use, with the next one prefetched;
    # SHARD_GRAD_OP keeps every gathered layer from its forward until its backward.
    kept_layers = sum(map(gathered_numel, layers)) if setting.strategy == "SHARD_GRAD_OP" else 2 * largest_layer
    gathered = (gathered_numel(root) + kept_layers) * compute
    # The root's full gradient (lm_head's is ready first, then waits for the embedding's), and one layer's full
    # gradient in compute dtype with its reduce-scatter input in reduce dtype.
    reduce = REDUCE_DTYPE[mixed_precision].itemsize
    trained_root = [p for p in root if id(p) in trained_ids]
    grad_buffers = gathered_numel(trained_root) * compute + largest_layer * (compute + reduce)

    if setting.activation_checkpointing:  # each layer's input, and one layer recomputed in backward
        activations = len(saved.per_layer) * saved.layer_input + max(saved.per_layer) + saved.outside
    else:
        activations = sum(saved.per_layer) + saved.outside
    # The peak of the loss's backward: the logits in compute dtype, the fp32 log-softmax cross-entropy keeps, and
    # the fp32 gradients of nll_loss and of log_softmax (the fp32 copy of bf16 logits is freed after the forward).
    # Final logit soft-capping (Gemma 2) keeps its tanh's output too, outside the decoder layers.
    text_config = model.config.get_text_config()
    softcapped = compute if getattr(text_config, "final_logit_softcapping", None) else 0
    logits = saved.tokens * text_config.vocab_size * (compute + 12 + softcapped)
    return Estimate(params=params, grads=state, optimizer=2 * state, gathered=gathered, grad_buffers=grad_buffers,
                    activations=activations, logits=logits, offload=setting.offload)


def candidate_settings(num_nodes: int) -> list[Setting]:
    """Cheapest first: no recomputation and no offload, then activation checkpointing (about a third more
    compute), then CPU offload (optimizer step on the CPU, weights and gradients over PCIe every step), then both.
    Within each: on several nodes HSDP (all-gathers stay inside a node), then SHARD_GRAD_OP (one all-gather per
    layer instead of two), then FULL_SHARD; on one node HSDP is FULL_SHARD and not listed."""
    strategies = ["HSDP", "SHARD_GRAD_OP", "FULL_SHARD"] if num_nodes > 1 else ["SHARD_GRAD_OP", "FULL_SHARD"]
    return [Setting(s, ac, off) for ac, off in [(False, False), (True, False), (False, True), (True, True)]
            for s in strategies]


def fits(est: Estimate, gpu_memory_gib: float) -> bool:
    return est.gpu_total <= USABLE_SHARE * gpu_memory_gib * GIB


def recommend(model: nn.Module, args: argparse.Namespace, saved: SavedActivations) -> str:
    for setting in candidate_settings(args.num_nodes):
        est = estimate(model, setting, args.num_gpus, args.num_nodes, args.mixed_precision, saved, args.units)
        if fits(est, args.gpu_memory):
            # Offload moves the sharded state to host memory, which must then hold it for every GPU of the node.
            host = (f", and {args.num_gpus // args.num_nodes * est.sharded_state / GIB:.1f} GiB of CPU RAM per node"
                    if setting.offload else "")
            # With the micro-batch, precision and attention it was estimated for: the recipe YAML's may differ.
            # YAML reads a bare no as false.
            precision = '"no"' if args.mixed_precision == "no" else args.mixed_precision
            run_keys = (f"mixed_precision: {precision}, per_device_train_batch_size: {args.batch}, "
                        f"max_seq_length: {args.seq_len}, attn_implementation: {args.attn_implementation}"
                        + (f", fsdp_transformer_layer_cls_to_wrap: {','.join(args.layer_names)}"
                           if args.layer_names else ""))
            return (f"recommended: {setting.describe()}: {est.gpu_total / GIB:.1f} of {args.gpu_memory:g} GiB per "
                    f"GPU{host} (recipe config: {setting.recipe_keys(args.num_nodes)}, {run_keys})")
    # With checkpointing and offload (the last candidate), the GPU holds only what does not shrink with more GPUs.
    est = estimate(model, Setting("FULL_SHARD", True, True), args.num_gpus, args.num_nodes, args.mixed_precision,
                   saved, args.units)
    return (f"nothing fits in {args.gpu_memory:g} GiB per GPU on {args.num_gpus} GPUs: even with activation "
            f"checkpointing and CPU offload, a GPU holds {est.gpu_total / GIB:.1f} GiB, more than the "
            f"{USABLE_SHARE * args.gpu_memory:.1f} usable ({USABLE_SHARE:.0%}), that more GPUs do not shrink "
            f"(activations {est.activations / GIB:.1f}, logits and loss {est.logits / GIB:.1f}, gathered layers and "
            f"their gradients {(est.gathered + est.grad_buffers) / GIB:.1f}): lower --batch or --seq_len, which "
            f"activations and logits grow with")


def format_report(model: nn.Module, args: argparse.Namespace, saved: SavedActivations) -> str:
    setting_of = {s: Setting(s, args.activation_checkpointing, args.offload) for s in STRATEGIES}
    ests = {s: estimate(model, setting_of[s], args.num_gpus, args.num_nodes, args.mixed_precision, saved,
                        args.units) for s in STRATEGIES}
    total = sum(p.numel() for p in model.parameters())
    per_node = args.num_gpus // args.num_nodes
    precision = {"bf16": "bf16 compute, fp32 master weights, gradients and Adam states",
                 "no": "fp32 throughout", "pure_bf16": "bf16 throughout"}[args.mixed_precision]
    where = "CPU" if args.offload else "GPU"
    lines = [
        f"model: {type(model).__name__}, {total:,} parameters, "
        f"{model.config.get_text_config().num_hidden_layers} decoder layers",
        f"setup: {args.num_gpus} GPUs ({args.num_nodes} node{'s' * (args.num_nodes > 1)} x {per_node}), "
        f"mixed_precision {args.mixed_precision} ({precision}), AdamW",
        f"micro-batch per GPU: {args.batch} x {args.seq_len} tokens, activation checkpointing "
        f"{'on' if args.activation_checkpointing else 'off'}, offload {'on' if args.offload else 'off'}, "
        f"{args.attn_implementation} attention",
        "",
        f"{'GiB per GPU':<36}" + "".join(f"{name:>15}" for name in ["FULL_SHARD", "SHARD_GRAD_OP",
                                                                    f"HSDP {args.num_nodes}x{per_node}"]),
    ]

    def row(label: str, values: list[float]) -> str:
        return f"{label:<36}" + "".join(f"{v / GIB:>15.2f}" for v in values)

    lines += [
        row(f"parameters (exact, {where})", [e.params for e in ests.values()]),
        row(f"gradients (exact, {where})", [e.grads for e in ests.values()]),
        row(f"optimizer states (exact, {where})", [e.optimizer for e in ests.values()]),
        row("gathered parameters (estimate)", [e.gathered for e in ests.values()]),
        row("gradient buffers (estimate)", [e.grad_buffers for e in ests.values()]),
        row("activations (measured)", [e.activations for e in ests.values()]),
        row("logits and loss (estimate)", [e.logits for e in ests.values()]),
        row("total on GPU (estimate)", [e.gpu_total for e in ests.values()]),
    ]
    if args.offload:
        lines.append(row("CPU RAM per node (offloaded state)", [per_node * e.sharded_state for e in ests.values()]))
    lines.append(f"{f'fits in {USABLE_SHARE:.0%} of {args.gpu_memory:g} GiB':<36}"
                 + "".join(f"{'yes' if fits(e, args.gpu_memory) else 'no':>15}" for e in ests.values()))
    lines += ["", recommend(model, args, saved)]
    return "\n".join(lines)


# The recipe keys --config reads, as the flags they set.
RECIPE_KEYS = {"model_name_or_path": "model", "max_seq_length": "seq_len", "per_device_train_batch_size": "batch",
               "mixed_precision": "mixed_precision", "attn_implementation": "attn_implementation",
               "trust_remote_code": "trust_remote_code", "fsdp_offload_params": "offload",
               "fsdp_activation_checkpointing": "activation_checkpointing",
               "fsdp_transformer_layer_cls_to_wrap": "fsdp_transformer_layer_cls_to_wrap"}
# Settings a recipe YAML can hold that the estimate does not model, with what it estimates instead.
NOT_MODELLED = {"fsdp_version": (lambda v: v == 1, "FSDP2"),
                "fsdp_auto_wrap_policy": (lambda v: v == "SIZE_BASED_WRAP", "one unit per decoder layer"),
                "gradient_sync": (lambda v: v == "last_micro_batch", "gradient_sync every_micro_batch"),
                # The layers run eagerly on the meta device: what a compiled layer saves for backward is not measured.
                "torch_compile": (lambda v: v, "layers run without torch.compile, which often saves less for "
                                               "backward")}


def recipe_defaults(path: str) -> tuple[dict, list[str]]:
    """The flags' values from a recipe YAML (the recipe's built-in default where it leaves a key out, as the run
    takes it), and a note for each setting in it that the estimate does not model."""
    values = read_yaml_config(path)
    run = {f.name: values.get(f.name, f.default) for f in dataclasses.fields(TrainConfig)}
    defaults = {flag: run[key] for key, flag in RECIPE_KEYS.items() if run[key] is not None}
    spelled = {key: str(value).lower() if isinstance(value, bool) else value for key, value in run.items()}  # as YAML
    notes = [f"note: {path} sets {key}: {spelled[key]}, which the estimate does not model: the figures are for "
             f"{instead}" for key, (differs, instead) in NOT_MODELLED.items() if differs(run[key])]
    return defaults, notes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # Named as the README runs it: argparse alone would name the file, which no command runs.
    parser = argparse.ArgumentParser(f"python -m {__spec__.name}", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--config", help="a recipe YAML: the run it describes is estimated; flags override it")
    parser.add_argument("--model", help="hub id, local model folder, or a config.json file (required without "
                                        "--config, else its model_name_or_path)")
    parser.add_argument("--num_gpus", type=int, required=True, help="GPUs in all, over all nodes")
    parser.add_argument("--num_nodes", type=int, default=1, help="nodes (HSDP replicates across them)")
    # --no-offload / --no-activation_checkpointing: the tables without them, over a --config that sets them.
    parser.add_argument("--offload", action=argparse.BooleanOptionalAction, default=False,
                        help="tables with CPU offload (fsdp_offload_params)")
    parser.add_argument("--activation_checkpointing", action=argparse.BooleanOptionalAction, default=False,
                        help="tables with each layer recomputed")
    parser.add_argument("--seq_len", type=int, default=2048,
                        help="tokens per sequence (default: the Llama recipe's, or the --config's max_seq_length)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per GPU per micro-batch (default: the "
                                                             "Llama recipe's, or the --config's)")
    parser.add_argument("--gpu_memory", type=float, default=80, help="GiB per GPU, for what fits (default 80)")
    parser.add_argument("--mixed_precision", choices=PRECISIONS, default="bf16", help="as the recipe key")
    parser.add_argument("--attn_implementation", choices=ATTENTION, default="sdpa",
                        help="as the recipe key; eager keeps the L x L scores")
    parser.add_argument("--trust_remote_code", action="store_true",
                        help="run the model code the checkpoint ships (as the recipe key)")
    parser.add_argument("--fsdp_transformer_layer_cls_to_wrap",
                        help="comma-separated decoder layer classes, the FSDP units (as the recipe key; default: the "
                             "model's _no_split_modules, else its decoder layers)")
    config_path = parser.parse_known_args(argv)[0].config
    notes = []
    if config_path:
        defaults, notes = recipe_defaults(config_path)
        parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    args.notes = notes
    layers = args.fsdp_transformer_layer_cls_to_wrap
    args.layer_names = [name.strip() for name in layers.split(",")] if layers else None
    args.units = args.layer_names  # main() names the classes found once the model is built
    given = {arg[2:].partition("=")[0] for arg in (sys.argv[1:] if argv is None else argv) if arg.startswith("--")}
    # Where a value came from, for its errors: the flag, or the YAML's key.
    args.label = {flag: f"--{flag}" if flag in given or not config_path else f"{key} (from {config_path})"
                  for key, flag in RECIPE_KEYS.items()}
    if args.model is None:
        raise ConfigError("--model is required: give a hub id, a model folder or a config.json, or --config with a "
                          "recipe YAML that sets model_name_or_path")
    if args.attn_implementation not in ATTENTION:  # a --config's Hub kernel or other implementation
        raise ConfigError(f"{args.label['attn_implementation']} is {args.attn_implementation}, which the estimate does "
                          f"not measure: pass --attn_implementation with one of {', '.join(ATTENTION)}")
    for name in ["num_gpus", "num_nodes", "seq_len", "batch"]:
        if getattr(args, name) < 1:
            raise ConfigError(f"{args.label.get(name, '--' + name)} must be at least 1, got {getattr(args, name)}")
    if not 0 < args.gpu_memory < math.inf:  # nan too
        raise ConfigError(f"--gpu_memory must be a positive number (GiB per GPU), got {args.gpu_memory:g}")
    if args.num_gpus % args.num_nodes:
        raise ConfigError(f"--num_gpus {args.num_gpus} is not divisible by --num_nodes {args.num_nodes}: give the "
                          "GPUs of all nodes together, the same number on each node")
    check_flash_precision(args.attn_implementation, args.mixed_precision)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = load_config(args.model, args.trust_remote_code, args.label["model"])
    check_causal_lm(config, f"{args.label['model']} {args.model}")
    check_loads_whole(config, f"{args.label['model']} {args.model}")
    exact = exact_attention(config)
    if exact and args.attn_implementation not in exact[0]:
        allowed, what = exact
        raise ConfigError(f"{config.model_type} needs attention with {what}: pass --attn_implementation "
                          f"{' or '.join(a for a in allowed if a in ATTENTION)} (see fsdp_recipes/families.py), not "
                          f"{args.attn_implementation}")
    check_attention_implemented(args.attn_implementation, config)
    model = build_meta_model(config, MASTER_DTYPE[args.mixed_precision], args.trust_remote_code)
    check_sequence_length(model, args.seq_len, args.label["seq_len"])
    check_no_weight_kept_in_fp32(model, args.mixed_precision)
    # The units' classes, found once: a model without _no_split_modules prints which layers it found.
    args.units = [cls.__name__ for cls in find_layer_classes(model, args.layer_names)]
    saved = measure_activations(config, args.mixed_precision, args.batch, args.seq_len, args.attn_implementation,
                                args.trust_remote_code, args.units)
    if saved.stand_ins:
        # mamba-ssm's scan keeps no state per token for backward; transformers' PyTorch scan keeps several (fp32).
        args.notes.append(f"note: the activations are measured through transformers' PyTorch code in place of the "
                          f"CUDA kernels of {', '.join(sorted(saved.stand_ins))}, as a GPU without them runs; with "
                          f"those installed, these layers keep less for backward (Mamba's scan far less): an upper "
                          f"bound")
    print("\n".join([*args.notes, format_report(model, args, saved)]))


if __name__ == "__main__":
    run_main(main)
