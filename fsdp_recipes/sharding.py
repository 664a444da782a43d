"""Apply a ShardingPlan to a model with FSDP1 or FSDP2, and the engine-aware helpers the trainer needs."""

from __future__ import annotations

import contextlib
import functools
import os
import re

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, apply_activation_checkpointing
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from . import fsdp1, fsdp2
from .config import ConfigError
from .distributed import print_rank0, ranks
from .plan import ShardingPlan

MASTER_DTYPE = {"bf16": torch.float32, "no": torch.float32, "pure_bf16": torch.bfloat16}


def find_layer_classes(model: nn.Module, names: list[str] | None) -> tuple[type, ...]:
    """The module classes to wrap: the names given, else the model's `_no_split_modules`, else its decoder layers."""
    by_name = {type(m).__name__: type(m) for m in model.modules()}
    if not names:
        if getattr(getattr(model, "config", None), "num_hidden_layers", None) == 0:
            raise ConfigError(f"{type(model).__name__}'s config sets num_hidden_layers 0: the model has no decoder "
                              f"layers to train or shard; check its config.json")
        # A class may declare the layers of its other variants too (Gemma 3's vision tower in a text-only model).
        names = [n for n in getattr(model, "_no_split_modules", None) or [] if n in by_name]
        return outermost(model, tuple(by_name[n] for n in names)) if names else (find_decoder_layer_class(model),)
    if type(model).__name__ in names:
        # The root is always a unit of its own: as a layer class too, FSDP2 would shard it twice (torch's assertion
        # "can only be applied to a module once"), FSDP1 would make one unit of it and call it a layer.
        raise ConfigError(
            f"fsdp_transformer_layer_cls_to_wrap names {type(model).__name__}, the model's own class, which is always "
            f"the root unit: name the class of its decoder layers, or leave the key unset to wrap them"
        )
    missing = [n for n in names if n not in by_name]
    if missing:
        raise ConfigError(
            f"fsdp_transformer_layer_cls_to_wrap names {', '.join(missing)}, which is not a module class of "
            f"{type(model).__name__}; its module classes are: {', '.join(sorted(by_name))}"
        )
    return tuple(by_name[n] for n in names)


def outermost(model: nn.Module, classes: tuple[type, ...]) -> tuple[type, ...]:
    """The classes of which some module lies inside no module of the others. Mamba declares its decoder layer and the
    mixer inside it: as units of their own, the mixers would take a second gather per layer, be recomputed twice
    with activation checkpointing, and be counted twice by the memory estimate."""
    inner = {id(sub) for m in model.modules() if type(m) in classes for sub in m.modules() if sub is not m}
    return tuple(c for c in classes if any(type(m) is c and id(m) not in inner for m in model.modules()))


def find_decoder_layer_class(model: nn.Module) -> type:
    """For a model whose `_no_split_modules` names none of its classes: the class of the one nn.ModuleList that holds
    config.num_hidden_layers modules of a single class (the decoder layers). Prints what it chose."""
    num_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    declares = f"declares no _no_split_modules{' it holds' if getattr(model, '_no_split_modules', None) else ''}"
    module_lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    stacks = [(name, m) for name, m in module_lists
              if len(m) == num_layers and len({type(layer) for layer in m}) == 1]
    if len(stacks) == 1:
        name, layers = stacks[0]
        layer_class = type(layers[0])
        print_rank0(f"wrapping: {type(model).__name__} {declares}; wrapping its decoder layers, "
                    f"{name}: {len(layers)} x {layer_class.__name__} (fsdp_transformer_layer_cls_to_wrap chooses "
                    f"another class)")
        return layer_class
    candidates = sorted({type(layer).__name__ for _, m in module_lists for layer in m})
    candidates = candidates or sorted({type(m).__name__ for m in model.modules()})
    raise ConfigError(
        f"{type(model).__name__} {declares} and its decoder layers were not found (no single "
        f"nn.ModuleList of config.num_hidden_layers={num_layers} modules of one class): set "
        f"fsdp_transformer_layer_cls_to_wrap to its decoder layer class, e.g. one of: {', '.join(candidates)}"
    )


