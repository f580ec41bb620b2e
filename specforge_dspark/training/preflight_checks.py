"""The checks of the feature preflight (training/preflight.py runs them; its docstring
lists them) and the target's own greedy ground truth they compare against."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specforge_dspark.engines.api_key import auth_headers
from specforge_dspark.engines.tap import read_target_dims
from specforge_dspark.transport.features import DTYPES, Sample, TargetFeatures, field

ARGMAX_MIN = 0.95
"""Least fraction of greedy positions whose teacher argmax must be the target's token."""
RELATIVE_TOL = {"float32": 1e-4, "bfloat16": 3e-2, "fp8_e4m3": 7e-2}
"""max |a - b| / max |b| allowed between two runs of the same features, by target.dtype
(by target.transport_dtype fp8_e4m3 where set: an aux element's rounding is within 1/16
of itself, or of its row's largest in that layer)."""
LOGPROB_TOL = {"float32": 1e-3, "bfloat16": 0.15}
"""Largest |teacher log p(y) - target log p(y)| on greedy positions, by the dtype the last
hidden rows cross in: target.dtype, bfloat16 with target.transport_dtype fp8_e4m3 (they
are never fp8)."""
REFERENCE_MAX_BYTES = 4 << 30
"""--reference auto loads the in-process hf reference only for weights up to this size."""
NEW_TOKENS = 16
"""Greedy tokens generated per prompt."""
PROMPT_MAX = 96
"""Prompt tokens kept (the last ones before the answer)."""


class PreflightError(ValueError):
    """The engine's features failed a preflight check; the message names each one."""


@dataclass
class Check:
    name: str
    ok: bool | None  # None: not applicable here
    value: str
    limit: str = ""


@dataclass
class GreedyRow:
    """A sequence with the target's greedy token after each position in `positions_P`."""

    sample: Sample
    positions_P: torch.Tensor  # [P] positions t whose next token the target chose greedily
    tokens_P: torch.Tensor  # [P] that token
    logprobs_P: torch.Tensor  # [P] its log-prob under the target


# --------------------------------------------------------------------------- ground truth


def prompts_from(rows: Sequence[Any], n: int) -> list[list[int]]:
    """The first `n` rows' prompts: tokens before the first supervised one (<= PROMPT_MAX)."""
    out = []
    for row in rows:
        if len(out) == n:
            break
        ids, mask = list(field(row, "input_ids")), list(field(row, "loss_mask"))
        cut = mask.index(1) if 1 in mask else len(ids)
        if cut >= 1:
            out.append([int(t) for t in ids[max(0, cut - PROMPT_MAX) : cut]])
    if len(out) < n:
        raise ValueError(f"train.preflight_samples={n}: the data has only {len(out)} prompts")
    return out


def _rollout_row(sid: int, prompt: list[int], new: list[int], logprobs: list[float]) -> GreedyRow:
    ids = torch.tensor(prompt + new, dtype=torch.long)
    mask = torch.cat([torch.zeros(len(prompt), dtype=torch.long), torch.ones(len(new)).long()])
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(new) - 1)
    return GreedyRow(Sample(sid, ids, mask), positions, ids[positions + 1], torch.tensor(logprobs))


@torch.inference_mode()
def rollouts_hf(model: torch.nn.Module, prompts: list[list[int]], n: int) -> list[GreedyRow]:
    """Greedy continuations by the transformers model itself (cached decoding, no EOS stop)."""
    rows = []
    for sid, prompt in enumerate(prompts):
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        new, logprobs = [], []
        for _ in range(n):
            logp_V = out.logits[0, -1].float().log_softmax(-1)
            tok = int(logp_V.argmax())
            new.append(tok)
            logprobs.append(float(logp_V[tok]))
            step = torch.tensor([[tok]])
            out = model(input_ids=step, past_key_values=out.past_key_values, use_cache=True)
        rows.append(_rollout_row(sid, prompt, new, logprobs))
    return rows


def rollouts_sglang(
    url: str, prompts: list[list[int]], n: int, timeout_s: float, key: str | None = None
) -> list[GreedyRow]:
    """Greedy continuations by the SGLang server (what it serves, API key `key`), with
    their log-probs."""
    body = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
    }
    replies = _post(f"{url}/generate", body, timeout_s, key)
    rows = []
    for sid, (prompt, reply) in enumerate(zip(prompts, replies, strict=True)):
        triples = reply["meta_info"]["output_token_logprobs"]  # [logprob, token id, text]
        new, logprobs = [int(t[1]) for t in triples], [float(t[0]) for t in triples]
        rows.append(_rollout_row(sid, prompt, new, logprobs))
    return rows


