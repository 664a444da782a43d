"""A model given as a Hub id and read offline from a Hugging Face cache filled beforehand, as on a cluster whose
compute nodes have no network: the run, its export and the estimate work as with a local folder, and an id the
cache lacks is an error that names the cache and how to fill it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from safetensors.torch import load_file

from conftest import REPO, read_metrics, run, torchrun

REPO_ID = "tinyorg/tiny-llama"


def add_to_hub_cache(cache: Path, repo_id: str, folder: Path) -> Path:
    """`folder`'s files as huggingface_hub's cache holds a download of `repo_id` (its file_download.py):
    models--<org>--<name>/blobs/<sha256>, snapshots/<commit>/<file> linking to the blob, refs/main naming the
    commit. Returns the snapshot folder."""
    root = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    snapshot = root / "snapshots" / commit
    for file in sorted(folder.rglob("*")):
        if file.is_file():
            blob = root / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(file, blob)
            link = snapshot / file.relative_to(folder)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


def test_a_hub_id_trains_exports_and_estimates_from_the_offline_cache(tiny, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny["model"], model)
    generation = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**generation, "repetition_penalty": 1.1}))
    (model / "preprocessor_config.json").write_text('{"image_size": 8}')
    add_to_hub_cache(tmp_path / "hub", REPO_ID, model)
    out = tmp_path / "out"
    torchrun("recipes/llama_sft.py", "--config", "recipes/configs/llama_sft.yaml", "--model_name_or_path", REPO_ID,
             "--dataset_name", tiny["data"], "--output_dir", out, "--max_steps", "2", "--save_steps", "2",
             "--logging_steps", "1", "--per_device_train_batch_size", "2", "--max_seq_length", "64",
             "--generation_prompts", "reverse: abc", "--generation_max_new_tokens", "4",
             HF_HUB_CACHE=str(tmp_path / "hub"))
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == [1, 2]
    final = out / "final"
    # What the export takes from the source model: the tokenizer, its chat template, the generation and processor
    # configs, found through the cache as in a folder.
    assert {p.name for p in final.iterdir()} == {"config.json", "model.safetensors", "generation_config.json",
                                                 "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                                                 "preprocessor_config.json"}
    assert json.loads((final / "generation_config.json").read_text())["repetition_penalty"] == 1.1
    assert (final / "preprocessor_config.json").read_text() == '{"image_size": 8}'
    assert (final / "chat_template.jinja").read_text() == (model / "chat_template.jinja").read_text()
    assert load_file(final / "model.safetensors").keys() == load_file(model / "model.safetensors").keys()
    assert [json.loads(line)["prompt"] for line in (out / "samples.jsonl").read_text().splitlines()] == ["reverse: abc"]
    proc = run([sys.executable, "-m", "fsdp_recipes.estimate", "--model", REPO_ID, "--num_gpus", "2",
                "--seq_len", "64"], HF_HUB_CACHE=str(tmp_path / "hub"))
    assert proc.stdout.startswith("model: LlamaForCausalLM, ")


def test_a_hub_id_missing_from_the_offline_cache_names_the_cache(tiny, tmp_path):
    add_to_hub_cache(tmp_path / "hub", REPO_ID, tiny["model"])
    # A download with --include "tokenizer*": the id's folder is there, its config.json not.
    (tmp_path / "tokenizer_only").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny["model"] / name, tmp_path / "tokenizer_only")
    add_to_hub_cache(tmp_path / "hub", "tinyorg/part", tmp_path / "tokenizer_only")
    # The model, the tokenizer and the estimate's model, each an id the cache lacks; a model it holds in part; and a
    # data set: datasets reads one offline from its own prepared copy alone.
    script = (
        "from fsdp_recipes.config import ConfigError, parse_config\n"
        "from fsdp_recipes.families import check_model_type\n"
        "from fsdp_recipes.model import load_tokenizer\n"
        "from fsdp_recipes.estimate import load_config\n"
        "from fsdp_recipes.data_sources import load_split\n"
        "calls = [lambda: check_model_type(parse_config(['--model_name_or_path', 'tinyorg/absent', '--dataset_name',"
        " 'd.jsonl']), None, 'recipes/sft.py'),\n"
        "         lambda: load_tokenizer(parse_config(['--model_name_or_path', 'tinyorg/tiny-llama',"
        " '--tokenizer_name_or_path', 'tinyorg/absent', '--dataset_name', 'd.jsonl'])),\n"
        "         lambda: load_config('tinyorg/absent'),\n"
        "         lambda: check_model_type(parse_config(['--model_name_or_path', 'tinyorg/part', '--dataset_name',"
        " 'd.jsonl']), None, 'recipes/sft.py'),\n"
        "         lambda: load_split('tinyorg/absent-data', None, 'train')]\n"
        "for call in calls:\n"
        "    try:\n"
        "        call()\n"
        "    except ConfigError as error:\n"
        "        print(error)\n"
    )
    proc = run([sys.executable, "-c", script], HF_HUB_CACHE=str(tmp_path / "hub"),
               HF_DATASETS_CACHE=str(tmp_path / "datasets"))
    fill = (f"nor in the Hugging Face cache {tmp_path}/hub, and the Hub cannot be reached (HF_HUB_OFFLINE is set) to "
            f"download it: download it into that cache where the Hub can be reached (hf download tinyorg/absent, with "
            f"the same HF_HOME or HF_HUB_CACHE), or set HF_HOME (or HF_HUB_CACHE) to the cache that holds it")
    assert proc.stdout.splitlines() == [
        f"model_name_or_path tinyorg/absent: no such folder in {REPO}, {fill}",
        f"tokenizer_name_or_path tinyorg/absent: no such folder in {REPO}, {fill}",
        f"--model tinyorg/absent: no such folder in {REPO}, {fill}",
        f"model_name_or_path tinyorg/part: the Hugging Face cache {tmp_path}/hub holds only part of it, without a file "
        f"the load needs, and the Hub cannot be reached (HF_HUB_OFFLINE is set) to download that: download it whole "
        f"into that cache where the Hub can be reached (hf download tinyorg/part, without --include)",
        f"dataset_name tinyorg/absent-data: no such file or folder in {REPO}, and the Hub cannot be reached to look "
        f"for a data set of that name (Couldn't reach 'tinyorg/absent-data' on the Hub (OfflineModeIsEnabled)), nor "
        f"does the datasets cache {tmp_path}/datasets hold a copy of it: load it once with datasets.load_dataset where "
        f"the Hub can be reached, with the same HF_HOME (or HF_DATASETS_CACHE), or set HF_HOME to the cache that holds "
        f"it",
    ]
