"""Every FLOP once: the context K/V of each draft layer are computed once per micro-step
whatever the decoder chunking and activation recompute, which change neither the loss nor
any gradient; `objective.recompute: auto` is decided by the memory estimate; `bench step`
prints its line."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specforge_dspark.config.recipe import (
    DraftRecipe,
    ObjectiveRecipe,
    Recipe,
    RecipeError,
    load_recipe,
    recipe_from_dict,
)
from specforge_dspark.drafters.registry import new_draft
from specforge_dspark.objective.blocks import sample_anchors
from specforge_dspark.objective.frozen_head import FrozenHead
from specforge_dspark.objective.loss import compute_loss_at
from specforge_dspark.training import memory

REPO = Path(__file__).resolve().parents[1]
V, L, H, S, B = 40, 36, 16, 20, 2


def tiny(kind: str, seed: int = 0):
    """A float64 drafter of `kind` (3 layers, GQA), its head and a batch with anchors."""
    torch.manual_seed(seed)
    recipe = DraftRecipe(
        kind=kind,
        hidden_size=H,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        intermediate_size=24,
        vocab_size=V,
        block_size=4,
        target_layer_ids=[0, 1],
        num_target_layers=3,
        mask_token_id=38,
        markov_rank=6,
    )
    draft = new_draft(recipe).double()
    with torch.no_grad():
        for p in draft.parameters():  # markov_w2 starts at 0: make every gradient non-trivial
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    g = torch.Generator().manual_seed(seed + 1)
    head = FrozenHead(torch.randn(V, H, generator=g), torch.randn(V, H, generator=g), L).double()
    ids_BS = torch.randint(0, L, (B, S), generator=g)
    mask_BS = torch.ones(B, S, dtype=torch.long)
    mask_BS[:, :3] = 0
    mask_BS[1, 12] = 0
    batch = {
        "input_ids_BS": ids_BS,
        "loss_mask_BS": mask_BS,
        "aux_hidden_BSD": torch.randn(B, S, 2 * H, generator=g, dtype=torch.float64),
        "last_hidden_BSH": torch.randn(B, S, H, generator=g, dtype=torch.float64),
    }
    anchors_BN, valid_BN = sample_anchors(mask_BS, 5, torch.Generator().manual_seed(seed + 2))
    return draft, head, batch, anchors_BN, valid_BN


def objective(kind: str, **over) -> ObjectiveRecipe:
    bce = 0.0 if kind == "dflash" else 0.7
    return ObjectiveRecipe(num_anchors=5, ce_weight=0.3, l1_weight=0.9, bce_weight=bce, **over)


def loss_and_grads(draft, head, batch, anchors_BN, valid_BN, obj):
    draft.zero_grad(set_to_none=True)
    out = compute_loss_at(
        draft, head, **batch, anchors_BN=anchors_BN, block_valid_BN=valid_BN, obj=obj
    )
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in draft.named_parameters()}


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
@pytest.mark.parametrize("recompute", ["on", "off"])
def test_context_kv_is_projected_once_per_layer_whatever_the_chunks(kind, recompute):
    draft, head, batch, anchors_BN, valid_BN = tiny(kind)
    rows = []  # rows each k_proj call projected: S for the context, a chunk's queries else
    for layer in draft.layers:
        layer.self_attn.k_proj.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[1]))
    obj = objective(kind, chunk_size=3, decode_chunk_size=4, recompute=recompute)
    loss_and_grads(draft, head, batch, anchors_BN, valid_BN, obj)
    assert anchors_BN.shape == (B, 5) and valid_BN.all()
    chunks = 3  # 4 blocks = 2 anchor columns of the B=2 sequences per chunk: 2 + 2 + 1
    assert rows.count(S) == len(draft.layers)  # forward and backward, checkpointed or not
    block_calls = len(draft.layers) * chunks * (2 if recompute == "on" else 1)
    assert len(rows) - rows.count(S) == block_calls
    G = draft.config.block_size
    assert sorted(set(rows) - {S}) == [G, 2 * G]  # a chunk's block rows per sequence


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_loss_and_every_gradient_are_the_same_whatever_the_chunks_and_recompute(kind):
    draft, head, batch, anchors_BN, valid_BN = tiny(kind, seed=3)
    ref_loss, ref_grads = loss_and_grads(
        draft, head, batch, anchors_BN, valid_BN, objective(kind, decode_chunk_size=0)
    )
    assert all(g.abs().sum() > 0 for g in ref_grads.values())  # every parameter is reached
    for decode_chunk in (0, 1, 2, 4, 64):
        for recompute in ("on", "off", "auto"):
            obj = objective(kind, chunk_size=3, decode_chunk_size=decode_chunk, recompute=recompute)
            loss, grads = loss_and_grads(draft, head, batch, anchors_BN, valid_BN, obj)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-14)
            for name, g in grads.items():
                torch.testing.assert_close(g, ref_grads[name], rtol=1e-10, atol=1e-12, msg=name)


def test_forward_is_context_kv_then_decode():
    """propose() and the SGLang parity tests call forward: the same one decoder pass."""
    draft, head, batch, anchors_BN, valid_BN = tiny("dspark")
    ctx_BSH = draft.context(batch["aux_hidden_BSD"])
    pos_BS = torch.arange(S).expand(B, S)
    emb = head.embed(batch["input_ids_BS"][:, :8].reshape(B, 2, 4)).double()
    pos = torch.arange(8).reshape(1, 2, 4).expand(B, 2, 4) + 10
    mask = draft.masks(torch.tensor([[10, 14]] * B), torch.ones(B, 2, dtype=torch.bool),
                       torch.ones(B, S, dtype=torch.bool))  # fmt: skip
    kv = draft.context_kv(ctx_BSH, pos_BS)
    assert len(kv) == 3 and kv[0][0].shape == (B, 4, S, 4)  # KV heads repeated per query head
    torch.testing.assert_close(
        draft(ctx_BSH, pos_BS, emb, pos, mask), draft.decode(kv, emb, pos, mask), rtol=0, atol=0
    )


# --------------------------------------------------------------------------- memory decision


def sized(recompute: str = "auto", hidden: int = 256, anchors: int = 64, **draft) -> Recipe:
    return recipe_from_dict(
        {
            "draft": {"hidden_size": hidden, "vocab_size": 1024, **draft},
            "data": {"max_length": 512},
            "objective": {"num_anchors": anchors, "recompute": recompute},
        }
    )


def test_auto_recompute_is_off_when_everything_fits_and_on_when_it_does_not():
    small = sized()
    n = 2_000_000
    on, why = memory.recompute_choice(small, n, 1, available=24 * 10**9)
    assert not on and why.startswith("activation recompute: off (auto: decoder activations")
    big = sized(hidden=4096, anchors=4096, intermediate_size=16384, num_hidden_layers=8)
    on, why = memory.recompute_choice(big, n, 1, available=24 * 10**9)
    assert on and why.startswith("activation recompute: on (auto: ") and "over 80%" in why
    assert memory.recompute_choice(small, n, 1, available=None)[0]  # unknown memory: safe
    for mode in ("on", "off"):  # an explicit choice is kept, whatever the memory
        for available in (1, 10**15):
            on, why = memory.recompute_choice(sized(mode), n, 1, available)
            assert (
                on == (mode == "on")
                and why == f"activation recompute: {mode} (objective.recompute: {mode})"
            )


def test_recompute_keeps_one_decoder_chunk_in_the_estimate_instead_of_all():
    r = sized(anchors=512)
    r.objective.decode_chunk_size = 64
    on = memory.estimate(r, 10**6, 1, recompute=True)
    off = memory.estimate(r, 10**6, 1, recompute=False)
    chunk = on["activations: decoder (1 chunk)"]
    assert off["activations: decoder (all chunks)"] == pytest.approx(8 * chunk)
    assert memory.total_bytes(off) > memory.total_bytes(on)


def test_resolve_recompute_gives_the_objective_a_resolved_choice():
    r = sized()
    with torch.device("meta"):
        draft = new_draft(r.draft)
    resolved = memory.resolve_recompute(r, draft, 1, "cpu")
    assert r.objective.recompute == "auto"  # the recipe given is not changed
    assert resolved.objective.recompute in ("on", "off")
    assert dataclasses.replace(resolved.objective, recompute="auto") == r.objective
    forced = memory.resolve_recompute(sized("on"), draft, 1, "cpu")
    assert forced.objective.recompute == "on"


def test_dry_run_says_which_recompute_it_chose_and_why(capsys):
    lines = memory.dry_run_summary(load_recipe(REPO / "recipes/tiny_cpu.yaml"))
    said = [line for line in lines if line.startswith("activation recompute: ")]
    assert len(said) == 1 and re.fullmatch(r"activation recompute: (on|off) \(.+\)", said[0])


def test_recipe_rejects_a_bad_recompute_and_a_negative_decode_chunk():
    path = REPO / "recipes/tiny_cpu.yaml"
    with pytest.raises(RecipeError, match=r"objective\.recompute: 'sometimes' is not one of"):
        load_recipe(path, ["objective.recompute=sometimes"])
    with pytest.raises(RecipeError, match=r"objective\.decode_chunk_size must be >= 0"):
        load_recipe(path, ["objective.decode_chunk_size=-1"])
    # YAML reads a bare on / off as a boolean: the word is what the key means
    assert load_recipe(path, ["objective.recompute=off"]).objective.recompute == "off"
    assert recipe_from_dict({"objective": {"recompute": True}}).objective.recompute == "on"
    with pytest.raises(RecipeError, match=r"objective\.recompute: 3 is not one of"):
        recipe_from_dict({"objective": {"recompute": 3}})


# --------------------------------------------------------------------------- bench


def test_bench_step_runs_a_tiny_configuration_and_prints_its_line():
    tiny_shape = ["--hidden", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "16"]
    tiny_shape += ["--intermediate", "64", "--vocab", "512", "--seq-len", "64"]
    tiny_shape += ["--anchors", "8", "--chunk", "4", "--markov-rank", "8", "--repeats", "1"]
    p = subprocess.run(
        [sys.executable, "-m", "specforge_dspark.cli.bench", "step", *tiny_shape],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    line = p.stdout.strip().splitlines()[-1]
    assert re.fullmatch(
        r"step kind=dspark G=7 anchors=8 tokens_per_s=[0-9.]+ peak_rss_mb=\d+ recompute=(on|off)",
        line,
    ), line