@torch.inference_mode()
def teacher_forced_rows(model: torch.nn.Module, samples: list[Any]) -> list[GreedyRow]:
    """The model's argmax after every position of given rows (an offline capture's)."""
    rows = []
    for s in samples:
        ids = torch.as_tensor(field(s, "input_ids"), dtype=torch.long)
        logp_SV = model(input_ids=ids[None]).logits[0].float().log_softmax(-1)
        tokens_S = logp_SV.argmax(-1)
        sample = Sample(int(field(s, "sample_id")), ids, torch.as_tensor(field(s, "loss_mask")))
        positions = torch.arange(ids.numel())
        rows.append(
            GreedyRow(sample, positions, tokens_S, logp_SV.gather(-1, tokens_S[:, None])[:, 0])
        )
    return rows


def _post(url: str, body: dict, timeout_s: float, key: str | None) -> Any:
    headers = {"Content-Type": "application/json", **auth_headers(key)}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def server_chunk(url: str, key: str | None = None) -> int:
    """The server's chunked_prefill_size (<= 0: every prefill whole)."""
    req = urllib.request.Request(f"{url}/server_info", headers=auth_headers(key))
    with urllib.request.urlopen(req, timeout=30.0) as r:
        return int(json.loads(r.read()).get("chunked_prefill_size") or -1)


# --------------------------------------------------------------------------- checks


def relative_diff(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max |got - want|, that / max |want|) in float32."""
    got, want = got.float(), want.float()
    diff = (got - want).abs().max().item() if got.numel() else 0.0
    return diff, diff / max(want.abs().max().item() if want.numel() else 0.0, 1e-12)


def _diff_check(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> Check:
    diff, rel = relative_diff(got, want)
    return Check(name, rel <= tol, f"max abs {diff:.2g} (rel {rel:.2g})", f"rel <= {tol:g}")


def shape_checks(
    recipe, feats: list[TargetFeatures], expected_tap: str, recorded: str
) -> list[Check]:
    dims = read_target_dims(recipe.target.path, recipe.draft.target_layer_ids)
    m, H, dtype = len(dims.layer_ids), dims.hidden_size, DTYPES[recipe.target.dtype]
    widths = {(f.aux_hidden.shape[-1], f.last_hidden.shape[-1]) for f in feats}
    dtypes = {
        str(t.dtype).removeprefix("torch.") for f in feats for t in (f.aux_hidden, f.last_hidden)
    }
    bad_rows, n_seqs = 0, sum(len(f.sample_ids) for f in feats)
    for f in feats:
        for b, n in enumerate(f.lengths.tolist()):
            real_ok = all(bool(t[b, :n].isfinite().all()) for t in (f.aux_hidden, f.last_hidden))
            pad_ok = all(bool((t[b, n:] == 0).all()) for t in (f.aux_hidden, f.last_hidden))
            bad_rows += not (real_ok and pad_ok)
    want_dtype = str(dtype).removeprefix("torch.")
    return [
        Check(
            "aux width",
            widths == {(m * H, H)},
            ", ".join(f"aux {a}, last {h}" for a, h in sorted(widths)),
            f"aux {m} x {H} = {m * H}, last {H}",
        ),
        Check(
            "dtype", dtypes == {want_dtype}, ", ".join(sorted(dtypes)), f"target.dtype {want_dtype}"
        ),
        Check(
            "finite", bad_rows == 0, f"{bad_rows} bad of {n_seqs} sequences", "finite, padding 0"
        ),
        Check(
            "tap convention", recorded == expected_tap, recorded, f"{expected_tap} (architecture)"
        ),
    ]


def greedy_checks(
    rows: list[GreedyRow], feats: list[TargetFeatures], head, dtype: str
) -> list[Check]:
    """Teacher argmax and log-prob vs the target's greedy tokens; `feats[i]` holds row i alone."""
    hits = total = 0
    worst = 0.0
    for row, f in zip(rows, feats, strict=True):
        last_PH = f.last_hidden[0, row.positions_P].to(head.lm_head_weight.device)
        z_PV = head.teacher_logits(last_PH).float().cpu()
        logical_PV = z_PV[:, : head.logical_vocab].log_softmax(-1)
        hits += int((logical_PV.argmax(-1) == row.tokens_P).sum())
        total += row.positions_P.numel()
        # the target normalises over its logical rows (Inkling) or all LM-head rows (most
        # others) by architecture: the closer of the two is its own
        diffs = [
            (lp_PV.gather(-1, row.tokens_P[:, None])[:, 0] - row.logprobs_P).abs()
            for lp_PV in (logical_PV, z_PV.log_softmax(-1))
        ]
        worst = max(worst, torch.minimum(*diffs).max().item())
    rate, tol = hits / max(total, 1), LOGPROB_TOL[dtype]
    return [
        Check(
            "greedy argmax",
            rate >= ARGMAX_MIN,
            f"{hits}/{total} = {rate:.1%}",
            f">= {ARGMAX_MIN:.0%}",
        ),
        Check("greedy logprob", worst <= tol, f"max |diff| {worst:.2g}", f"<= {tol:g}"),
    ]


