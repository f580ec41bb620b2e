"""fp8 feature rows (target.transport_dtype fp8_e4m3): per-row scales put each row's
largest magnitude at 448, so every element comes back within 1/16 of its row's largest
(e4m3 keeps 3 mantissa bits); a slot of fp8 rows is about half a bf16 slot; the writer
quantizes, the slot holds the scales, the trainer's padded view dequantizes."""

from __future__ import annotations

import pytest
import torch

from specforge_dspark.config.recipe import RecipeError, recipe_from_dict
from specforge_dspark.engines.shm import DTYPE_CODES, FP8, ShmSlot, SlotLayout, quantize_rows
from specforge_dspark.engines.slot_writer import write_features
from specforge_dspark.engines.tickets import DONE, PENDING, Ticket

D, H = 12, 4


def _within_a_sixteenth(got_ND: torch.Tensor, want_ND: torch.Tensor) -> float:
    """max over rows of max |got - want| / max |want| (0 for an all-zero row)."""
    amax = want_ND.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    return float(((got_ND - want_ND).abs() / amax).max())


def test_rows_come_back_within_a_sixteenth_of_their_largest_element():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g) * torch.logspace(-6, 6, 64)[:, None]  # any scale
    x[3] = 0.0
    q, scale = quantize_rows(x)
    assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (64,)
    back = q.float() * scale[:, None]
    assert torch.isfinite(back).all() and not back[3].any()
    err = _within_a_sixteenth(back, x)
    assert 0 < err <= 1 / 16
    assert float(q.float().abs().amax()) == 448.0  # the range is used


def test_an_fp8_slot_holds_half_the_bytes_and_the_trainer_reads_dequantized_rows():
    fp8 = SlotLayout.plan(4096, 1, 5 * 6144, 6144, FP8).nbytes
    bf16 = SlotLayout.plan(4096, 1, 5 * 6144, 6144, torch.bfloat16).nbytes
    assert 0.50 < fp8 / bf16 < 0.501  # the ids and the per-row scales are the rest

    slot = ShmSlot("fp8test", aux_width=D, hidden=H, dtype=FP8)
    lengths = [5, 3]
    views = slot.prepare(lengths)
    code = DTYPE_CODES[FP8]
    for b, n in enumerate(lengths):
        slot.write_ticket(b, Ticket(PENDING, n, 0, *views.offsets(b), D, H, code, nonce=3))
    rows = torch.randn(8, D + H, generator=torch.Generator().manual_seed(1)) * 40
    write_features(str(slot.path), 0, 3, 0, rows[:5, :D], rows[:5, D:])
    write_features(str(slot.path), 1, 3, 0, rows[5:6, :D], rows[5:6, D:])  # chunk 1 of 2
    write_features(str(slot.path), 1, 3, 1, rows[6:8, :D], rows[6:8, D:])  # chunk 2 of 2
    assert [slot.read_ticket(b).status for b in (0, 1)] == [DONE, DONE]
    aux, last = views.padded(5, torch.float32)
    assert aux.dtype == last.dtype == torch.float32 and aux.shape == (2, 5, D)
    got = torch.cat([torch.cat([aux[0], last[0]], 1), torch.cat([aux[1, :3], last[1, :3]], 1)])
    assert _within_a_sixteenth(got[:, :D], rows[:, :D]) <= 1 / 16
    assert _within_a_sixteenth(got[:, D:], rows[:, D:]) <= 1 / 16
    assert not aux[1, 3:].any()  # padding
    slot.close()


def test_fp8_is_refused_where_no_writer_quantizes():
    base = {"draft": {"target_layer_ids": [0, 1], "num_target_layers": 4}}
    with pytest.raises(RecipeError, match="target.transport_dtype=fp8_e4m3: only the sglang"):
        recipe_from_dict({**base, "target": {"backend": "hf", "transport_dtype": "fp8_e4m3"}})
    r = recipe_from_dict({**base, "target": {"backend": "sglang", "transport_dtype": "fp8_e4m3"}})
    assert r.target.transport_dtype == "fp8_e4m3"


def test_the_dry_run_sizes_slots_in_the_wire_dtype():
    from specforge_dspark.training.memory import slot_summary

    def recipe(transport_dtype: str):
        target = {"backend": "sglang", "dtype": "bfloat16", "transport_dtype": transport_dtype}
        return recipe_from_dict({"target": target})

    bf16, fp8 = slot_summary(recipe("auto")), slot_summary(recipe("fp8_e4m3"))
    assert "MiB of bfloat16 rows" in bf16 and "MiB of float8_e4m3fn rows" in fp8
    mib = [float(s.split(" x ")[1].split(" MiB")[0]) for s in (bf16, fp8)]
    assert 0.49 < mib[1] / mib[0] < 0.52, (bf16, fp8)