def tied_parameter_ids(model: nn.Module) -> set[int]:
    seen, tied = set(), set()
    for _, param in model.named_parameters(remove_duplicate=False):
        (tied if id(param) in seen else seen).add(id(param))
    return tied


def kept_in_fp32(model: nn.Module, dtype: torch.dtype) -> re.Pattern | None:
    """The names of the weights a model of `dtype` keeps in fp32, as from_pretrained loads them (None: none), by the
    model class's declarations: a DeepSeek V3 or GLM-4.5 router's e_score_correction_bias (and gate.weight, in newer
    transformers) in bf16 and fp16, some norms in fp16."""
    keep = set()
    if dtype in (torch.float16, torch.bfloat16):
        keep |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:  # bf16 weights overflow in fp16
        keep |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    # transformers' patterns: a "*" matches anything, and a pattern matches anywhere in the name.
    return re.compile("|".join(pattern.replace("*", ".*") for pattern in sorted(keep))) if keep else None


def check_no_weight_kept_in_fp32(model: nn.Module, mixed_precision: str) -> None:
    """Refuse a precision whose master weights are not fp32 (pure_bf16) for a model that keeps a weight in fp32
    (DeepSeek V3's router gate.weight): the run checks its loaded model, the memory estimate its meta model."""
    expected = MASTER_DTYPE[mixed_precision]
    kept = kept_in_fp32(model, expected)
    if kept is None:
        return
    for name, _ in model.named_parameters():
        if kept.search(name):  # from_pretrained loads it in fp32 (model.py's rank-0 loading too)
            raise ConfigError(f"{name} is kept in fp32 by {model.config.model_type} models (transformers' "
                              f"_keep_in_fp32_modules_strict), and mixed_precision {mixed_precision} holds every "
                              f"weight in {expected}: use mixed_precision bf16 (fp32 master weights, bf16 compute)")


def check_master_dtype(model: nn.Module, plan: ShardingPlan) -> None:
    """The optimizer updates these weights: fp32 unless pure bf16 was asked for. Fail before any step is taken."""
    check_no_weight_kept_in_fp32(model, plan.mixed_precision)
    expected = MASTER_DTYPE[plan.mixed_precision]
    for name, param in model.named_parameters():
        if param.dtype != expected:
            raise ConfigError(f"master weights must be {expected} for mixed_precision={plan.mixed_precision}, but "
                              f"{name} is {param.dtype}: load the model in {expected}")


