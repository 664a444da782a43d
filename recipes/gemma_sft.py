"""Supervised fine-tuning of Gemma 2 and Gemma 3 text (1B) with FSDP, exported as a Hugging Face folder.

    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/gemma_sft.py \
        --config recipes/configs/gemma3_sft.yaml --model_name_or_path google/gemma-3-1b-it --dataset_name <data>

Gemma 2: recipes/configs/gemma2_sft.yaml. What is particular to Gemma, and tested:
- The input embedding and lm_head are tied (one weight in the root FSDP group, exported once), and embeddings are
  scaled by sqrt(hidden_size): Gemma 3 keeps the factor in a non-persistent buffer, which rank-0 loading
  (fsdp_cpu_ram_efficient_loading) restores after the meta-device build.
- Gemma 2 soft-caps attention scores (50) and final logits (30). sdpa cannot soft-cap attention (transformers 5.17
  runs it without the cap, later versions refuse it), so Gemma 2 needs eager, flex_attention or flash_attention_2, 3
  or 4 (also when loading the exported folder); the loss is computed from the model's capped logits.
- Sliding-window attention on alternate layers (Gemma 2) or 5 of every 6 (Gemma 3).
- The chat templates have no system role: Gemma 2's raises an error on one, Gemma 3's merges it into the first
  user turn.

Copying this recipe for another family: `make new-recipe MODEL=<model_type>` writes the copy, with MODEL_TYPES set
to that model type (README, "Adding a family"); then set the defaults in its YAML config. The shared part stays as
it is.
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
# model exactly (None: any). The YAML config holds the rest: hub id, learning rate, sequence length.
# Gemma 2's attention implementations (eager, flash or flex: sdpa would skip soft-capping) are those of
# fsdp_recipes/families.py's exact_attention, which every recipe checks.
MODEL_TYPES = {"gemma2": None, "gemma3_text": None}
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
