"""The checkpoint cost benchmark runs every phase on a tiny model and cleans up after itself."""

import json
import sys

from conftest import run


def test_checkpoint_benchmark_measures_every_phase(tmp_path):
    out = tmp_path / "checkpoint.json"
    run([sys.executable, "bench/checkpoint_bench.py", "--work_dir", tmp_path / "work", "--num_layers", "1",
         "--hidden_size", "128", "--vocab_size", "2000", "--out", out])
    [result] = json.loads(out.read_text())["results"]
    assert [p["phase"] for p in result["phases"]] == ["sharded save", "full save", "resume (sharded)",
                                                      "resume (full)", "convert (100MB files)"]
    assert all(p["seconds"] > 0 and p["peak_rss_mb"] > 0 for p in result["phases"])
    # Weights and both Adam moments, in fp32: the optimizer state was really filled.
    assert 3 * result["model_bytes"] < result["sharded_checkpoint_bytes"] < 4 * result["model_bytes"]
    assert result["largest_output_file_bytes"] > result["model_bytes"]  # one file: the tiny model is under 100MB
    assert list((tmp_path / "work").iterdir()) == []
