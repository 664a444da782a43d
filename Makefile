# Set-up and entry points. Every target creates or reuses the virtual environment in $(VENV).
PYTHON ?= python3
VENV ?= .venv
# Installed only when the venv has no torch yet; on a GPU cluster pick the build for your CUDA, e.g.
# make TORCH_SPEC="torch==2.11.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

DEMO_DIR ?= demo
RECIPES_DIR ?= recipes

.PHONY: demo test clean new-recipe

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first: with it in place, requirements.txt's torch>=2.11 is already met and pip pulls no other build.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/pip install -q -r requirements.txt -r requirements-dev.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m fsdp_recipes.demo prepare --out_dir $(DEMO_DIR)
	$(BIN)/python -m fsdp_recipes.demo evaluate --model $(DEMO_DIR)/base_model --data $(DEMO_DIR)/eval.jsonl
	$(BIN)/accelerate launch --config_file accelerate_configs/fsdp2_cpu.yaml --main_process_port 0 \
		recipes/llama_sft.py --config recipes/configs/demo.yaml --model_name_or_path $(DEMO_DIR)/base_model \
		--dataset_name $(DEMO_DIR)/train.jsonl --output_dir $(DEMO_DIR)/output --overwrite_output_dir true
	$(BIN)/python -m fsdp_recipes.demo evaluate --model $(DEMO_DIR)/output/final --data $(DEMO_DIR)/eval.jsonl \
		--min_accuracy 0.9

# The tests' temporary folders go in .pytest_tmp beside the checkout (removed at the next run), not in /tmp.
# Two pytest-xdist workers: a 2-process test leaves a third of 2 cores idle (launchers, rank 0's work alone), which
# the other worker's test fills. By file (loadfile): a module's costly fixtures (test_sharding's runs) are built once.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=10 --basetemp=.pytest_tmp tests

# Standard library only, so no venv: writes $(RECIPES_DIR)/<MODEL>_sft.py and configs/<MODEL>_sft.yaml (a hyphen
# in MODEL becomes an underscore in the file names).
new-recipe:
	@test -n "$(MODEL)" || { echo "usage: make new-recipe MODEL=<model_type of config.json, e.g. olmo2>"; exit 2; }
	$(PYTHON) -m fsdp_recipes.new_recipe $(MODEL) --recipes_dir $(RECIPES_DIR)

# Removes the venv and the demo's folder (the ones named by VENV and DEMO_DIR when they are set).
clean:
	rm -rf $(VENV) $(DEMO_DIR)
