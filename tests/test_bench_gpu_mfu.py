"""The GPU benchmark's whole path runs on the CPU with a tiny config: data, sharding, the step, FLOPs and the table."""

import argparse
import json
import math
import sys

from transformers import LlamaConfig

from conftest import load_bench, run
from fsdp_recipes.flops import build_meta_model



def test_gpu_benchmark_runs_a_local_config_with_and_without_activation_checkpointing(tmp_path):
    hidden, intermediate, layers, heads, kv_heads, head_dim, vocab, seq = 64, 128, 2, 4, 2, 16, 512, 128
    LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                tie_word_embeddings=True).save_pretrained(tmp_path / "tiny")
    out = tmp_path / "mfu.json"
    variants = [f"{tmp_path / 'tiny'} eager + AC", f"{tmp_path / 'tiny'} eager"]
    proc = run([sys.executable, "bench/gpu_mfu.py", "--variants", ",".join(variants), "--seq_len", seq,
                "--steps", 2, "--peak_tflops", 0.001, "--out", out])
    results = json.loads(out.read_text())["results"]
    assert [r["variant"] for r in results] == variants
    # q, k, v, o, gate, up, down per layer, and the tied lm_head; attention over the whole sequence.
    matmul_params = layers * (hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
                              + 3 * hidden * intermediate) + vocab * hidden
    flops = 6 * matmul_params + 12 * layers * heads * head_dim * seq
    for r in results:
        assert r["flops_per_token"] == flops
        # MFU against --peak_tflops 0.001, within the rounding of tokens/s (to 1) and of MFU (to 4 places).
        assert abs(r["mfu"] - flops * r["tokens_per_second"] / 1e9) <= flops * 0.5 / 1e9 + 5e-5
        # Every example is longer than 128 tokens and truncated, so each packed row is full: 2 rows per step,
        # each one example, which attends to the whole row either way.
        assert r["tokens_per_step"] == 2 * seq
        assert r["mean_row_length"] == r["mean_example_length"] == seq
        assert r["mfu_attention_per_example"] == r["mfu"]
        assert r["peak_rss_gib"] > 0
    # Recomputation gives the same numbers: the same loss after 4 steps (2 of warm-up), near a random model's
    # log(vocab).
    checkpointed, plain = results
    assert checkpointed["last_step_loss"] == plain["last_step_loss"]
    assert abs(plain["last_step_loss"] - math.log(vocab)) < 0.5
    table = proc.stdout.split("tokens/s")[-1]
    assert variants[0] in table and variants[1] in table


def test_compiled_variant_compiles_every_row_it_times_in_the_warm_up(tmp_path):
    # Rows of up to 512 tokens: several lengths, and rows of one example (no mask: another graph) and of several.
    # The timed steps run under torch.compiler's fail_on_recompile stance, so a compilation there fails the variant.
    LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, tie_word_embeddings=True).save_pretrained(tmp_path / "tiny")
    args = argparse.Namespace(seq_len=512, batch_size=1, accumulation=2)
    rows = [mb for step in load_bench("gpu_mfu").packed_steps(args, 3, 512) for mb in step]
    examples_per_row = [int((mb["position_ids"] == 0).sum()) for mb in rows]
    assert 1 in examples_per_row and max(examples_per_row) > 1
    assert len({mb["input_ids"].shape[1] for mb in rows}) > 2
    run([sys.executable, "bench/gpu_mfu.py", "--variants", f"{tmp_path / 'tiny'} compile", "--seq_len", 512,
         "--steps", 3, "--out", tmp_path / "mfu.json"])
    [result] = json.loads((tmp_path / "mfu.json").read_text())["results"]
    assert "error" not in result, result["error"]
    assert result["tokens_per_step"] == sum(int(mb["attention_mask"].sum()) for mb in rows) / 3


def test_attention_lengths_of_packed_rows():
    """Rows of 8 slots: examples of 3 and 5 tokens; one of 4 tokens and 4 slots of padding."""
    from fsdp_recipes.data import collate

    rows = [{"input_ids": [9] * 8, "labels": [9] * 8, "position_ids": [0, 1, 2, 0, 1, 2, 3, 4]},
            {"input_ids": [9] * 4, "labels": [9] * 4, "position_ids": [0, 1, 2, 3]}]
    batch = collate(rows, pad_token_id=0)
    assert load_bench("gpu_mfu").attention_lengths([batch]) == (8.0, [3, 5, 4])


def test_gpu_benchmark_shapes_are_llama_3_2_and_bad_variants_are_refused():
    bench = load_bench("gpu_mfu")
    for name, parameters in (("1B", 1_235_814_400), ("3B", 3_212_749_824)):  # Llama-3.2-1B's and 3B's counts
        model = build_meta_model(bench.model_config(name, 4096))
        assert sum(p.numel() for p in model.parameters()) == parameters
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert bench.parse_variant("3B compile + AC") == ("3B", True, True)
    assert bench.parse_variant("my org/model eager") == ("my org/model", False, False)
    proc = run([sys.executable, "bench/gpu_mfu.py", "--variants", "3B fast"], expect_rc=1)
    assert "variant '3B fast' must be a model followed by one of the modes: eager, compile" in proc.stderr


def test_flags_that_leave_nothing_to_time_are_refused_before_any_variant_and_mfu_reads_as_in_the_table():
    """--steps 0 failed each variant with its worker's ZeroDivisionError; the progress line printed "MFU None" on
    the CPU and a bare fraction (0.4312) where the table prints 43.1%."""
    for flag in ["--steps", "--seq_len", "--batch_size", "--accumulation"]:
        proc = run([sys.executable, "bench/gpu_mfu.py", flag, "0", "--variants", "1B eager"], expect_rc=1)
        assert proc.stderr.strip().splitlines()[-1] == f"{flag} must be at least 1, got 0"
    bench = load_bench("gpu_mfu")
    assert (bench.mfu_text(None), bench.mfu_text(0.4312)) == ("-", "43.1%")


def test_a_variant_the_budget_leaves_out_says_to_raise_it(tmp_path):
    """Skipped or stopped, a variant said only "time budget spent", without naming --budget_s (not in the README)."""
    out = tmp_path / "mfu.json"
    proc = run([sys.executable, "bench/gpu_mfu.py", "--variants", "1B eager", "--budget_s", "20", "--out", out])
    message = "skipped: under 30 s of --budget_s 20 left: raise --budget_s to run it"
    assert json.loads(out.read_text())["results"] == [{"variant": "1B eager", "error": message}]
    assert f"  1B eager: {message}" in proc.stdout


def test_a_variant_stopped_by_the_budget_names_the_budget_given():
    """The timeout is what was left of the budget when the variant started: the message names --budget_s itself."""
    bench = load_bench("gpu_mfu")
    assert bench.run_variant("1B eager", [], timeout=0.01, budget_s=900) == {
        "variant": "1B eager", "error": "timed out: --budget_s 900 ran out: raise --budget_s to finish it"}
