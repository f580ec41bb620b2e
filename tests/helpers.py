"""Small shared test fixtures (plain functions, no pytest magic)."""

from __future__ import annotations

from pathlib import Path

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
DATA_HERE = [
    f"data.train_files=[{SHARED_DATA}/train/gsm8k_train.jsonl]",
    f"data.eval_files=[{SHARED_DATA}/eval/gsm8k_test.jsonl]",
]
"""Overrides pointing a production recipe, whose data data_pipelines.regenerate makes
(and the dry run refuses until it is there), at files that exist here."""

# A tiny DSpark draft: GQA (4 query heads over 2 KV heads), 2 layers, 2 aux layers.
TINY_DRAFT = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=48,
    vocab_size=50,
    block_size=3,
    target_layer_ids=[0, 2],
    num_target_layers=4,
    mask_token_id=7,
    markov_rank=6,
    rope_theta=500.0,
)
