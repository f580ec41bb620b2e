"""The STS calibration file and the export's confidence bias, as SGLang serves them.

- STS_FILE (`sts_calibration.json`): a `DSparkStsCalibration` (per-position temperatures
  T_k and the ECE before/after), loaded by SGLang with
  `--speculative-dspark-confidence-sts-path`; written and checked with SGLang's own class.
- The logit offset d of a calibration is added to the export's `BIAS_KEY` (the
  confidence head is one linear layer, so SGLang serves sigmoid((z_k + d) / T_k)
  unchanged) and the accumulated shift is recorded in the safetensors metadata
  (`SHIFT_META`), so the head as trained can be recovered (`read_bias_shift`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

STS_FILE = "sts_calibration.json"
BIAS_KEY = "confidence_head.proj.bias"
SHIFT_META = "confidence_bias_shift"


def read_bias_shift(export_dir: str | Path) -> float:
    """The confidence-bias offset calibrations have added to an export (0.0 if none)."""
    from safetensors import safe_open

    with safe_open(str(Path(export_dir) / "model.safetensors"), "pt") as f:
        return float((f.metadata() or {}).get(SHIFT_META, 0.0))


def check_export_dir(export_dir: Path, draft: Path, offset: bool) -> None:
    """An export to calibrate in place holds config.json and model.safetensors and, when
    an offset will be added to it, the same confidence head as `draft` (whose logits the
    offset is fit on). Checked before any decoding."""
    for name in ("config.json", "model.safetensors"):
        if not (export_dir / name).is_file():
            raise ValueError(f"--export {export_dir}: not an export directory (no {name})")
    if offset:
        check_same_head(draft, export_dir)


def check_same_head(draft: Path, export_dir: Path) -> None:
    """The offset is fit on `draft`'s logits: `export_dir` must hold the same head."""
    from safetensors import safe_open

    if draft.resolve() == export_dir.resolve():
        return
    heads = []
    for d in (draft, export_dir):
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            heads.append([f.get_tensor(k) for k in (BIAS_KEY, "confidence_head.proj.weight")])
    if not all(torch.equal(a, b) for a, b in zip(*heads, strict=True)):
        raise ValueError(
            f"--export {export_dir}: its confidence head differs from --draft {draft}'s; the "
            "bias offset fit on one cannot be applied to the other (use --no-offset)"
        )


def shift_confidence_bias(export_dir: Path, shift: float) -> float:
    """Add `shift` to EXPORT/model.safetensors' confidence bias (atomic rewrite, other
    tensors byte-identical); returns the accumulated shift now recorded in its metadata."""
    from safetensors.torch import load_file, save_file

    path = Path(export_dir) / "model.safetensors"
    tensors = load_file(str(path))
    if BIAS_KEY not in tensors:
        raise ValueError(f"{path}: no {BIAS_KEY} to shift (export without a confidence bias)")
    total = read_bias_shift(export_dir) + shift
    tensors[BIAS_KEY] = tensors[BIAS_KEY] + torch.tensor(shift, dtype=tensors[BIAS_KEY].dtype)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt", SHIFT_META: repr(total)})
    tmp.replace(path)
    return total


def validate_sts_file(path: Path, block_size: int) -> list[float]:
    """Load the file with SGLang's own DSparkStsCalibration loader (what the server
    does) and check the planner's gamma rule; returns its temperatures."""
    from sglang.srt.speculative.dspark_components.dspark_sts import (
        load_sts_calibration_from_path,
    )

    cal = load_sts_calibration_from_path(str(path))
    if len(cal.temperatures) != block_size:
        raise ValueError(f"{path}: {len(cal.temperatures)} temperatures for gamma {block_size}")
    return list(cal.temperatures)


def write_sts_file(path: Path, temps: list[float], dataset: str, num_samples: int, before, after):
    """Write a DSparkStsCalibration (atomic): temperatures, the fit's dataset and step
    count, per-position ECE before and after."""
    from sglang.srt.speculative.dspark_components.dspark_sts import DSparkStsCalibration

    cal = DSparkStsCalibration(
        temperatures=[float(t) for t in temps],
        dataset=dataset,
        num_samples=int(num_samples),
        ece_before=[float(x) for x in before],
        ece_after=[float(x) for x in after],
    )
    tmp = path.with_suffix(".tmp")
    tmp.write_text(cal.to_json())
    tmp.replace(path)


def copy_into_export(sts_path: Path, export_dir: Path) -> Path:
    """Put the calibration beside an export's config.json (atomic)."""
    export_dir = Path(export_dir)
    if not (export_dir / "config.json").is_file():
        raise ValueError(f"--export {export_dir}: not an export directory (no config.json)")
    dest = export_dir / STS_FILE
    tmp = dest.with_suffix(".tmp")
    shutil.copyfile(sts_path, tmp)
    tmp.replace(dest)
    return dest
