"""fp8 feature rows (target.transport_dtype fp8_e4m3): a scale per (row, aux layer) keeps a
shallow layer of tiny magnitudes within e4m3's rounding of a float64 reference while a
deep layer is large (one scale per row loses it); all-zero and near-zero rows come back as
zeros, never NaN; quantizing and dequantizing block by block gives the bytes of one pass;
the last hidden rows cross in bf16, bitwise; writer -> slot -> trainer features round
trip (split prefills included), dequantized where the features land; a slot written by
another layout version is refused naming it; the slot is ~0.58x of bf16's bytes at
Inkling's 5 aux layers. A CUDA-only test (skipped on CPU, it cannot run there) checks that
the fp8 rows and scales are copied to the GPU asynchronously from the pinned slot and that
the GPU's dequantization equals the CPU's bitwise."""

from __future__ import annotations

import pytest
import torch

from specforge_dspark.config.recipe import RecipeError, recipe_from_dict
from specforge_dspark.transport import fp8_rows, pinning
from specforge_dspark.transport.features import PaddedBatch
from specforge_dspark.transport.fp8_rows import FP8, dequantize, quantize, quantize_into
from specforge_dspark.transport.request import issue_tickets, slot_features
from specforge_dspark.transport.shm import ShmSlot, SlotLayout
from specforge_dspark.transport.slot_writer import SLOTS, write_features

M, H = 3, 8  # aux layers, hidden size
D = M * H


