"""Capture frozen-target features to disk for the `offline` backend.

    python -m specforge_dspark.cli.capture --recipe R.yaml --out DIR [--input S.jsonl]

Runs the recipe's target with the `hf` backend (whatever `target.backend` says) over the
training samples and writes safetensors shards plus manifest.json (see target/offline.py).
Samples come from `--input` (jsonl rows {"sample_id", "input_ids", "loss_mask"}) or,
without it, from `data_pipelines.prepare.prepare_dataset(recipe)` when that exists.
Train from the result with `target.backend=offline target.offline_dir=DIR`.
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from data_pipelines.ingest import batched
from specforge_dspark.config.command_line import command_parser
from specforge_dspark.config.recipe import Recipe, load_recipe
from specforge_dspark.engines.offline import ShardWriter, target_fingerprint
from specforge_dspark.engines.tap import read_target_config, read_target_dims, tap_convention
from specforge_dspark.training.stream import FeatureStream
from specforge_dspark.transport.features import Sample


def read_samples_jsonl(path: str | Path) -> Iterator[Sample]:
    """Rows {"sample_id", "input_ids", "loss_mask"}; a bad row fails naming its line."""
    with Path(path).open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                yield Sample(int(row["sample_id"]), row["input_ids"], row["loss_mask"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{n}: not a sample row ({e})") from None


def prepared_samples(recipe: Recipe) -> Iterable[Any]:
    """The data pipeline's samples (objects with sample_id, input_ids, loss_mask)."""
    try:
        from data_pipelines.prepare import prepare_dataset  # type: ignore[import-not-found]
    except ImportError:
        raise ValueError(
            "capture: no --input given and data_pipelines.prepare.prepare_dataset is not "
            "available; pass --input FILE.jsonl"
        ) from None
    return prepare_dataset(recipe)


def capture(
    recipe: Recipe,
    samples: Iterable[Any],
    out: str | Path,
    shard_mb: int = 1024,
    stream: FeatureStream | None = None,
    log=print,
) -> Path:
    """Write features for `samples` into `out`; returns the manifest path.

    `stream` (an open hf FeatureStream for this recipe) is used when given, else one is
    started and stopped here."""
    hf = copy.deepcopy(recipe)
    hf.target.backend = "hf"
    layer_ids = hf.draft.target_layer_ids
    dims = read_target_dims(hf.target.path, layer_ids)
    target = {
        "path": str(hf.target.path),
        "weights_hash": target_fingerprint(hf.target.path),
        "hidden_size": dims.hidden_size,
        "num_layers": dims.num_layers,
        "tap": tap_convention(read_target_config(hf.target.path)),
    }
    writer = ShardWriter(out, target, layer_ids, hf.target.dtype, shard_mb << 20)
    n = 0
    with nullcontext(stream) if stream is not None else FeatureStream(hf) as live:
        for feats in live.iterate(batched(samples, hf.target.batch_size)):
            for b, sid in enumerate(feats.sample_ids):
                L = int(feats.lengths[b])
                writer.add(
                    sid, feats.input_ids[b, :L], feats.aux_hidden[b, :L], feats.last_hidden[b, :L]
                )
                n += 1
    path = writer.close()
    log(f"capture: {n} samples, {len(writer.shards)} shard(s) -> {path}")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = command_parser(
        "specforge_dspark.cli.capture",
        __doc__.split("\n\n")[0],
        "python -m specforge_dspark.cli.capture --recipe recipes/tiny_cpu.yaml --out runs/capture",
    )
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--input", type=Path, help="jsonl of {sample_id, input_ids, loss_mask}")
    ap.add_argument("--shard-mb", type=int, default=1024, help="target shard size in MiB")
    ap.add_argument("overrides", nargs="*", help="recipe overrides, key.sub=value")
    a = ap.parse_args(argv)
    recipe = load_recipe(a.recipe, a.overrides)
    samples = read_samples_jsonl(a.input) if a.input else prepared_samples(recipe)
    capture(recipe, samples, a.out, a.shard_mb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
