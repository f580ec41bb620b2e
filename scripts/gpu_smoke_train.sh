#!/usr/bin/env bash
# GPU smoke test of the training loop (not run in CI): the tiny recipe on one CUDA GPU,
# DeepSpeed ZeRO-2 in bf16 with NCCL, a few hundred steps; prints step time and memory.
#   bash scripts/gpu_smoke_train.sh [steps]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-300}
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.cuda.get_device_name())"
$PY -m specforge_dspark.targets --out .cache/tiny_target
rm -rf runs/gpu_smoke
$PY -m torch.distributed.run --nproc_per_node 1 train.py --recipe recipes/tiny_cpu.yaml \
  --resume none target.device=cuda dist.backend=nccl dist.precision=bf16 \
  train.max_steps="$STEPS" train.output_dir=runs/gpu_smoke checkpoint.save_interval="$STEPS" \
  objective.num_anchors=512 tracking.enabled=false
