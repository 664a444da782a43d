"""The converter benchmark runs, and its numbers show streaming: the converter's memory stays near one output
file while accelerate merge-weights holds the whole model."""

import json
import sys

from conftest import run


def test_benchmark_runs_and_converter_memory_stays_near_one_shard(tmp_path):
    # 12 layers of 3-9 MB tensors (150 MB of fp32 weights), 10 MB output files.
    proc = run([sys.executable, "bench/convert_bench.py", "--work_dir", tmp_path / "bench", "--hidden_size", "512",
                "--num_layers", "12", "--vocab_size", "1000", "--max_shard_size", "10MB"])
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    model_mb = report["model_bytes"] / 2**20
    peaks = [r["peak_rss_mb"] for r in report["results"].values()]  # baseline, ours, baseline, accelerate
    ours, accelerate = peaks[1] - peaks[0], peaks[3] - peaks[2]
    assert 140 < model_mb < 160
    assert ours < 0.3 * model_mb, f"converter used {ours} MB over its imports for a {model_mb:.0f} MB model"
    assert accelerate > 0.9 * model_mb, f"merge-weights used {accelerate} MB: the measurement misses the load"
    assert (tmp_path / "bench" / "ours" / "model.safetensors.index.json").is_file()
