"""The SGLang layout, for either drafter kind: the draft's own `save_pretrained` plus the
conventions record (conventions.py) in its config.json.

SGLang 0.5.23 DSPARK (`--speculative-algorithm DSPARK`; `models/dspark.py`,
`models/dflash.py`, `speculative/dspark_components/dspark_config.py`):
`DSparkDraft.save_pretrained`, i.e. `DSparkConfig.to_dict()` (architectures
["Qwen3DSparkModel"], model_type "qwen3", DSpark keys at the root and in dflash_config) and
the draft's own tensor names. `load_weights` packs q/k/v_proj into `qkv_proj` and
gate/up_proj into `gate_up_proj` itself. SGLang divides `h` by the target's muP multiplier
itself (`compute_base_logits`), so this layout stores the trained weights unchanged
(`mup_folded_into`: null). The DFLASH layout is described in dflash.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specforge_dspark.drafters.conventions import CONVENTIONS_KEY
from specforge_dspark.drafters.dflash import DFlashDraft
from specforge_dspark.drafters.dspark import DSparkDraft
from specforge_dspark.export import publish


def write_sglang(
    draft: DSparkDraft | DFlashDraft,
    out_dir: str | Path,
    record: dict[str, Any],
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write the SGLang layout of `draft` with its conventions `record` to `out_dir`
    (replaced whole, atomically); returns it."""

    def write(staging: Path) -> None:
        draft.save_pretrained(staging, dtype=dtype)
        config_file = staging / "config.json"
        config = json.loads(config_file.read_text())
        config[CONVENTIONS_KEY] = {**record, "mup_folded_into": None}
        config_file.write_text(json.dumps(config, indent=2) + "\n")

    return publish(out_dir, write)
