"""Per-node disks, simulated on one machine: each rank gets an output_dir of its own, as if the same path named a
folder on each node's own disk. Writes what each check did to <root>/rank_<r>.json.

    torchrun --nproc_per_node 2 tests/drivers/ckpt_shared_dir.py <root>
"""

import json
import os
import sys

from fsdp_recipes.config import ConfigError, parse_config
from fsdp_recipes.distributed import distributed, exit_process
from fsdp_recipes.output_dir import prepare_output_dir
from fsdp_recipes.resume import resolve_resume


def config(output_dir: str, *extra: str):
    return parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", output_dir, *extra])


def error_of(call) -> str | None:
    try:
        call()
    except ConfigError as error:
        return str(error)
    return None


root = sys.argv[1]
with distributed() as env:
    shared, own = os.path.join(root, "shared"), os.path.join(root, f"node{env.rank}")
    result = {
        "shared": error_of(lambda: prepare_output_dir(config(shared))),
        "shared_files": sorted(os.listdir(shared)),
        "per_node": error_of(lambda: prepare_output_dir(config(own))),
    }
    # Each node's `latest` names another checkpoint (none of them is a real one: the error names the path chosen).
    os.makedirs(own, exist_ok=True)
    with open(os.path.join(own, "latest"), "w") as f:
        f.write(f"checkpoint-{2 * (env.rank + 1)}")
    result["resume_auto"] = error_of(lambda: resolve_resume(config(own, "--resume_from_checkpoint", "auto"),
                                                            None, None, None))
    with open(os.path.join(root, f"rank_{env.rank}.json"), "w") as f:
        json.dump(result, f)
exit_process(0)
