"""The `offline` backend: feature shards written by `python -m specforge_dspark.cli.capture`.

A capture directory holds `shard-NNNNN.safetensors` files (per sample: `<id>.input_ids`
[S] int64, `<id>.aux` [S, m*H], `<id>.last` [S, H], unpadded) and `manifest.json`, written
last, so a directory without one is an unfinished capture. The manifest records the
sample ids and their shards, the aux layer ids, hidden size, dtype, each shard's size and
sha256, a fingerprint of the target weights (`target_fingerprint`) and the aux tap
convention (`tap.tap_convention`; absent in captures older than it, which all took
`layer_output`). The reader checks all of it against the recipe before the first batch
and each shard (size, sha256, tensor shapes) on first use, and names the file on any
problem.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specforge_dspark.engines.tap import read_target_config, tap_convention
from specforge_dspark.transport.features import DTYPES, PaddedBatch, TargetFeatures

FORMAT = "specforge_dspark.features"
VERSION = 1
MANIFEST = "manifest.json"
_SAMPLE_READS = 16
_READ_BYTES = 1 << 16


def target_fingerprint(target_path: str | Path) -> str:
    """Identify target weights cheaply: sha256 over config.json and, per *.safetensors
    file (sorted by name), its name, size, full header (tensor names, dtypes, shapes,
    offsets) and 16 evenly spaced 64 KiB samples of its data. Any re-quantisation,
    re-export or different checkpoint changes the header or the sampled bytes."""
    root = Path(target_path)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"target.path: no *.safetensors files in {root} to fingerprint")
    h = hashlib.sha256()
    if (root / "config.json").is_file():
        h.update((root / "config.json").read_bytes())
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(n))
            start = 8 + n
            span = max(0, size - start - _READ_BYTES)
            for i in range(_SAMPLE_READS):
                fh.seek(start + span * i // max(1, _SAMPLE_READS - 1))
                h.update(fh.read(_READ_BYTES))
    return h.hexdigest()[:32]


def file_sha256(path: Path) -> str:
    """The sha256 hex digest of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


class ShardWriter:
    """Accumulates per-sample features and writes shards of about `shard_bytes` each."""

    def __init__(
        self,
        out_dir: str | Path,
        target: dict[str, Any],
        layer_ids: list[int],
        dtype: str,
        shard_bytes: int = 1 << 30,
    ):
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        if (self.out / MANIFEST).exists():
            raise ValueError(f"{self.out / MANIFEST} exists: capture into an empty directory")
        self.target, self.layer_ids, self.dtype = target, list(layer_ids), dtype
        self.shard_bytes = shard_bytes
        self.shards: list[dict[str, Any]] = []
        self.samples: dict[str, dict[str, int]] = {}
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_ids: list[int] = []
        self._buffer_bytes = 0

    def add(self, sample_id: int, input_ids_S, aux_SD: torch.Tensor, last_SH: torch.Tensor):
        key = str(int(sample_id))
        if key in self.samples or int(sample_id) in self._buffer_ids:
            raise ValueError(f"capture: sample id {sample_id} appears twice in the data")
        ids = torch.as_tensor(input_ids_S, dtype=torch.long)
        self._buffer[f"{key}.input_ids"] = ids.clone()
        self._buffer[f"{key}.aux"] = aux_SD.contiguous().clone()
        self._buffer[f"{key}.last"] = last_SH.contiguous().clone()
        self._buffer_ids.append(int(sample_id))
        self._buffer_bytes += sum(t.numel() * t.element_size() for t in (aux_SD, last_SH))
        if self._buffer_bytes >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._buffer_ids:
            return
        index = len(self.shards)
        path = self.out / f"shard-{index:05d}.safetensors"
        save_file(self._buffer, str(path), metadata={"format": FORMAT})
        for sid in self._buffer_ids:
            self.samples[str(sid)] = {
                "shard": index,
                "length": int(self._buffer[f"{sid}.input_ids"].numel()),
            }
        self.shards.append(
            {
                "file": path.name,
                "bytes": path.stat().st_size,
                "sha256": file_sha256(path),
                "num_samples": len(self._buffer_ids),
            }
        )
        self._buffer, self._buffer_ids, self._buffer_bytes = {}, [], 0

    def close(self) -> Path:
        """Write the last shard, then the manifest (atomically, last of all)."""
        self._flush()
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "target": self.target,
            "layer_ids": self.layer_ids,
            "dtype": self.dtype,
            "shards": self.shards,
            "samples": self.samples,
        }
        tmp = self.out / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, self.out / MANIFEST)
        return self.out / MANIFEST


