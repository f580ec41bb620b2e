"""SpecForge 0.2.0's side of `make incumbent` (scripts/incumbent.py): its draft and run
configs for a recipe, its offline features from our hf target's stream, its training and
export in .venv-specforge."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SF_PY = REPO / ".venv-specforge" / "bin" / "python"


def sf_draft_config(recipe) -> dict:
    """SpecForge's draft JSON (a Qwen3 config with `dflash_config`) for `recipe.draft`."""
    d = recipe.draft
    return {
        "architectures": ["DSparkDraftModel"], "model_type": "qwen3",
        "hidden_size": d.hidden_size, "intermediate_size": d.intermediate_size,
        "num_hidden_layers": d.num_hidden_layers, "num_attention_heads": d.num_attention_heads,
        "num_key_value_heads": d.num_key_value_heads, "head_dim": d.head_dim,
        "hidden_act": d.hidden_act, "rms_norm_eps": d.rms_norm_eps, "rope_theta": d.rope_theta,
        "max_position_embeddings": d.max_position_embeddings, "vocab_size": d.vocab_size,
        "attention_bias": False, "layer_types": ["full_attention"] * d.num_hidden_layers,
        "block_size": d.block_size, "num_target_layers": d.num_target_layers,
        "dflash_config": {
            "target_layer_ids": list(d.target_layer_ids), "mask_token_id": d.mask_token_id,
            "markov_rank": d.markov_rank, "markov_head_type": d.markov_head_type,
            "enable_confidence_head": d.enable_confidence_head,
            "confidence_head_with_markov": d.confidence_head_with_markov,
        },
    }  # fmt: skip


def sf_run_config(recipe, seed: int, steps: int, nproc: int, features: Path, out: Path) -> dict:
    """SpecForge's run YAML (as a dict): the recipe's objective, optimizer and schedule."""
    o, opt = recipe.objective, recipe.optim
    return {
        "run_id": "dspark", "output_dir": str(out / "ckpt"),
        "model": {"target_model_path": str(Path(recipe.target.path).resolve()),
                  "draft_model_config": str(out / "draft_config.json"),
                  "torch_dtype": "float32", "mask_token_id": recipe.draft.mask_token_id},
        "data": {"hidden_states_path": str(features), "max_length": recipe.data.max_length,
                 "dataloader_num_workers": 0},
        "training": {
            "strategy": "dspark", "attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD",
            "num_epochs": 1000, "max_steps": steps, "batch_size": 1, "accumulation_steps": 1,
            "learning_rate": opt.lr, "lr_scheduler": "cosine", "warmup_ratio": opt.warmup_ratio,
            "max_grad_norm": opt.grad_clip, "num_anchors": o.num_anchors,
            "loss_decay_gamma": o.gamma, "objective_chunk_blocks": o.chunk_size,
            "dspark_ce_loss_alpha": o.ce_weight, "dspark_l1_loss_alpha": o.l1_weight,
            "dspark_confidence_head_alpha": o.bce_weight, "seed": seed,
            "save_interval": 0, "log_interval": 100, "max_checkpoints": 0,
        },
        "tracking": {"report_to": "none"},
        "deployment": {"mode": "local_colocated",
                       "trainer": {"nnodes": 1, "nproc_per_node": nproc}},
    }  # fmt: skip


def write_features(recipe, out: Path) -> Path:
    """One SpecForge offline sample per prepared row (`data_<id>.ckpt`: input_ids,
    loss_mask [S] int64, hidden_states [S, m*H], target_last_hidden_states [S, H] fp32),
    from the same hf feature stream our trainer reads; done once (out/done marks it)."""
    import copy

    import torch

    from data_pipelines.ingest import batched
    from data_pipelines.prepare import prepare_dataset
    from specforge_dspark.training.stream import FeatureStream

    if (out / "done").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    hf = copy.deepcopy(recipe)
    hf.target.backend = "hf"
    n = 0
    with FeatureStream(hf) as live:
        for feats in live.iterate(batched(prepare_dataset(recipe), hf.target.batch_size)):
            for b, sid in enumerate(feats.sample_ids):
                L = int(feats.lengths[b])
                sample = {
                    "input_ids": feats.input_ids[b, :L].long().clone(),
                    "loss_mask": feats.loss_mask[b, :L].long().clone(),
                    "hidden_states": feats.aux_hidden[b, :L].float().clone(),
                    "target_last_hidden_states": feats.last_hidden[b, :L].float().clone(),
                }
                torch.save(sample, out / f"data_{int(sid):06d}.ckpt")
                n += 1
    (out / "done").write_text(f"{n}\n")
    print(f"features: {n} samples -> {out}", flush=True)
    return out


def train_specforge(recipe, seed: int, steps: int, nproc: int, features: Path, out: Path) -> dict:
    """SpecForge trains and exports (`specforge train`, `specforge export --to hf`); reused
    when its export exists. Returns {"export", "seconds", "steps"}."""
    import yaml

    export = out / "export"
    timing = out / "timing.json"
    if (export / "config.json").is_file() and timing.is_file():
        return {"export": str(export), **json.loads(timing.read_text())}
    out.mkdir(parents=True, exist_ok=True)
    (out / "draft_config.json").write_text(json.dumps(sf_draft_config(recipe), indent=1))
    run_yaml = out / "run.yaml"
    run_yaml.write_text(yaml.safe_dump(sf_run_config(recipe, seed, steps, nproc, features, out)))
    env = {**os.environ, "SPECFORGE_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    t = time.time()
    cmd = [str(SF_PY), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(nproc), "-m", "specforge.cli", "train", "--config", str(run_yaml)]  # fmt: skip
    with (out / "train.log").open("w") as log:
        print(f"specforge seed {seed}: {' '.join(cmd[1:])} (log {out / 'train.log'})", flush=True)
        subprocess.run(cmd, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.time() - t
    subprocess.run(
        [str(SF_PY), "-m", "specforge.cli", "export", "--to", "hf", "--checkpoint",
         str(out / "ckpt"), "--draft-config", str(out / "draft_config.json"),
         "--output-dir", str(export)],
        check=True, env=env,
    )  # fmt: skip
    res = {"seconds": round(seconds, 1), "steps": steps}
    timing.write_text(json.dumps(res))
    return {"export": str(export), **res}
