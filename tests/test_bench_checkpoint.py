"""The checkpoint cost benchmark runs every phase on a tiny model and cleans up after itself."""

import json
import sys

import torch

from conftest import load_bench, run


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



def test_a_phase_counts_the_memory_it_reuses_from_an_earlier_phases_freed_tensors(one_process_group):
    """glibc keeps freed heap memory: a phase whose tensors reuse it must still count them (128 MiB here)."""
    mib, kept = 2 ** 20, []

    def allocate_and_free():
        torch.empty(16 * mib, dtype=torch.uint8)  # a mapping freed at once raises glibc's mmap threshold past 4 MiB
        blocks = [torch.ones(4 * mib, dtype=torch.uint8) for _ in range(32)]  # so these come from the heap,
        kept.append(torch.ones(mib, dtype=torch.uint8))  # which cannot shrink past this one when they are freed
        del blocks

    bench = load_bench("checkpoint_bench")
    bench.measure_phase("allocate and free", allocate_and_free)
    reuse = bench.measure_phase("allocate again", lambda: kept.append(
        [torch.ones(4 * mib, dtype=torch.uint8) for _ in range(32)]))
    assert 120 < reuse["extra_rss_mb"] < 140


def test_bad_model_sizes_are_refused_before_any_run(tmp_path):
    """--num_layers 1,x failed with a ValueError traceback, --num_layers 0 with the workers' errors."""
    for flags, message in [
            (["--num_layers", "1,x"], "--num_layers must be comma-separated positive integers, got '1,x'"),
            (["--num_layers", "0"], "--num_layers must be comma-separated positive integers, got '0'"),
            (["--hidden_size", "32"], "--hidden_size must be at least 64 (one attention head per 64) and --vocab_size "
                                      "at least 1, got 32 and 32000")]:
        proc = run([sys.executable, "bench/checkpoint_bench.py", "--work_dir", tmp_path / "work", *flags], expect_rc=1)
        assert proc.stderr.strip().splitlines()[-1] == message
        assert not (tmp_path / "work").exists()
