"""The CPU throughput benchmark runs, and every variant trains on the same batches (a tiny model, 1 timed step, 2 rounds)."""

import json
import re
import sys

from conftest import REPO, load_bench, run


def test_throughput_benchmark_compares_variants_on_the_same_batches(tmp_path):
    out = tmp_path / "throughput.json"
    proc = run([sys.executable, "bench/train_throughput.py", "--out", out, "--vocab_size", "500", "--hidden_size", "64",
                "--num_layers", "1", "--max_seq_length", "64", "--steps", "1", "--repeats", "2",
                "--variants", "FSDP2 fp32 packed"])
    # The ratio needs the reference of each round: a variant named without it runs with it (it showed "-").
    assert "adding reference fp32 packed: each variant's ratio is to the reference run of its round" in proc.stdout
    reference, fsdp2 = json.loads(out.read_text())["results"]
    assert (reference["variant"], reference["ratio_to_reference"]) == ("reference fp32 packed", 1.0)
    assert (reference["processes"], reference["threads_per_process"]) == (1, 2)  # same total cores
    assert (fsdp2["processes"], fsdp2["threads_per_process"]) == (2, 1)
    # The two ranks together see exactly the real tokens the single process sees.
    assert fsdp2["real_tokens"] == reference["real_tokens"] > 0
    assert 0.5 < reference["real_token_share"] <= 1.0
    # Each round's ratio compares the runs of that round; the medians of 2 are the means.
    rounds = list(zip(fsdp2["real_tokens_per_second_of_each_run"], reference["real_tokens_per_second_of_each_run"]))
    assert len(rounds) == 2
    assert fsdp2["ratio_to_reference_of_each_round"] == [round(mine / ref, 3) for mine, ref in rounds]
    assert fsdp2["ratio_to_reference"] == round(sum(mine / ref for mine, ref in rounds) / 2, 2)
    assert fsdp2["real_tokens_per_second"] == sum(fsdp2["real_tokens_per_second_of_each_run"]) / 2
    assert len(fsdp2["peak_rss_mb_per_rank"]) == 2
    table = proc.stdout.split("real tok/s")[1]
    assert "reference fp32 packed" in table and "FSDP2 fp32 packed" in table


def test_an_odd_micro_batch_count_or_a_variant_named_twice_is_refused():
    proc = run([sys.executable, "bench/train_throughput.py", "--micro_batches", "3", "--variants", "FSDP2 fp32 packed"],
               expect_rc=1)
    assert "--micro_batches 3 does not split over 2 processes" in proc.stderr
    proc = run([sys.executable, "bench/train_throughput.py", "--variants", "FSDP2 fp32 packed,reference fp32 packed,"
                "FSDP2 fp32 packed"], expect_rc=1)
    assert proc.stderr.strip().splitlines()[-1] == (
        "variants named more than once: ['FSDP2 fp32 packed']; name each once")


def test_a_reference_several_variants_lack_is_added_once():
    """Added twice, the reference would run twice a round, and its runs would pair with the wrong ones of the others."""
    bench = load_bench("train_throughput")
    assert bench.missing_references(["FSDP2 fp32 packed", "FSDP1 fp32 packed", "FSDP2 bf16 packed"]) == [
        "reference fp32 packed", "reference bf16 packed"]
    assert bench.missing_references(["reference fp32 packed", "FSDP2 fp32 packed"]) == []


def test_packed_steps_have_their_rows_at_any_sequence_length():
    """Examples keep their lengths as max_seq_length grows, so a packed row holds more of them: at 4096 about 30."""
    import argparse

    bench = load_bench("train_throughput")
    for length in (512, 4096):
        args = argparse.Namespace(warmup_steps=1, steps=2, micro_batches=4, pack_batch_size=1, pad_batch_size=4,
                                  max_seq_length=length, vocab_size=500, seed=0)
        steps = bench.optimizer_steps(args, "packed")
        assert [len(step) for step in steps] == [4, 4, 4]
        rows = [mb for step in steps for mb in step]
        assert all(mb["input_ids"].shape[1] <= length for mb in rows)
        examples = sum(int((mb["position_ids"] == 0).sum()) for mb in rows)
        assert examples > length / 256 * len(rows)  # several examples a row, more at 4096


def test_readme_commands_run_each_variant_once():
    """The README's commands reproduce its table: between them every variant, each at the rounds its rows say."""
    bench = load_bench("train_throughput")
    commands = re.findall(r'train_throughput\.py --repeats (\d+) --variants "([^"]+)"', (REPO / "README.md").read_text())
    named = [name for _, variants in commands for name in variants.split(",")]
    assert sorted(named) == sorted(bench.VARIANTS)
    # 5 rounds for fp32 (their spread is reported), 1 for bf16 (9 minutes a round).
    assert {repeats: {bench.VARIANTS[n][2] for n in variants.split(",")} for repeats, variants in commands} == {
        "5": {"no"}, "1": {"bf16"}}


def test_flags_that_leave_nothing_to_time_are_refused_before_any_run():
    """--repeats 0 failed with an IndexError after every run, --steps 0, --micro_batches 0 and --hidden_size 32 with
    the workers' tracebacks (a 0/0 share, a missing column, 0 attention heads)."""
    for flag, value, message in [("--repeats", "0", "--repeats must be at least 1, got 0"),
                                 ("--steps", "0", "--steps must be at least 1, got 0"),
                                 ("--micro_batches", "0", "--micro_batches must be at least 1, got 0"),
                                 ("--warmup_steps", "-1", "--warmup_steps must be at least 0, got -1"),
                                 ("--hidden_size", "32",
                                  "--hidden_size must be at least 64 (one attention head per 64), got 32")]:
        proc = run([sys.executable, "bench/train_throughput.py", flag, value, "--variants", "reference fp32 packed"],
                   expect_rc=1)
        assert proc.stderr.strip().splitlines()[-1] == message
        assert "machine:" not in proc.stdout  # refused before the first run


def test_every_benchmark_refuses_an_out_path_in_no_folder_before_it_runs(tmp_path):
    """The JSON was written last (train_throughput, checkpoint_bench: after every run, up to an hour) or after the
    first variant (gpu_mfu), and a missing folder then failed with a FileNotFoundError, the measurements lost."""
    out = tmp_path / "missing" / "results.json"
    for cmd in [["bench/train_throughput.py", "--variants", "reference fp32 packed"],
                ["bench/gpu_mfu.py", "--variants", "1B eager"],
                ["bench/checkpoint_bench.py", "--work_dir", tmp_path / "work"]]:
        proc = run([sys.executable, *cmd, "--out", out], expect_rc=1)
        assert proc.stderr.strip().splitlines()[-1] == f"--out {out}: no such folder to write the JSON into"
    assert not (tmp_path / "work").exists()
