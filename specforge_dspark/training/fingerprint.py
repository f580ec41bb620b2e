"""The run's fingerprint: what the recipe alone does not pin, saved in train_state.json
(checkpoint.py) and compared on resume (`checkpoint.check_compatible`).

`features`: the target's files, quantization, dtype and aux tap convention (what the
features ARE, whichever backend serves them); `data`: the content of the prepared
training rows.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from specforge_dspark.config.recipe import Recipe
from specforge_dspark.engines.tap import tap_convention

EDGE_BYTES = 1 << 20  # hashed at each end of a weight file: cheap for multi-GB shards
DATA_COLUMNS = ("input_ids", "loss_mask")
HASH_ROWS = 4096  # prepared rows per arrow batch while hashing the data


def features_fingerprint(recipe: Recipe) -> dict[str, Any]:
    """What the features are: target identity (config.json, and per weight file its size
    and a hash of its safetensors header and first and last MiB), quantization, dtype and
    the aux tap convention. The backend and device are not in it: they serve the same
    features."""
    root = Path(recipe.target.path)
    config_file = root / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    return _jsonable(
        {
            "target_config": _sha256(config_file.read_bytes()) if config_file.is_file() else None,
            "target_weights": {p.name: weight_file_digest(p) for p in _weight_files(root)},
            "quantization": {
                "config": config.get("quantization_config"),
                "server_args": recipe.target.sglang.server_args.get("quantization"),
            },
            "dtype": recipe.target.dtype,
            "tap_convention": tap_convention(config),
        }
    )


def data_fingerprint(dataset) -> dict[str, Any]:
    """The training data's content: a hash over the prepared rows' input_ids and loss_mask
    in row order (the prepare cache key hashes file sizes and mtimes, not contents)."""
    h = hashlib.sha256()
    for batch in dataset.with_format("arrow").iter(batch_size=HASH_ROWS):
        for name in DATA_COLUMNS:
            rows = batch.column(name).combine_chunks()  # a list array, one list per row
            h.update(rows.value_lengths().to_numpy(zero_copy_only=False).tobytes())
            h.update(rows.flatten().to_numpy(zero_copy_only=False).tobytes())
    return {"rows": len(dataset), "content": h.hexdigest()[:16]}


def _weight_files(root: Path) -> list[Path]:
    return sorted(root.glob("*.safetensors"))


def weight_file_digest(path: Path) -> str:
    """`<size>:<hash of the safetensors header, the first and the last EDGE_BYTES>`."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")  # safetensors: u64 header length, header
        h.update(f.read(min(n, size)))
        f.seek(0)
        h.update(f.read(EDGE_BYTES))
        f.seek(max(size - EDGE_BYTES, 0))
        h.update(f.read(EDGE_BYTES))
    return f"{size}:{h.hexdigest()[:16]}"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    """As it reads back from train_state.json (tuples become lists), so it compares equal."""
    return json.loads(json.dumps(d, sort_keys=True, default=str))
