#!/usr/bin/env bash
# GPU smoke test of the sglang target backend (documented, not run in CI).
#
#   scripts/gpu_smoke_sglang.sh MODEL_DIR ["L1 L2 L3"] [TP]
#   e.g. scripts/gpu_smoke_sglang.sh /models/Qwen3-0.6B "1 13 24" 1
#
# Needs a CUDA machine with two environments, as in production: SGLang's own (its image,
# or `pip install sglang==0.5.23` with everything it pins), interpreter $SGLANG_PY, with
# this repository installed there by `pip install --no-deps -e .` (the plugin reaches the
# server processes only through the `sglang.srt.plugins` entry point); and ours, $PY,
# where the trainer side and the hf reference run.
# MODEL_DIR is a local HF checkpoint that both SGLang (with aux capture) and transformers
# load, e.g. Qwen3 or Llama. (Inkling-NVFP4 ships in SGLang's raw layout, which the hf
# backend cannot load; use a recipe run for it instead.)
#
# It checks, in order:
#  1. the specforge_dspark plugin entry point is registered;
#  2. our launch arguments pass SGLang's own argument validation;
#  3. FeatureStream(backend=sglang) starts the server (log in $OUT), streams features of
#     a few sequences (lengths 1 to 1500, batches of 2) through shared memory;
#  4. the same sequences through the hf backend (transformers, fp32, on the GPU);
#  5. shapes match exactly, padded rows are zero, and every valid row of aux and last
#     hidden agrees with the hf reference to cosine >= 0.99 (bf16 server kernels vs an
#     fp32 reference), then reports the stream's throughput on 32 x 2048-token sequences.
# Exit status 0 means all passed.
set -euo pipefail

MODEL_DIR=${1:?usage: $0 MODEL_DIR [\"LAYER IDS\"] [TP]}
LAYERS=${2:-}
TP=${3:-1}
PORT=${PORT:-30123}
PY=${PY:-python}
SGLANG_PY=${SGLANG_PY:-python3}
export SGLANG_PY
OUT=${OUT:-runs/gpu_smoke_sglang}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"

"$PY" - "$MODEL_DIR" "$LAYERS" "$TP" "$PORT" "$OUT" <<'EOF'
import json
import os
import sys
import time

import torch

from specforge_dspark.config.recipe import recipe_from_dict
from specforge_dspark.training.stream import FeatureStream
from specforge_dspark.engines.sglang import launch_args, validate_launch_args
from specforge_dspark.engines.sglang_keeper import engine_python

model, layers, tp, port, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
cfg = json.load(open(f"{model}/config.json"))
cfg = cfg.get("text_config", cfg)
L, H = cfg["num_hidden_layers"], cfg["hidden_size"]
layer_ids = [int(x) for x in layers.split()] or [1, L // 2, L - 3]


def recipe(backend):
    return recipe_from_dict({
        "target": {
            "path": model, "backend": backend, "dtype": "float32", "device": "cuda",
            "prefetch": 2, "batch_size": 2, "timeout_s": 300,
            "sglang": {"port": port, "startup_timeout_s": 1200,
                       "python": os.environ["SGLANG_PY"], "server_args": {
                "tp_size": tp, "mem_fraction_static": 0.5, "chunked_prefill_size": 8192}},
        },
        "draft": {"target_layer_ids": layer_ids, "num_target_layers": L,
                  "vocab_size": cfg["vocab_size"]},
        "train": {"output_dir": out},
    })


def check(ok, what):
    print(("PASS " if ok else "FAIL ") + what, flush=True)
    if not ok:
        sys.exit(1)


try:  # SGLang's own environment: sglang imports there, our plugin is registered there
    engine_python(os.environ["SGLANG_PY"], "SGLANG_PY", "sglang", "sglang.srt.plugins")
    check(True, "1. plugin entry point registered in SGLANG_PY's environment")
except ValueError as e:
    check(False, f"1. {e}")
args = launch_args(recipe("sglang"))
cfg_view = validate_launch_args(args)
check(cfg_view.aux_hidden_state_capture == "dspark", "2. launch args pass sglang validation")
print("   python -m sglang.launch_server " + " ".join(args))

g = torch.Generator().manual_seed(0)
lengths = [1, 37, 200, 1500, 64, 513]
samples = [
    {"sample_id": i, "input_ids": torch.randint(100, cfg["vocab_size"] - 100, (n,), generator=g),
     "loss_mask": torch.ones(n, dtype=torch.long)}
    for i, n in enumerate(lengths)
]
batches = [samples[i : i + 2] for i in range(0, len(samples), 2)]


long = [[{"sample_id": 1000 + i, "input_ids": torch.randint(100, 1000, (2048,), generator=g),
          "loss_mask": torch.ones(2048, dtype=torch.long)}] for i in range(32)]


def collect(stream):
    return [(f.sample_ids, f.lengths.clone(), f.aux_hidden.clone(), f.last_hidden.clone())
            for f in stream.iterate(batches)]


t0 = time.time()
with FeatureStream(recipe("sglang")) as stream:
    live = collect(stream)
    check(True, f"3. sglang stream answered {len(live)} batches ({time.time() - t0:.0f}s)")
    stream.bytes_out, t0 = 0, time.time()
    for _ in stream.iterate(long):
        pass
    dt = time.time() - t0
    throughput = f"bytes_per_s={stream.bytes_out / dt:.4g} tokens_per_s={32 * 2048 / dt:.4g}"
with FeatureStream(recipe("hf")) as stream:
    ref = collect(stream)
check(True, "4. hf reference computed")
worst = 1.0
for (ids, lens, aux, last), (rids, _, raux, rlast) in zip(live, ref):
    check(ids == rids and aux.shape == raux.shape and last.shape == rlast.shape,
          f"5a. batch {ids}: ids and shapes {tuple(aux.shape)} {tuple(last.shape)}")
    for b, n in enumerate(lens.tolist()):
        check(aux[b, n:].abs().sum() == 0 and last[b, n:].abs().sum() == 0, f"5b. {ids[b]} padding")
        for got, want in ((aux[b, :n].view(n, -1, H), raux[b, :n].view(n, -1, H)),
                          (last[b, :n], rlast[b, :n])):
            cos = torch.nn.functional.cosine_similarity(got.cuda(), want.cuda(), dim=-1)
            worst = min(worst, cos.min().item())
check(worst >= 0.99, f"5c. every valid row matches the hf reference (min cosine {worst:.4f})")
print(f"stream(sglang, 32 x 2048 tokens) {throughput}")
EOF