def _rows_of(f: TargetFeatures, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = int(f.lengths[b])
    return f.aux_hidden[b, :n], f.last_hidden[b, :n]


def batch_check(alone: list[TargetFeatures], together: TargetFeatures, tol: float) -> Check:
    worst = (0.0, 0.0)
    for b, f in enumerate(alone):
        for got, want in zip(_rows_of(together, b), _rows_of(f, 0), strict=True):
            worst = max(worst, relative_diff(got, want), key=lambda d: d[1])
    ok = worst[1] <= tol
    value = f"max abs {worst[0]:.2g} (rel {worst[1]:.2g}), {len(alone)} lengths padded"
    return Check("batch", ok, value, f"rel <= {tol:g}")


def split_check(whole: TargetFeatures, split: TargetFeatures, tol: float) -> Check:
    """The sample alone (whole prefill) vs packed behind a filler (row 1, split)."""
    worst = (0.0, 0.0)
    for got, want in zip(_rows_of(split, 1), _rows_of(whole, 0), strict=True):
        worst = max(worst, relative_diff(got, want), key=lambda d: d[1])
    n = int(whole.lengths[0])
    value = f"max abs {worst[0]:.2g} (rel {worst[1]:.2g}), {n} tokens cut at {n - n // 2}"
    return Check("split prefill", worst[1] <= tol, value, f"rel <= {tol:g}")


def split_plan(sample: Sample, chunk: int) -> tuple[Sample, list[Sample]] | None:
    """(the sample cut to <= chunk tokens, [filler, it]): packed behind the filler the
    server's prefill budget of `chunk` tokens runs out halfway through the sample."""
    if chunk <= 1:
        return None
    ids = torch.as_tensor(sample.input_ids)[:chunk]
    whole = Sample(1, ids, torch.ones_like(ids))
    filler_ids = ids.repeat(2)[: chunk - ids.numel() // 2]
    return whole, [Sample(0, filler_ids, torch.ones_like(filler_ids)), whole]


def reference_checks(
    layer_ids: list[int], engine: list[TargetFeatures], ref: list[TargetFeatures], tol: float
) -> list[Check]:
    H = ref[0].last_hidden.shape[-1]

    def part(f: TargetFeatures, i: int) -> torch.Tensor:  # aux slice i, or last (i = m)
        return f.last_hidden if i == len(layer_ids) else f.aux_hidden[..., i * H : (i + 1) * H]

    out = []
    for i, name in enumerate([*(f"L{k}" for k in layer_ids), "last"]):
        got = torch.cat([part(f, i).flatten() for f in engine])
        want = torch.cat([part(f, i).flatten() for f in ref])
        out.append(_diff_check(f"reference {name}", got, want, tol))
    return out


def format_table(checks: list[Check], title: str) -> str:
    """One row per check: name, ok / FAIL / n/a, measured value, limit."""
    width = max(len(c.name) for c in checks)
    lines = [title]
    for c in checks:
        verdict = "n/a" if c.ok is None else "ok" if c.ok else "FAIL"
        lines.append(f"  {c.name:<{width}}  {verdict:<4}  {c.value:<44}  {c.limit}".rstrip())
    return "\n".join(lines)