def build_mesh(plan: ShardingPlan, device: torch.device) -> DeviceMesh:
    """2-D (replicate x shard) for HSDP and FSDP1 HYBRID_SHARD, 1-D over all ranks otherwise."""
    world = dist.get_world_size()
    hybrid = plan.sharding_strategy == "HYBRID_SHARD" if plan.fsdp_version == 1 else (plan.dp_replicate_size or 1) > 1
    if not hybrid:
        plan.mesh_shape = (world,)
        return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    # FSDP1 HYBRID_SHARD's default: replicate across nodes, shard within a node.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    replicate = plan.dp_replicate_size or world // local
    if world % replicate:  # without dp_replicate_size (plan.py refuses one that does not divide): unequal nodes
        raise ConfigError(f"FSDP1 HYBRID_SHARD replicates once per node, and the {ranks(world)} do not make nodes of "
                          f"{local} (this node's processes): start as many on every node, or set dp_replicate_size to "
                          f"a divisor of {world}")
    if plan.fsdp_version == 1 and replicate == world > 1:
        # torch then switches to NO_SHARD within the 1-rank shard group and never all-reduces across replicas.
        replicas = (f"dp_replicate_size {replicate}" if plan.dp_replicate_size else
                    f"one replica per node ({replicate} nodes of 1 rank; dp_replicate_size unset)")
        raise ConfigError(f"FSDP1 HYBRID_SHARD with {replicas} leaves 1 rank per shard group, which torch does not "
                          f"synchronise: use NO_SHARD{', or fewer replicas' if plan.dp_replicate_size else ''}")
    plan.mesh_shape = (replicate, world // replicate)
    return init_device_mesh(device.type, plan.mesh_shape, mesh_dim_names=("replicate", "shard"))


def shard_model(model: nn.Module, plan: ShardingPlan, device: torch.device | None = None) -> nn.Module:
    """Activation checkpointing and torch.compile of the decoder layers, and sharding; returns the model to train
    (FSDP1 wraps it, FSDP2 shards in place). FSDP2 shards the checkpointed layers; FSDP1 checkpoints inside its units.

    Records in `plan` what was wrapped, on which mesh, and the parameter count before sharding; the model keeps it
    as `sharding_plan`, which checkpoints record (checkpoint.compute_settings).
    """
    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                        else torch.device("cpu"))
    check_master_dtype(model, plan)
    # The decoder layers: units, or what checkpointing and compile apply to (size-based units need neither).
    layer_classes = (find_layer_classes(model, plan.layer_cls_names)
                     if plan.auto_wrap_policy == "TRANSFORMER_BASED_WRAP" or plan.activation_checkpointing
                     or plan.torch_compile else ())
    plan.layer_classes = ", ".join(c.__name__ for c in layer_classes)
    plan.total_params = sum(p.numel() for p in model.parameters())
    checkpoint_layers = functools.partial(apply_activation_checkpointing,
                                          check_fn=lambda m: isinstance(m, layer_classes))
    if plan.activation_checkpointing and plan.fsdp_version == 2:
        # Before sharding: FSDP2 then shards the wrapper, so that its hooks run outside the recomputed region.
        # checkpoint_wrapper's default is the non-reentrant implementation, and its state-dict hooks strip the
        # wrapper from the keys.
        checkpoint_layers(model)
    if plan.torch_compile:
        compile_layers(model, layer_classes)
    mesh = build_mesh(plan, device)
    if plan.auto_wrap_policy == "SIZE_BASED_WRAP":
        # The same units for both engines; modules holding a tied parameter stay in the root.
        units = size_based_units(model, plan.min_num_params, tied_parameter_ids(model))
        plan.wrapped = f"{len(units)} x size-based ({plan.min_num_params:,} parameters or more)"
    else:
        # FSDP2 shards the checkpoint wrapper, so that its hooks run outside the checkpoint; FSDP1 wraps the layer.
        unit_class = CheckpointWrapper if plan.activation_checkpointing and plan.fsdp_version == 2 else layer_classes
        # Children before parents: FSDP2 shards a unit inside another (LlamaMLP in LlamaDecoderLayer) first, so the
        # outer one takes only the rest, as accelerate's bottom-up order does.
        units = [m for m in reversed(list(model.modules())) if isinstance(m, unit_class)]
        plan.wrapped = f"{len(units)} x {', '.join(c.__name__ for c in layer_classes)}"
    if plan.torch_compile:
        plan.units_in_compiled_layers = units_inside_layers(model, units, layer_classes)
    check_tied_parameters_share_a_unit(model, units)
    if plan.fsdp_version == 1:
        # HYBRID_SHARD's 2-D mesh only: a 1-D mesh spans the default process group, which FSDP1 shards over without one.
        model = fsdp1.shard(model, units, plan, mesh if len(plan.mesh_shape) == 2 else None, device)
        if plan.activation_checkpointing:
            # After wrapping, inside each unit (as accelerate does): with the wrapper outside an FSDP1 unit,
            # torch.distributed.checkpoint.state_dict names the unit's parameters with FSDP1's prefix, and a resume
            # cannot load the optimizer state ("Missing optimizer state for parameter ...").
            checkpoint_layers(model)
    else:
        fsdp2.shard(model, units, plan, mesh)
    model.sharding_plan = plan
    return model


