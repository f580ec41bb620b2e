"""`python -m evaluation.drift` on the tiny target against its own NVFP4 copy: the copy
drifts (some KL, most top-1 kept) and a target against itself does not drift at all."""

from __future__ import annotations

import json

import pytest

from evaluation.drift import main, target_drift
from specforge_dspark.engines.quant_targets import write_quantized_copy

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_quantized_copy_drifts_and_the_original_does_not(tiny_target_dir, tmp_path):
    copy = write_quantized_copy(tiny_target_dir, tmp_path / "nvfp4", "nvfp4")
    same = target_drift(tiny_target_dir, tiny_target_dir, ["gsm8k"], 2, 12)["gsm8k"]
    assert same["top1_agreement"] == 1.0 and same["kl_a_b"] == pytest.approx(0.0, abs=1e-6)
    assert main(["--target", str(tiny_target_dir), "--target", str(copy), "--workloads",
                 "gsm8k", "--num-prompts", "2", "--max-new-tokens", "12",
                 "--out", str(tmp_path / "out")]) == 0  # fmt: skip
    drift = json.loads((tmp_path / "out" / "drift.json").read_text())["targets"]["gsm8k"]
    assert drift["tokens"] == same["tokens"] > 0
    assert drift["kl_a_b"] > 1e-4 and 0.5 < drift["top1_agreement"] <= 1.0, drift