def _layers(n: int, magnitudes: list[float], seed: int = 0) -> torch.Tensor:
    """Rows [n, M*H]: layer i ~ randn * magnitudes[i]."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, M, H, generator=g) * torch.tensor(magnitudes)[:, None]).view(n, D)


def _reference(x_ND: torch.Tensor, layers: int) -> torch.Tensor:
    """float64 e4m3 round trip of x with one scale per (row, group of D / layers columns):
    the group's largest magnitude at 448, float32 scales (the wire's), each element rounded
    by the float8_e4m3fn cast, everything else in float64."""
    x = x_ND.double().view(x_ND.shape[0], layers, -1)
    scale = (x.abs().amax(-1, keepdim=True) / 448).float().double()
    return ((x / scale).to(FP8).double() * scale).view(x_ND.shape)


def _per_layer(err_ND: torch.Tensor, x_ND: torch.Tensor) -> list[float]:
    """max |err| / max |x| of each aux layer."""
    err, x = err_ND.view(-1, M, H), x_ND.view(-1, M, H)
    return [float(err[:, i].abs().max() / x[:, i].abs().max()) for i in range(M)]


def _roundtrip(x_ND: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    q_NLH, scale_NL = quantize(x_ND.view(-1, M, H))
    return dequantize(q_NLH.view(-1, D), scale_NL, dtype)


def test_a_shallow_layer_of_tiny_magnitudes_keeps_e4m3_precision_beside_a_large_one():
    x = _layers(64, [1e-4, 1.0, 3e3])
    got = _roundtrip(x)
    ref = _reference(x, M)
    # within float32's rounding of the float64 reference, layer by layer
    assert max(_per_layer(got.double() - ref, x)) <= 2**-22
    # e4m3 keeps 3 mantissa bits: each layer within 1/16 of its largest, the shallow one too
    rel = _per_layer(got.double() - x.double(), x)
    assert all(0 < r <= 1 / 16 for r in rel), rel
    # one scale across the row (the old wire) loses the shallow layer to e4m3's subnormals
    one_scale = _reference(x, 1)
    assert _per_layer(one_scale - x.double(), x)[0] > 0.5


def test_zero_and_near_zero_rows_come_back_as_zeros_not_nan():
    x = _layers(4, [1.0, 1.0, 1.0])
    x[0] = 0.0
    x[1] = 1e-44  # float32 subnormals: largest / 448 underflows to 0
    x[2, :H] = 0.0  # one zero layer beside two others
    q, scale = quantize(x.view(-1, M, H))
    assert torch.isfinite(scale).all() and (scale > 0).all()
    got = dequantize(q.view(-1, D), scale, torch.bfloat16)
    assert torch.isfinite(got).all()
    assert not got[:2].any() and not got[2, :H].any()
    assert got[3].float().abs().max() > 0


def test_block_by_block_gives_the_bytes_of_one_pass(monkeypatch):
    x = _layers(37, [1e-3, 1.0, 50.0]).to(torch.bfloat16)
    q_one, scale_one = quantize(x.view(-1, M, H))
    want = dequantize(q_one.view(-1, D), scale_one, torch.bfloat16)
    monkeypatch.setattr(fp8_rows, "BLOCK_BYTES", 4 * D * 5)  # blocks of 5 rows
    assert fp8_rows.block_rows(D) == 5
    q, scale = torch.empty(37, D, dtype=FP8), torch.empty(37, M)
    quantize_into(x, q, scale)
    assert torch.equal(q.view(torch.uint8), q_one.view(-1, D).view(torch.uint8))
    assert torch.equal(scale, scale_one)
    got = dequantize(q, scale, torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # and one pass is q * scale in float32, rounded once
    manual = (q_one.float() * scale_one[..., None]).to(torch.bfloat16).view(-1, D)
    assert torch.equal(got.view(torch.int16), manual.view(torch.int16))


def _written(slot: ShmSlot, lengths: list[int], rows_ND: torch.Tensor, last_NH: torch.Tensor):
    """Issue tickets for `lengths` and write the rows as a server does (the second
    sequence in two chunks, a split prefill)."""
    ids = torch.ones(len(lengths), max(lengths), dtype=torch.long)
    batch = PaddedBatch(list(range(len(lengths))), ids, ids, torch.tensor(lengths))
    views = issue_tickets(slot, batch)
    o = 0
    for b, n in enumerate(lengths):
        nonce, cut = slot.read_ticket(b).nonce, n // 2 if b else n
        for lo, hi in ((0, cut), (cut, n)):
            if hi > lo:
                rows = slice(o + lo, o + hi)
                write_features(str(slot.path), b, nonce, lo, rows_ND[rows], last_NH[rows])
        o += n
    return views, batch


@pytest.mark.parametrize("target_dtype", [torch.bfloat16, torch.float32])
def test_writer_slot_trainer_round_trip_with_the_last_hidden_bitwise_bf16(target_dtype):
    lengths = [5, 3]
    aux_in = _layers(8, [1e-4, 1.0, 3e3], seed=1)
    last_in = torch.randn(8, H, generator=torch.Generator().manual_seed(2)) * 40
    slot = ShmSlot("fp8rt", aux_width=D, hidden=H, dtype=FP8)
    try:
        views, batch = _written(slot, lengths, aux_in, last_in)
        assert all(slot.read_ticket(b).written == n for b, n in enumerate(lengths))
        wire = slot_features(views, batch, target_dtype)
        assert wire.aux_hidden.dtype == FP8 and wire.aux_scale.shape == (2, 5, M)
        f = wire.to("cpu")  # on CPU the rows are dequantized where they land
        assert f.aux_scale is None and f.aux_hidden.dtype == f.last_hidden.dtype == target_dtype
        rows = [(0, slice(0, 5), 5), (1, slice(5, 8), 3)]
        for b, src, n in rows:
            want_last = last_in[src].to(torch.bfloat16).to(target_dtype)
            assert torch.equal(f.last_hidden[b, :n], want_last)
            want_aux = _reference(aux_in[src], M)
            assert max(_per_layer(f.aux_hidden[b, :n].double() - want_aux, aux_in[src])) <= (
                2**-8 if target_dtype == torch.bfloat16 else 2**-22
            )
        assert not f.aux_hidden[1, 3:].any() and not f.last_hidden[1, 3:].any()  # padding
    finally:
        slot.close()


def test_a_slot_of_another_layout_version_is_refused_naming_it():
    lay = SlotLayout.plan(16, 2, D, H, FP8)
    header = bytearray(lay.pack())
    assert SlotLayout.unpack(bytes(header), "here") == lay
    header[6:8] = b"03"
    with pytest.raises(RuntimeError, match="slot layout version 03, this code reads 04"):
        SlotLayout.unpack(bytes(header), "here")


def test_an_fp8_slot_is_near_0_58_of_bf16_at_inkling_dims():
    fp8 = SlotLayout.plan(4096, 1, 5 * 6144, 6144, FP8)
    bf16 = SlotLayout.plan(4096, 1, 5 * 6144, 6144, torch.bfloat16).nbytes
    assert fp8.last_dtype == torch.bfloat16 and fp8.layers == 5
    assert 7 / 12 < fp8.nbytes / bf16 < 7 / 12 + 1e-3  # aux 5 x 1 byte + last 2, vs 6 x 2


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

    r = recipe("auto")
    m = len(r.draft.target_layer_ids)
    bf16, fp8 = slot_summary(r), slot_summary(recipe("fp8_e4m3"))
    assert "MiB of bfloat16 rows" in bf16
    assert "MiB of float8_e4m3fn aux rows (bfloat16 last hidden rows)" in fp8
    mib = [float(s.split(" x ")[1].split(" MiB")[0]) for s in (bf16, fp8)]
    want = (m + 2) / (2 * m + 2)  # bytes of an fp8 row (aux m x 1, last 2) over bf16's
    assert want - 0.01 < mib[1] / mib[0] < want + 0.02, (bf16, fp8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_with_cuda_fp8_rows_copy_asynchronously_and_dequantize_on_the_gpu_as_on_the_cpu():
    """Cannot run on a CPU-only machine: it checks the CUDA path of TargetFeatures.to."""
    from torch.profiler import ProfilerActivity, profile

    lengths = [64, 64]  # equal lengths: the features are views of the pinned slot
    aux_in = _layers(128, [1e-4, 1.0, 3e3], seed=3).cuda()  # the server's rows on its GPU
    last_in = torch.randn(128, H, device="cuda")
    slot = ShmSlot("fp8cuda", aux_width=D, hidden=H, dtype=FP8)
    try:
        views, batch = _written(slot, lengths, aux_in, last_in)
        assert slot.pinned and views.aux.is_pinned() and views.aux_scale.is_pinned()
        pinned = [t.pin_memory() for t in (batch.input_ids, batch.loss_mask, batch.lengths)]
        wire = slot_features(views, PaddedBatch(batch.sample_ids, *pinned), torch.bfloat16)
        on_cpu = wire.to("cpu")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            moved = wire.to("cuda")
            pending = list(pinning._PINNED[slot.pinned][1])
            torch.cuda.synchronize()
        assert moved.copy_done is not None and pending  # the slot waits for the copy
        names = [e.name for e in prof.events()]
        assert any("cudaMemcpyAsync" in n for n in names)
        copies = [n for n in names if n.startswith("Memcpy HtoD")]
        assert copies and all("Pinned" in n for n in copies), copies  # no pageable source
        assert moved.aux_hidden.device.type == "cuda" and moved.aux_hidden.dtype == torch.bfloat16
        gpu, cpu = moved.aux_hidden.cpu(), on_cpu.aux_hidden
        assert torch.equal(gpu.view(torch.int16), cpu.view(torch.int16))  # bitwise
        assert torch.equal(moved.last_hidden.cpu(), last_in.cpu().to(torch.bfloat16).view(2, 64, H))
        slot.prepare(lengths)  # waits for the copy before the slot may be rewritten
        assert moved.copy_done.query() and not pinning._PINNED[slot.pinned][1]
    finally:
        SLOTS.close()  # the writer's mapping (a server's, here in this process) is pinned too
        slot.close()
    assert not pinning._PINNED
