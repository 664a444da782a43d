"""Read an offline W&B run file (run-<id>.wandb): a LevelDB-style log of wandb's protobuf records.

wandb 0.31 has no Python reader of its own any more (its core is in Go); the layout is: a 7-byte header
(":W&B", magic, version), then 32 KiB blocks of chunks, each with a 7-byte header (crc32, length, type:
1 full, 2 first, 3 middle, 4 last; 0 padding up to the block end).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32768


def read_records(path: Path) -> list:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, record, records = 7, b"", []
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or kind == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        record = chunk if kind in (1, 2) else record + chunk
        if kind in (1, 4):
            parsed = wandb_internal_pb2.Record()
            parsed.ParseFromString(record)
            records.append(parsed)
    return records


def run_summary(path: Path) -> dict:
    """run id, name, entity and project, whether wandb.init was asked to resume the run of that id, config
    (key -> value) and history ({step: {key: value}}) of a run file."""
    run_id, name, entity, project, resume, config, history = None, None, None, None, None, {}, {}
    for record in read_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            run_id, name, entity, project, resume = run.run_id, run.display_name, run.entity, run.project, run.resume
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            row = history.setdefault(record.history.step.num, {})
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):  # wandb's own (_step, _runtime, ...)
                    row[key] = json.loads(item.value_json)
    return {"id": run_id, "name": name, "entity": entity, "project": project, "resume": resume, "config": config,
            "history": history}
