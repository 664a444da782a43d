"""The schedule. warmup_steps: a number of steps or a fraction of the run, as transformers' TrainingArguments reads
it, and never the whole run (the learning rate would never reach learning_rate, nor decay). The run's length: at
least one step."""

import dataclasses
import sys

import pytest
from transformers import TrainingArguments

from conftest import run
from fsdp_recipes.config import ConfigError, parse_config
from fsdp_recipes.schedule import count_total_steps


def config(*args):
    return parse_config(["--model_name_or_path", "m", "--dataset_name", "d", *args])


def test_warmup_steps_count_as_transformers_counts_them(tmp_path):
    # "1" is one step, not the whole run: the boundary between a fraction and a number of steps.
    for warmup, total_steps in [("0", 5), ("0.03", 4), ("0.03", 100), ("0.03", 101), ("0.5", 7), ("1", 10), ("2", 3),
                                ("50", 51)]:
        reference = TrainingArguments(output_dir=str(tmp_path), warmup_steps=float(warmup), report_to="none")
        assert config("--warmup_steps", warmup).num_warmup_steps(total_steps) == reference.get_warmup_steps(total_steps)
    # The shipped fine-tuning YAMLs give 3% of the run: 1 step of 4, 30 of 1,000; none of a 1-step smoke test.
    shipped = parse_config(["--config", "recipes/configs/llama_sft.yaml", "--dataset_name", "d"])
    assert [shipped.num_warmup_steps(n) for n in (1, 4, 1000)] == [0, 1, 30]


def test_a_warmup_as_long_as_the_run_is_refused(tiny, tmp_path):
    with pytest.raises(ConfigError, match=r"warmup_steps 3 covers the whole run of 3 steps"):
        config("--warmup_steps", "3").num_warmup_steps(3)
    assert [config("--warmup_steps", "0.5").num_warmup_steps(n) for n in (1, 2, 3)] == [0, 1, 2]
    for value in ("2.5", "-1", "inf"):
        with pytest.raises(ConfigError, match="warmup_steps must be a whole number of steps, or a fraction in"):
            config("--warmup_steps", value)
    # Through a recipe: the run's length is known once the data is (here max_steps); it stops before the model loads.
    proc = run([sys.executable, "recipes/llama_sft.py", "--config", "recipes/configs/llama_sft.yaml",
                "--model_name_or_path", tiny["model"], "--dataset_name", tiny["data"], "--output_dir", tmp_path,
                "--max_steps", "3", "--warmup_steps", "50", "--max_seq_length", "64"], expect_rc=2)
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: warmup_steps 50 covers the whole run of 3 steps: the learning rate would never reach learning_rate "
        "1e-05, nor decay. Lower warmup_steps (steps below 3, or a fraction of the run such as 0.03) or train longer "
        "(max_steps, num_train_epochs)")
    assert "sharding plan" not in proc.stdout and not (tmp_path / "metrics.jsonl").exists()


def test_data_too_small_for_one_step_says_which_key_to_change():
    examples = range(10)
    with pytest.raises(ConfigError, match="^10 examples cannot fill one batch of 8 on each of 2 ranks: lower "
                                          "per_device_train_batch_size or add data$"):
        count_total_steps(config("--per_device_train_batch_size", "8"), examples, world_size=2)
    with pytest.raises(ConfigError, match="^10 examples cannot fill one batch of 16 on 1 rank: lower "):
        count_total_steps(config("--per_device_train_batch_size", "16"), examples, world_size=1)
    with pytest.raises(ConfigError, match="^one epoch gives each rank 5 micro-batches, fewer than "
                                          "gradient_accumulation_steps=8: lower it or add data$"):
        count_total_steps(config("--gradient_accumulation_steps", "8"), examples, world_size=2)
    assert count_total_steps(config("--gradient_accumulation_steps", "2", "--num_train_epochs", "3"), examples, 2) == 6
    # Exactly one batch on each rank is enough.
    assert count_total_steps(config("--per_device_train_batch_size", "5"), examples, world_size=2) == 1
    # With max_steps too: no epoch gives a step (the data stream would divide by its 0 steps an epoch).
    with pytest.raises(ConfigError, match="^one epoch gives each rank 5 micro-batches, fewer than "
                                          "gradient_accumulation_steps=8"):
        count_total_steps(config("--gradient_accumulation_steps", "8", "--max_steps", "3"), examples, world_size=2)
    with pytest.raises(ConfigError, match=r"^num_train_epochs 1e-09 of 5 steps an epoch is no optimizer step: raise "
                                          "num_train_epochs, or set max_steps$"):
        count_total_steps(config("--num_train_epochs", "1e-9"), examples, world_size=2)


def test_fractions_of_a_run_are_not_rounded_up_past_a_whole_step():
    # In floats 1.1 x 100 is 110.00000000000001 and 0.07 x 100 is 7.000000000000001: not 111 and 8 steps.
    cfg = config("--num_train_epochs", "1.1", "--warmup_steps", "0.07", "--per_device_train_batch_size", "1")
    total_steps = count_total_steps(cfg, range(100), world_size=1)
    assert (total_steps, cfg.num_warmup_steps(100)) == (110, 7)
    assert count_total_steps(dataclasses.replace(cfg, num_train_epochs=1.105), range(100), world_size=1) == 111
