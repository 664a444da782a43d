"""The converter benchmark runs, and its numbers show streaming: the converter's memory stays near its largest
tensor, whatever the output file size, while accelerate merge-weights holds the whole model."""

import json
import sys

from conftest import run


def test_benchmark_runs_and_converter_memory_stays_near_one_tensor(tmp_path):
    # 12 layers of tensors of at most 3 MB (150 MB of fp32 weights), 50 MB output files: a converter that held one
    # output file (about 75 MB above its imports, measured) fails the memory bound below.
    proc = run([sys.executable, "bench/convert_bench.py", "--work_dir", tmp_path / "bench", "--hidden_size", "512",
                "--num_layers", "12", "--vocab_size", "1000", "--max_shard_size", "50MB"])
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    model_mb = report["model_bytes"] / 2**20
    # Anonymous memory: the shared libraries' pages in the RSS vary by up to 100 MB with a CUDA build of torch.
    peaks = [r["peak_anon_mb"] for r in report["results"].values()]  # baseline, ours, baseline, accelerate
    ours, accelerate = peaks[1] - peaks[0], peaks[3] - peaks[2]
    assert 140 < model_mb < 160
    tensor_mb = report["largest_tensor_bytes"] / 2**20
    # One tensor (read straight into place), plus a small overhead (3 to 4 MB in all, measured with torch 2.11 and 2.13).
    assert ours < tensor_mb + 32, f"converter used {ours} MB over its imports; largest tensor {tensor_mb:.1f} MB"
    assert accelerate > 0.9 * model_mb, f"merge-weights used {accelerate} MB: the measurement misses the load"
    assert (tmp_path / "bench" / "ours" / "model.safetensors.index.json").is_file()


def test_converter_memory_stays_near_one_expert_for_a_mixture_of_experts(tmp_path):
    # 16 experts of a 512-wide Qwen3-MoE: each layer's fused gate_up_proj is 64 MiB, its per-expert matrices 2 MiB.
    # Read and split one expert at a time, the converter holds a 4 MiB row and its two matrices; splitting the fused
    # tensor whole held it with all its copies (+133 MB, measured), and holding it alone is 64 MiB.
    proc = run([sys.executable, "bench/convert_bench.py", "--work_dir", tmp_path / "bench", "--hidden_size", "512",
                "--num_layers", "2", "--vocab_size", "1000", "--num_experts", "16", "--max_shard_size", "50MB"])
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    peaks = [r["peak_anon_mb"] for r in report["results"].values()]  # baseline, ours, baseline, accelerate
    assert report["largest_tensor_bytes"] == 64 * 2**20 and report["largest_output_tensor_bytes"] == 2 * 2**20
    assert peaks[1] - peaks[0] < 32, f"converter used {peaks[1] - peaks[0]} MB over its imports"
    index = json.loads((tmp_path / "bench" / "ours" / "model.safetensors.index.json").read_text())
    assert "model.layers.1.mlp.experts.15.up_proj.weight" in index["weight_map"]  # per expert, as on the Hub


def test_a_bad_max_shard_size_is_refused_before_the_checkpoint_is_written(tmp_path):
    """The converter refused it only after the benchmark had written its checkpoint (minutes at the default size)."""
    proc = run([sys.executable, "bench/convert_bench.py", "--work_dir", tmp_path / "bench", "--max_shard_size", "5XB"],
               expect_rc=1)
    assert proc.stderr.strip().splitlines()[-1] == (
        "--max_shard_size: max_shard_size must be a positive size such as 5GB, 500MB or 4GiB, got '5XB'")
    assert not (tmp_path / "bench").exists()