class FeatureStore:
    """Validated read access to one capture directory."""

    def __init__(self, directory: str | Path, layer_ids: list[int], target_path: str, dtype: str):
        self.dir = Path(directory)
        mpath = self.dir / MANIFEST
        if not mpath.is_file():
            raise ValueError(
                f"target.offline_dir: {mpath} not found (no capture there, or it did not finish)"
            )
        try:
            m = json.loads(mpath.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{mpath}: corrupt manifest (not JSON: {e})") from None
        if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("version") != VERSION:
            raise ValueError(f"{mpath}: not a {FORMAT} v{VERSION} manifest")
        if m.get("layer_ids") != list(layer_ids):
            raise ValueError(
                f"{mpath}: features were captured for aux layer ids {m.get('layer_ids')}, but "
                f"draft.target_layer_ids is {list(layer_ids)}; capture again for these layers"
            )
        if m.get("dtype") != dtype:
            raise ValueError(f"{mpath}: features are {m.get('dtype')}, but target.dtype is {dtype}")
        want = target_fingerprint(target_path)
        got = (m.get("target") or {}).get("weights_hash")
        if got != want:
            raise ValueError(
                f"{mpath}: features of another target: weights hash {got} != {want} of "
                f"target.path={target_path}"
            )
        want_tap = tap_convention(read_target_config(target_path))
        got_tap = m["target"].get("tap", "layer_output")
        if got_tap != want_tap:
            raise ValueError(
                f"{mpath}: features of the {got_tap} aux tap, but SGLang taps this target "
                f"{want_tap} (engines/tap.py); capture again"
            )
        self.manifest = m
        self.hidden = int(m["target"]["hidden_size"])
        self.aux_width = self.hidden * len(layer_ids)
        self.dtype = DTYPES[dtype]
        self._checked: set[int] = set()

    @property
    def name(self) -> str:
        return f"offline features in {self.dir}"

    def _shard(self, index: int) -> Path:
        entry = self.manifest["shards"][index]
        path = self.dir / entry["file"]
        if index in self._checked:
            return path
        if not path.is_file():
            raise ValueError(f"{path}: shard listed in {MANIFEST} is missing")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise ValueError(
                f"{path}: truncated or rewritten shard ({size} bytes, manifest says "
                f"{entry['bytes']})"
            )
        if file_sha256(path) != entry["sha256"]:
            raise ValueError(f"{path}: corrupt shard (sha256 differs from {MANIFEST})")
        self._checked.add(index)
        return path

    def read(self, sample_id: int, input_ids_S: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(aux [S, m*H], last [S, H]) for a sample, checking it is the same token ids."""
        entry = self.manifest["samples"].get(str(sample_id))
        if entry is None:
            raise ValueError(f"{self.dir / MANIFEST}: sample id {sample_id} was not captured")
        path = self._shard(entry["shard"])
        S = int(entry["length"])
        try:
            with safe_open(str(path), framework="pt") as f:
                ids = f.get_tensor(f"{sample_id}.input_ids")
                aux = f.get_tensor(f"{sample_id}.aux")
                last = f.get_tensor(f"{sample_id}.last")
        except Exception as e:
            raise ValueError(f"{path}: cannot read sample {sample_id}: {e}") from None
        if (
            tuple(aux.shape) != (S, self.aux_width)
            or tuple(last.shape) != (S, self.hidden)
            or aux.dtype != self.dtype
            or last.dtype != self.dtype
        ):
            raise ValueError(
                f"{path}: sample {sample_id} has aux {tuple(aux.shape)} {aux.dtype} / last "
                f"{tuple(last.shape)} {last.dtype}, manifest says S={S}, m*H={self.aux_width}, "
                f"H={self.hidden}, {self.dtype}"
            )
        if not torch.equal(ids, input_ids_S.to(torch.long)):
            raise ValueError(
                f"{path}: sample {sample_id} was captured for other token ids than the data "
                "gives now (data or tokenizer changed since the capture)"
            )
        return aux, last


class OfflineEngine:
    """Serves a batch by reading its samples from the store and right-padding them."""

    def __init__(self, recipe):
        t = recipe.target
        self.store = FeatureStore(t.offline_dir, recipe.draft.target_layer_ids, t.path, t.dtype)
        self.name = self.store.name

    def wait_ready(self) -> None:
        pass

    def submit(self, seq: int, batch: PaddedBatch) -> None:
        pass  # reads are synchronous: the page cache is the prefetch

    def result(self, seq: int, batch: PaddedBatch, deadline: float) -> TargetFeatures:
        B, S = batch.shape
        aux = torch.zeros(B, S, self.store.aux_width, dtype=self.store.dtype)
        last = torch.zeros(B, S, self.store.hidden, dtype=self.store.dtype)
        for b, sid in enumerate(batch.sample_ids):
            n = int(batch.lengths[b])
            a, h = self.store.read(sid, batch.input_ids[b, :n])
            aux[b, :n], last[b, :n] = a, h
        return TargetFeatures(
            batch.sample_ids, batch.input_ids, batch.loss_mask, batch.lengths, aux, last
        )

    def close(self) -> None:
        pass
