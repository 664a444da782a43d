"""The figures only a GPU has: CUDA peak memory and MFU. Skipped without CUDA; run by bench/gpu_sharding_check.sh."""

import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import read_metrics, run
from fsdp_recipes.flops import peak_flops, training_flops_per_token

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: bench/gpu_sharding_check.sh runs it on the GPUs")


def test_cuda_peak_memory_and_mfu_are_logged(tiny, tmp_path):
    # One process, bf16 compute, accumulation 4 x 4 sequences (llama_sft.yaml), a log every step.
    run([sys.executable, "recipes/llama_sft.py", "--config", "recipes/configs/llama_sft.yaml",
         "--model_name_or_path", tiny["model"], "--dataset_name", tiny["data"], "--output_dir", tmp_path / "out",
         "--max_steps", "3", "--max_seq_length", "64", "--logging_steps", "1"])
    metrics = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    peak = peak_flops(torch.device("cuda", 0))
    model = AutoModelForCausalLM.from_pretrained(tiny["model"])
    for m in metrics:
        assert 0 < m["peak_allocated_gib"] <= m["peak_reserved_gib"] and m["peak_rss_gib"] > 0
        if peak is None:
            assert "mfu" not in m, "MFU needs the device's peak FLOP/s"
            continue
        # The step's 16 rows, padded to their batch's longest: the mean row length the attention FLOPs use.
        mean_row_length = round(m["input_tokens"] / m["real_token_share"]) / 16
        expected = m["tokens_per_second_per_device"] * training_flops_per_token(model, round(mean_row_length)) / peak
        assert m["mfu"] == pytest.approx(expected, rel=1e-9) and 0 < m["mfu"] < 1
