"""Create the recipe and YAML config of another model family from the reference recipe, recipes/llama_sft.py.

    make new-recipe MODEL=olmo2          # or: python -m fsdp_recipes.new_recipe olmo2
    python -m fsdp_recipes.new_recipe --sync

MODEL is the model_type of the family's config.json; a hyphen in it (modernbert-decoder) becomes an underscore in
the file names. The new recipe takes every shared line from llama_sft.py, so it passes tests/test_recipes.py's check
that the shared part of all recipes is identical. After a change to the shared part of llama_sft.py, --sync copies it
into every other recipe (each keeps its docstring and own block; edits to its shared part are replaced, and printed
as a diff); a .py file without a recipe's marker lines (a helper module) is skipped. Both read llama_sft.py from the
clone's recipes/, or from the copy an installed package holds (fsdp_recipes/recipes/, see pyproject.toml).
Standard library only: it runs before any environment is installed.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The project's recipes and their YAML configs: a built package (pip install, a wheel) holds them in
# fsdp_recipes/recipes/ (pyproject.toml's package-dir), since it has no clone beside it; a clone, and the editable
# install `make` sets up, at its root.
PACKAGED_RECIPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recipes")
INSTALLED = os.path.isdir(PACKAGED_RECIPES)
PROJECT_RECIPES = PACKAGED_RECIPES if INSTALLED else os.path.join(REPO, "recipes")
REFERENCE = os.path.join(PROJECT_RECIPES, "llama_sft.py")
OWN_START = "# ---- What this recipe holds of its own"
OWN_END = "# ---- Shared by every recipe"

RECIPE_DOC = '''"""Supervised fine-tuning of {model_type} models with FSDP, exported as a Hugging Face folder.

    accelerate launch --config_file accelerate_configs/fsdp2.yaml {recipe} \\
        --config {config} --model_name_or_path <hub id> --dataset_name <data>

