"""Supervised fine-tuning of any causal language model with FSDP, exported as a Hugging Face folder: the generic
recipe, for a family that has no recipe of its own.

    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/sft.py \
        --config recipes/configs/sft.yaml --model_name_or_path <hub id or folder> --dataset_name <data>

FSDP units are the model's decoder layers: the classes its `_no_split_modules` names, else the modules of the one
nn.ModuleList holding config.num_hidden_layers layers of one class (printed at start), else set
fsdp_transformer_layer_cls_to_wrap (the error lists the candidates). For a family you train often, give it a
recipe of its own with `make new-recipe MODEL=<model_type>` (README, "Adding a family").
"""

import gc
import os

from transformers import set_seed

from fsdp_recipes.cli import run_main
from fsdp_recipes.config import parse_config
from fsdp_recipes.data import build_datasets
from fsdp_recipes.distributed import distributed, print_rank0
from fsdp_recipes.export import save_hf_model
from fsdp_recipes.families import check_model_type
from fsdp_recipes.generation import log_sample_generations
from fsdp_recipes.metrics import MetricsLogger, check_wandb_credentials
from fsdp_recipes.model import export_dtype, load_sharded_model, load_tokenizer
from fsdp_recipes.output_dir import prepare_output_dir, remove_earlier_run
from fsdp_recipes.plan import resolve_plan
from fsdp_recipes.progress import configure_progress_bars
from fsdp_recipes.resume import resolve_resume
from fsdp_recipes.schedule import check_run_length
from fsdp_recipes.sharding import describe_plan, make_collectable
from fsdp_recipes.trainer import train

# ---- What this recipe holds of its own (the rest of the file is shared) ----
# config.json's model_type values this recipe trains, each with the attention implementations that compute the
# model exactly; None: every model type, with the attention implementations that fsdp_recipes/families.py's
# exact_attention allows for it (Gemma 2's attention soft-capping: not sdpa; Falcon's ALiBi: no flash attention).
MODEL_TYPES = None
# ---- Shared by every recipe (tests/test_recipes.py keeps it identical, so a fix reaches them all) ----


def main():
    cfg = parse_config(recipe=__file__)  # no --config: a warning names the recipe's YAML
    check_wandb_credentials(cfg)  # a missing W&B API key stops the run now, not after loading the model
    check_model_type(cfg, MODEL_TYPES, __file__)
    plan = resolve_plan(cfg)
    with distributed() as env:
        prepare_output_dir(cfg)  # an earlier run's checkpoints in output_dir: refused, unless overwrite_output_dir
        set_seed(cfg.seed)
        configure_progress_bars(env.is_main)

        # Tokenizer and data: rank 0 tokenizes first; the others read its cache (or, per node, fill their own).
        tokenizer = load_tokenizer(cfg)
        train_dataset, eval_dataset = build_datasets(cfg, tokenizer)
        check_run_length(cfg, train_dataset, env.world_size)  # a schedule that cannot work fails before the model loads

        # Model: master weights (fp32 unless pure bf16) sharded by decoder layer (or by size), then the root.
        model = load_sharded_model(cfg, plan, env.device)
        plan_text = describe_plan(model, plan)
        print_rank0("sharding plan:\n" + plan_text)

        # Resume: the checkpoint is checked against this model, tokenizer and data before anything is written.
        resume_from = resolve_resume(cfg, model, tokenizer, train_dataset)
        # With overwrite_output_dir: only now, so that a run refused on its data, model or checkpoint keeps it.
        remove_earlier_run(cfg)

        # Training, with evaluation on the held-out split; a resumed run continues its W&B run.
        logger = MetricsLogger(cfg, env.is_main, {"sharding_plan": {**vars(plan), "description": plan_text}},
                               resume_from)
        train(cfg, env, model, tokenizer, train_dataset, logger, resume_from, eval_dataset)

        # Export: a folder that AutoModelForCausalLM.from_pretrained loads; then sample answers from it, if asked.
        save_hf_model(model, tokenizer, os.path.join(cfg.output_dir, "final"), export_dtype(cfg), cfg.max_shard_size)
        print_rank0(f"saved {cfg.output_dir}/final")
        # The sharded model is freed: generation loads the whole exported model onto rank 0's GPU. FSDP's modules and
        # hooks refer to each other, so only the garbage collector frees them.
        make_collectable(model)
        del model
        gc.collect()
        log_sample_generations(cfg, os.path.join(cfg.output_dir, "final"), env.device, logger)
        logger.close()


if __name__ == "__main__":
    run_main(main)
