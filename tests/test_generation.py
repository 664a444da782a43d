"""Sample generation reloads the exported folder as the run computed the model."""

import torch

from fsdp_recipes.generation import generate_samples, load_exported_model


def test_the_exported_model_is_reloaded_with_the_runs_attention_implementation(tiny):
    # config.json does not record it: without it, transformers picks sdpa, which skips Gemma 2's soft-capping (5.17).
    for attn in ("eager", "sdpa"):
        model = load_exported_model(tiny["model"], attn, torch.device("cpu"))
        assert model.config._attn_implementation == attn
    eager, sdpa = (generate_samples(tiny["model"], ["reverse: ab"], 4, True, torch.device("cpu"), attn)
                   for attn in ("eager", "sdpa"))
    assert eager == sdpa