Created by `make new-recipe MODEL={model_type}`. Set the hub id and the defaults in the YAML config; if the model
needs particular attention implementations, list them in MODEL_TYPES below. The shared part stays as it is.
"""
'''

OWN_BLOCK = '''{own_start} (the rest of the file is shared) ----
# config.json's model_type values this recipe trains, each with the attention implementations that compute the
# model exactly (None: any). The YAML config holds the rest: hub id, learning rate, sequence length.
MODEL_TYPES = {{"{model_type}": None}}
'''

CONFIG = """# {model_type} supervised fine-tuning (created by `make new-recipe MODEL={model_type}`): set the hub id, then
# pass --dataset_name on the command line.
model_name_or_path: null
dataset_name: null
output_dir: outputs/{name}_sft
max_seq_length: 2048
num_train_epochs: 1
per_device_train_batch_size: 4
gradient_accumulation_steps: 4
learning_rate: 1.0e-5
lr_scheduler_type: cosine
warmup_steps: 0.03  # 3% of the run's steps (a whole number counts steps)
weight_decay: 0.0
max_grad_norm: 1.0
logging_steps: 10
seed: 42
report_to: none
"""


def shared_part() -> tuple[str, str]:
    """The head and tail of llama_sft.py, the shared part."""
    if not os.path.isfile(REFERENCE):  # a clone without it, or a package built from one
        raise SystemExit(f"error: recipes/llama_sft.py, the recipe a new one copies, is not at {REFERENCE}: restore "
                         "it in the clone, or reinstall the package from a clone that has it")
    with open(REFERENCE) as f:
        text = f.read()
    try:
        _, head, _, tail = split_recipe(text, REFERENCE)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    return head, tail


def is_recipe(text: str) -> bool:
    """Whether a .py file is a recipe: a line starts with a marker around its own block. Either one: a recipe that
    lost the other is refused by split_recipe, not skipped as a helper module with a stale shared part."""
    return any(re.search(f"^{re.escape(marker)}", text, re.MULTILINE) for marker in (OWN_START, OWN_END))


def split_recipe(text: str, path: str = "the recipe") -> tuple[str, str, str, str]:
    """(docstring, shared head, the recipe's own block, shared tail) of a recipe's source; a ValueError that names
    `path` and what to change if it lacks that layout. The docstring (with any lines before it, such as a shebang)
    ends at its last line; each marker must start exactly one line after it, so a docstring may quote them."""
    try:
        module = ast.parse(text)
    except SyntaxError as e:
        raise ValueError(f"{path} is not valid Python (line {e.lineno}: {e.msg}): fix it") from None
    if ast.get_docstring(module) is None:
        raise ValueError(f"{path} holds a recipe's markers but does not start with its docstring, as every recipe "
                         "does: add it")
    doc_end = len("\n".join(text.split("\n")[:module.body[0].end_lineno])) + 1  # the newline after it too
    starts = {}
    for marker in (OWN_START, OWN_END):
        found = [m.start() for m in re.finditer(f"^{re.escape(marker)}", text[doc_end:], re.MULTILINE)]
        if len(found) != 1:
            raise ValueError(f"{path} has {len(found)} lines that start with \"{marker}\" after its docstring, where "
                             f"a recipe has one (see llama_sft.py): {'remove the others' if found else 'add it'}")
        starts[marker] = doc_end + found[0]
    own_start, own_end = starts[OWN_START], starts[OWN_END]
    if own_end < own_start:
        raise ValueError(f"{path} has its \"{OWN_END}\" line before its \"{OWN_START}\" line: the recipe's own "
                         "block lies between them, as in llama_sft.py")
    return text[:doc_end], text[doc_end:own_start], text[own_start:own_end], text[own_end:]


def recipes_training(model_type: str, recipes_dir: str) -> list[str]:
    """The recipes in recipes_dir whose MODEL_TYPES lists model_type (gemma_sft.py for gemma3_text)."""
    return [path for path, listed in listed_model_types(recipes_dir) if model_type in listed]


def listed_model_types(recipes_dir: str) -> list[tuple[str, list]]:
    """Each recipe of recipes_dir with the keys of its MODEL_TYPES."""
    found = []
    for name in sorted(os.listdir(recipes_dir)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(recipes_dir, name)) as f:
            try:
                module = ast.parse(f.read())
            except SyntaxError:  # a file being edited: not a recipe to point to
                continue
        for node in module.body:
            if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MODEL_TYPES" for t in node.targets)
                    and isinstance(node.value, ast.Dict)):
                keys = [getattr(key, "value", None) for key in node.value.keys]
                found.append((os.path.join(recipes_dir, name), keys))
    return found


def generic_recipe() -> str:
    """The project's generic recipe: relative from the clone's root (where the README runs it), absolute from
    elsewhere (a recipe copied into a folder of its own, or the copy an installed package holds)."""
    path = os.path.join(PROJECT_RECIPES, "sft.py")
    relative = os.path.relpath(path)
    return path if relative.startswith(os.pardir) else relative


def recipe_advice(model_type: str, recipes_dir: str) -> str | None:
    """What to do with a model type that has a recipe or file already: the recipe that lists it in its MODEL_TYPES,
    in recipes_dir or else in this project's recipes/ (for recipes_dir elsewhere), or the recipe or YAML config of
    its file name in recipes_dir. None: none of these, so `make new-recipe` can write its recipe there."""
    folders = [recipes_dir]
    if os.path.abspath(recipes_dir) != PROJECT_RECIPES:
        folders.append(PROJECT_RECIPES)
    for folder in folders:
        trained_by = recipes_training(model_type, folder) if os.path.isdir(folder) else []
        if trained_by:  # a second recipe would lack the family's defaults (Qwen3-MoE's router loss)
            return f"{trained_by[0]} trains {model_type} models: run it (or a copy of it), {_with_its_config(folder)}"
    # "-" for "_" or the reverse (qwen3-moe): a recipe for a model type that config.json never spells, and that the
    # family's recipe trains (a file name would not tell: gemma3-text's would be gemma3_text_sft.py).
    for folder in folders:
        for path, listed in listed_model_types(folder) if os.path.isdir(folder) else []:
            for spelled in listed:
                if isinstance(spelled, str) and spelled.replace("-", "_") == model_type.replace("-", "_"):
                    return (f"config.json spells this model type {spelled}, not {model_type}: {path} trains "
                            f"{spelled} models: run it (or a copy of it), {_with_its_config(folder)}")
    name = model_type.replace("-", "_")
    named = os.path.join(recipes_dir, f"{name}_sft.py")
    if os.path.exists(named):
        # e.g. Gemma 1 and gemma_sft.py, which trains Gemma 2 and 3: the family's recipe has the file name.
        return (f"add \"{model_type}\" to MODEL_TYPES in {named} if its YAML config's defaults suit it "
                f"(`make new-recipe MODEL={model_type}` cannot write that file: it exists), or run the generic "
                f"{generic_recipe()}")
    config = os.path.join(recipes_dir, "configs", f"{name}_sft.yaml")
    if os.path.exists(config):  # e.g. a multimodal Gemma 3 (gemma3): gemma3_sft.yaml is Gemma 3 text's config
        return (f"run the generic {generic_recipe()}, or add \"{model_type}\" to the MODEL_TYPES of the recipe whose "
                f"YAML config is {config} (`make new-recipe MODEL={model_type}` cannot write that file: it exists)")
    return None


def _with_its_config(folder: str) -> str:
    """Where the YAML config of a recipe in `folder` is: its configs/, where the folder has one (a recipe copied into
    a folder of its own may keep its YAML beside it)."""
    configs = os.path.join(folder, "configs")
    return f"with its YAML config from {configs}" if os.path.isdir(configs) else "with its YAML config"


def check_not_a_configs_folder(recipes_dir: str) -> None:
    """A recipes' configs/ given as --recipes_dir would get the recipe, and its YAML in configs/configs/."""
    parent, base = os.path.split(os.path.abspath(recipes_dir))
    if base != "configs":
        return
    for name in sorted(os.listdir(parent)):
        path = os.path.join(parent, name)
        if not (name.endswith(".py") and os.path.isfile(path)):
            continue
        with open(path) as f:
            if is_recipe(f.read()):
                raise SystemExit(f"error: --recipes_dir {recipes_dir} is the YAML configs folder of the recipes in "
                                 f"{parent}: give --recipes_dir {parent}, and the new YAML config goes into its "
                                 f"configs/")


def new_recipe(model_type: str, recipes_dir: str) -> tuple[str, str]:
    """Write <recipes_dir>/<name>_sft.py and <recipes_dir>/configs/<name>_sft.yaml; return their paths."""
    if not re.fullmatch(r"[a-z][a-z0-9_-]*", model_type):
        raise SystemExit(f"error: MODEL must be a model_type as config.json spells it (e.g. olmo2), got {model_type!r}")
    check_not_a_configs_folder(recipes_dir)
    advice = recipe_advice(model_type, recipes_dir)
    if advice:
        raise SystemExit(f"error: {advice}")
    name = model_type.replace("-", "_")  # a file name Python can import: modernbert-decoder -> modernbert_decoder
    recipe = os.path.join(recipes_dir, f"{name}_sft.py")
    config = os.path.join(recipes_dir, "configs", f"{name}_sft.yaml")
    head, tail = shared_part()
    # The docstring's command runs from the repository's root: a path inside it relative to it, any other absolute.
    shown = {key: os.path.relpath(path, REPO) if path.startswith(REPO + os.sep) else path
             for key, path in (("recipe", os.path.abspath(recipe)), ("config", os.path.abspath(config)))}
    values = {"model_type": model_type, "name": name, "own_start": OWN_START, **shown}
    os.makedirs(os.path.dirname(config), exist_ok=True)
    with open(recipe, "w") as f:
        f.write(RECIPE_DOC.format(**values) + head + OWN_BLOCK.format(**values) + tail)
    with open(config, "w") as f:
        f.write(CONFIG.format(**values))
    return recipe, config


def sync_recipes(recipes_dir: str) -> tuple[dict[str, str], list[str]]:
    """Give every recipe in recipes_dir the shared part of llama_sft.py, edits to its shared part included; return
    the recipes that changed, each with the unified diff of what was replaced, and the .py files skipped as not
    recipes (no markers around an own block: a helper module)."""
    head, tail = shared_part()
    if not os.path.isdir(recipes_dir):
        raise SystemExit(f"error: --recipes_dir {recipes_dir}: no such folder ({os.path.abspath(recipes_dir)}): give "
                         f"the folder that holds the recipes to sync")
    updates, skipped, recipes = {}, [], 0
    # Every file is read and split before any is written: a file that fails leaves the folder as it was.
    for name in sorted(os.listdir(recipes_dir)):
        path = os.path.join(recipes_dir, name)
        if not name.endswith(".py") or os.path.samefile(path, REFERENCE):
            continue
        with open(path) as f:
            text = f.read()
        if not is_recipe(text):
            skipped.append(path)
            continue
        recipes += 1
        try:
            doc, _, own, _ = split_recipe(text, path)
        except ValueError as e:
            raise SystemExit(f"error: {e}; no recipe was rewritten") from None
        synced = doc + head + own + tail
        try:
            ast.parse(synced)
        except SyntaxError as e:  # markers inside a string or a bracket split a statement across the parts
            raise SystemExit(f"error: {path} would not be valid Python once synced (line {e.lineno}: {e.msg}): its "
                             "own block, between the markers, must hold whole statements, as llama_sft.py's does; no "
                             "recipe was rewritten") from None
        if synced != text:
            updates[path] = synced, "".join(difflib.unified_diff(
                text.splitlines(keepends=True), synced.splitlines(keepends=True), path, f"{path} (synced)"))
    if not recipes:  # a mistyped folder (its configs/, say) would otherwise sync nothing without a word
        raise SystemExit(f"error: {recipes_dir} holds no recipe to sync (a .py file with the \"{OWN_START}\" and "
                         f"\"{OWN_END}\" markers, as llama_sft.py has): give the folder of your recipes as "
                         f"--recipes_dir")
    for path, (text, _) in updates.items():
        with open(path, "w") as f:
            f.write(text)
    return {path: diff for path, (_, diff) in updates.items()}, skipped


def main() -> None:
    # Named as the README runs it: argparse alone would name the file, which no command runs.
    parser = argparse.ArgumentParser(f"python -m {__spec__.name}", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_type", nargs="?", help="config.json's model_type, e.g. olmo2")
    # An installed package's recipes are not the user's to edit (a reinstall would undo it): no default there.
    parser.add_argument("--recipes_dir", default=None if INSTALLED else PROJECT_RECIPES,
                        help="the folder of the recipes" + ("" if INSTALLED else " (default: the clone's recipes/)"))
    parser.add_argument("--sync", action="store_true", help="copy llama_sft.py's shared part into every recipe")
    args = parser.parse_args()
    if args.sync == bool(args.model_type):
        parser.error("give a model_type, or --sync")
    if args.recipes_dir is None:
        parser.error("give --recipes_dir, the folder of your recipes (the installed package's own recipes, in "
                     f"{PACKAGED_RECIPES}, are its copies of the project's)")
    if args.sync:
        diffs, skipped = sync_recipes(args.recipes_dir)
        for path in skipped:
            print(f"skipped {path}: not a recipe (no line starts with \"{OWN_START}\" or \"{OWN_END}\")")
        for diff in diffs.values():  # what the sync replaced, a user's edits to a shared part included
            print(diff, end="")
        if not diffs:
            print(f"every recipe in {args.recipes_dir} already has the shared part of {REFERENCE}")
        paths = list(diffs)
    else:
        paths = new_recipe(args.model_type, args.recipes_dir)
    for path in paths:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
