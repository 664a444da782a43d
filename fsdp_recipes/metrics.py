"""Metrics: one JSON line per logged step in <output_dir>/metrics.jsonl, and W&B when asked. Rank 0 writes."""

from __future__ import annotations

import json
import os

from .config import TrainConfig


class MetricsLogger:
    def __init__(self, cfg: TrainConfig, is_main: bool, extra_config: dict | None = None):
        self.is_main = is_main
        self.wandb_run = None
        if not is_main:
            return
        os.makedirs(cfg.output_dir, exist_ok=True)
        self.path = os.path.join(cfg.output_dir, "metrics.jsonl")
        if cfg.report_to == "wandb":
            import wandb

            self.wandb_run = wandb.init(
                project=cfg.wandb_project, name=cfg.run_name, config={**cfg.to_dict(), **(extra_config or {})}
            )

    def start_at(self, step: int) -> None:
        """Keep the lines of steps up to `step` (those a resumed run does not repeat), drop the rest."""
        if not self.is_main:
            return
        kept = []
        if step > 0 and os.path.exists(self.path):
            with open(self.path) as f:
                kept = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
        with open(self.path, "w") as f:
            f.writelines(kept)

    def log(self, metrics: dict) -> None:
        if not self.is_main:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in metrics.items() if k != "step"}, step=metrics["step"])

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