def units_inside_layers(model: nn.Module, units: list[nn.Module], layer_classes: tuple[type, ...]) -> str:
    """The classes of the units that lie inside a layer of `layer_classes` (a size-based unit smaller than a layer,
    or LlamaMLP named beside the decoder layer): dynamo does not trace FSDP2's hooks, so each such unit cuts the
    compiled layer into separate graphs. A unit that is the layer or holds it leaves its compiled code whole."""
    unit_ids = {id(unit) for unit in units}
    inside = {type(getattr(module, "_checkpoint_wrapped_module", module)).__name__  # a checkpoint wrapper by its layer
              for layer in model.modules() if isinstance(layer, layer_classes)
              for module in layer.modules() if module is not layer and id(module) in unit_ids}
    return ", ".join(sorted(inside))


def size_based_units(model: nn.Module, min_num_params: int, tied: set[int]) -> list[nn.Module]:
    """FSDP1's size-based policy, for both engines: post-order, a module whose not-yet-wrapped parameters reach
    min_num_params becomes a unit. Modules holding a tied parameter stay in the root (one FSDP group)."""
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> tuple[int, bool]:
        numel, has_tied = 0, False
        for child in module.children():
            child_numel, child_tied = visit(child)
            numel, has_tied = numel + child_numel, has_tied or child_tied
        for param in module.parameters(recurse=False):
            numel += param.numel()
            has_tied = has_tied or id(param) in tied
        # Containers (ModuleList) have no forward for FSDP2's hooks: their parameters go up to the parent.
        has_forward = type(module).forward is not nn.Module.forward
        if module is not model and has_forward and not has_tied and numel >= min_num_params:
            units.append(module)
            return 0, False
        return numel, has_tied

    visit(model)
    return units


def check_tied_parameters_share_a_unit(model: nn.Module, units: list[nn.Module]) -> None:
    """Each FSDP unit shards its own parameters: a tied parameter (embedding and lm_head) whose modules fall in two
    units would be sharded twice. FSDP2 on torch 2.11 then silently unties it; torch 2.13 and FSDP1 fail with an
    unreadable error. Refuse it with the value of fsdp_transformer_layer_cls_to_wrap that leaves those units out
    (the classes may have come from the model's _no_split_modules, the key's default)."""
    unit_classes = {id(unit): type(getattr(unit, "_checkpoint_wrapped_module", unit)) for unit in units}
    owners: dict[int, dict[str, type]] = {}  # tied parameter -> {name of the unit that holds it: its class}
    tied = tied_parameter_ids(model)

    def visit(module: nn.Module, name: str, unit_name: str, unit_class: type | None) -> None:
        if id(module) in unit_classes:
            unit_name, unit_class = state_dict_name(name), unit_classes[id(module)]
        for param in module.parameters(recurse=False):
            if id(param) in tied:
                owners.setdefault(id(param), {})[unit_name] = unit_class
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name, unit_name, unit_class)

    visit(model, "", "", None)
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), state_dict_name(name))
    for param_id, holders in owners.items():
        if len(holders) > 1:
            wrapped = sorted({cls.__name__ for unit, cls in holders.items() if unit})
            others = sorted({cls.__name__ for cls in unit_classes.values()} - set(wrapped))
            fix = (f"set fsdp_transformer_layer_cls_to_wrap {','.join(others)}" if others else
                   "set fsdp_auto_wrap_policy SIZE_BASED_WRAP, which keeps tied modules in the root")
            raise ConfigError(
                f"{names[param_id]} is tied (shared) across FSDP units ({', '.join(u or 'the root' for u in holders)}), "
                f"which would shard it twice: leave {', '.join(wrapped)} out of the classes wrapped ({fix})")


