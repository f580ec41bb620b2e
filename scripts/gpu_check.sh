#!/usr/bin/env bash
# GPU check of the production train step (not run in CI): one Inkling-NVFP4-dimension
# DSpark step (5 draft layers, hidden 6144, 201,024 LM-head rows, S 4096, 512 anchors,
# block 7, bf16, the fp32-output teacher path), forward + backward, on one GPU with that
# machine's own torch. Prints tokens/s, MFU and peak memory, recompute off and on:
#   bash scripts/gpu_check.sh            # at most ~8 minutes on one H200
# Needs only torch, pyyaml and safetensors (our package is imported from this checkout;
# nothing is installed or downloaded). Figures: README "Known limits".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
$PY - <<'EOF'
import importlib, sys
missing = [m for m in ("torch", "yaml", "safetensors") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing packages {missing} (pip install pyyaml safetensors)")
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA GPU visible")
p = torch.cuda.get_device_properties(0)
print(f"gpu_check: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}")
EOF
for recompute in off on; do
  timeout 240 $PY -m specforge_dspark.cli.bench step --shape inkling --device cuda \
    --recompute "$recompute" "$@"
done