def compile_layers(model: nn.Module, layer_classes: tuple[type, ...]) -> None:
    """torch.compile each decoder layer in place.

    After activation checkpointing: the layer inside the checkpoint wrapper is compiled (dynamo does not trace
    torch.distributed's wrapper itself), and the recomputation in backward runs the compiled layer again. Before
    sharding, so that FSDP2's hooks on the layer (which dynamo skips) run around the compiled code. `Module.compile`
    compiles in place: module names, and so state-dict keys, are unchanged.
    """
    for layer in [m for m in model.modules() if isinstance(m, layer_classes)]:
        layer.compile()


def local_numel(tensor: torch.Tensor) -> int:
    """Elements this rank holds: a DTensor's local shard (FSDP2); FSDP1's original parameters are already views
    of the local shard (use_orig_params=True)."""
    return tensor.to_local().numel() if hasattr(tensor, "to_local") else tensor.numel()


def reshard(model: nn.Module) -> None:
    """Free FSDP2's gathered parameters after forwards without a backward (evaluation, the packing check). FSDP2
    keeps the root, and every unit with reshard_after_forward false, gathered until a backward, its modules holding
    plain full tensors in place of their sharded parameters meanwhile: an optimizer built then would update those.
    FSDP1 needs none: its optimizer holds the flat parameters themselves, gathered or not."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def compute_device(model: nn.Module) -> torch.device:
    """Where the model computes; with CPU offload its parameters live on the CPU instead."""
    param = next(model.parameters())
    if hasattr(param, "device_mesh"):  # FSDP2: the mesh's device
        return torch.device(param.device_mesh.device_type)
    if isinstance(model, FSDP):
        return model.compute_device
    return param.device


@contextlib.contextmanager
def buffers_beside_parameters(model: nn.Module):
    """torch's full-state-dict load (set_model_state_dict with broadcast_from_rank0) wants all of the model's
    state-dict tensors on one device ("Multiple devices found"); with CPU offload the parameters are on the CPU and
    the buffers on the GPU. A persistent buffer (Gemma 4's layer_scalar) joins the parameters for the load."""
    device = next(model.parameters()).device
    buffers = [(module, name, buffer.device) for module in model.modules()
               for name, buffer in module._buffers.items() if buffer is not None]
    for module, name, _ in buffers:
        module._buffers[name] = module._buffers[name].to(device)
    try:
        yield
    finally:
        for module, name, home in buffers:
            module._buffers[name] = module._buffers[name].to(home)


def state_dict_name(name: str) -> str:
    """A parameter's or buffer's name as state-dict keys spell it: without FSDP1's and activation checkpointing's
    wrapper prefixes."""
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def original_ndims(model: nn.Module) -> dict[int, int]:
    """id(parameter) -> the number of dimensions of the parameter as the model defines it. FSDP1's original
    parameters (use_orig_params=True) are 1-D views of this rank's shard, so their shapes come from the flat
    parameter's records; FSDP2's DTensors and unsharded parameters report their own."""
    ndims = {id(p): p.ndim for p in model.parameters()}
    for unit in model.modules():
        handle = unit._handle if isinstance(unit, FSDP) else None
        if handle is not None:
            flat = handle.flat_param
            ndims.update({id(param): len(shape) for param, shape in zip(flat._params, flat._shapes)})
    return ndims


def describe_plan(model: nn.Module, plan: ShardingPlan) -> str:
    """The resolved plan as rank 0 prints it at start."""
    world = dist.get_world_size()
    device = "cuda (NCCL)" if compute_device(model).type == "cuda" else "cpu (gloo)"
    local = sum(local_numel(p) for p in model.parameters())
    if plan.fsdp_version == 1:
        engine = "FSDP1 (FullyShardedDataParallel)"
        strategy = f"{plan.sharding_strategy}, mesh {' x '.join(map(str, plan.mesh_shape))}"
        if isinstance(model, FSDP) and model.sharding_strategy.name != plan.sharding_strategy:  # NO_SHARD on 1 rank
            strategy = (f"{model.sharding_strategy.name}, mesh 1 (what torch runs on 1 rank, for the "
                        f"{plan.sharding_strategy} asked)")
    else:
        engine = "FSDP2 (fully_shard)"
        kind = "HSDP (replicate x shard)" if len(plan.mesh_shape) == 2 else "shard"
        strategy = (f"{kind} mesh {' x '.join(map(str, plan.mesh_shape))}, "
                    f"reshard_after_forward={plan.reshard_after_forward}")
    precision = {
        "bf16": "bf16 compute, fp32 master weights, fp32 gradient reduction, fp32 optimizer state",
        "no": "fp32 compute, master weights, reduction and optimizer state",
        "pure_bf16": "pure bf16: bf16 compute, master weights, reduction and optimizer state",
    }[plan.mixed_precision]
    if plan.gradient_sync == "every_micro_batch":
        sync = "every micro-batch"
    else:
        # FSDP1's no_sync accumulates the unsharded gradients in the compute dtype; FSDP2 in the reduction dtype.
        dtype = " in bf16" if plan.fsdp_version == 1 and plan.mixed_precision == "bf16" else ""
        sync = f"last micro-batch of each step, full gradients accumulate{dtype} in between"
    # Name the classes that checkpointing and compile apply to unless they are the decoder layers the model declares:
    # size-based units do not name them, and fsdp_transformer_layer_cls_to_wrap may name another (LlamaMLP).
    default_layers = plan.auto_wrap_policy == "TRANSFORMER_BASED_WRAP" and plan.layer_cls_names is None
    layers = "each decoder layer" if default_layers else f"each {plan.layer_classes}"
    lines = [
        # The device says what ran: a GPU accelerate config on a machine without CUDA trains on the CPU.
        f"engine: {engine} over {ranks(world)} on {device}",
        f"wrapped: {plan.wrapped}, then the root",
        f"strategy: {strategy}",
        f"precision: {precision}",
        f"offload: {'parameters, gradients and optimizer state on CPU' if plan.offload_params else 'none'}",
        f"activation checkpointing: {layers if plan.activation_checkpointing else 'off'}",
        f"loading: {'rank 0 reads the weights, broadcast while sharding' if plan.cpu_ram_efficient_loading else 'every rank reads the weights'}",
        f"gradient sync: {sync}",
        f"parameters: {plan.total_params:,} total, {local:,} on rank {dist.get_rank()}",
    ]
    pieces = (f", with graph breaks at the FSDP2 hooks of the units inside it ({plan.units_in_compiled_layers})"
              if plan.units_in_compiled_layers else "")
    lines += [f"torch.compile: {layers}{pieces}"] if plan.torch_compile else []
    lines += [f"note: {o}" for o in plan.overrides]
    return "\n".join("  " + line for line in lines)


def make_collectable(model: nn.Module) -> None:
    """Let the garbage collector free a sharded model its caller is done with. FSDP1 keeps views of each flat
    parameter from the last forward (torch drops them after a backward only, so not after an evaluation, nor ever
    with NO_SHARD), and a view refers to its flat parameter from C++, out of the collector's sight."""
    for unit in FSDP.fsdp_modules(model):
        views = unit._handle.flat_param._tensors if unit._handle is not None else None
        for i in range(len(views or ())):
            views[i] = None


def gradient_sync(model: nn.Module, enabled: bool):
    """Context for one micro-batch's forward and backward: with enabled=False gradients accumulate locally."""
    if enabled:
        return contextlib.nullcontext()
    if isinstance(model, FSDP):
        return model.no_sync()
    if isinstance(model, FSDPModule):
        return fsdp2.no_sync(model)
    return contextlib.nullcontext()  # an unsharded model has nothing to synchronise
