"""Sequential temperature scaling (STS) of the DSpark confidence head, for SGLang.

1. Real speculative decoding (every draft verified) of the held-out prompts records, per
   verify step, the G raw confidence logits z_k and the accepted count n (what SGLang's
   `StsDataRecorder` records: logits and the prefix mask k < n).
2. Conversations alternate between a fit split (even index) and an evaluation split (odd).
3. Fit on the fit split, against "draft k accepted" (n > k) over the steps that reached
   position k (n >= k), the conditional acceptance the head is trained on:
   - temperatures only (`fit_sts`): position by position, T_k minimises the BCE of
     sigmoid(z_k / T_k). SGLang divides the logits by T_k
     (`DSparkConfidenceHead.apply_sts`) and multiplies the calibrated conditionals into
     the survival its verify budget ranks. Temperature scaling has no offset: a head that
     is overconfident at every confidence (a drafter accepted less on new prompts than
     on its training data) stays so;
   - temperatures and one shared logit offset (`fit_sts_offset`): sigmoid((z_k + d) / T_k),
     all G + 1 parameters by one BCE over every position. SGLang serves it unchanged when
     d is added to the export's confidence bias (decoding/sts.py) and the T_k are the STS
     file; only the confidence changes, never a drafted token. This is what calibrating
     an export applies (`offset=False`: temperatures only); without an export the file
     alone is written, from the temperature-only fit.
4. On the evaluation split: per-position ECE, Brier score and AUROC before (T = 1) and
   after, of the conditional c_k and of the survival, the pooled conditional calibration
   of the acceptance report, for the applied fit (`after`) and for the temperature-only
   fit (`after_temperature_only`).
`calibrate_draft` writes OUT/sts_calibration.json (validated by loading it with SGLang's
own loader), calibration.json (the full report) and sts_data.pt (the recorded steps);
with an export it also copies the file into the export and adds the offset to its
confidence bias. `calibrate_export` is what `export.calibrate_prompts` runs after
training; `python -m evaluation.calibrate` adds calibration.md and calibration.png.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

from specforge_dspark.decoding.calibration_metrics import (
    calibration_summary,
    survival_calibration,
)
from specforge_dspark.decoding.profile import write_profile
from specforge_dspark.decoding.prompts import answer_text, load_conversations, render
from specforge_dspark.decoding.spec_decode import Step, speculative_generate
from specforge_dspark.decoding.sts import (
    STS_FILE,
    check_export_dir,
    copy_into_export,
    shift_confidence_bias,
    validate_sts_file,
    write_sts_file,
)

T_MIN, T_MAX = 0.02, 50.0


def _survival_NG(z_NG: torch.Tensor, temps_G: torch.Tensor) -> torch.Tensor:
    return torch.cumprod(torch.sigmoid(z_NG / temps_G), dim=1)


def fit_sts(z_NG: torch.Tensor, n_N: torch.Tensor) -> list[float]:
    """Sequential per-position temperatures (step 3 of the module docstring).

    z_NG: raw confidence logits of N verify steps; n_N: accepted drafts of each step.
    Position k is fit on the steps that reached it (n >= k) with label n > k: the BCE of
    sigmoid(z_k / T_k) is convex in 1/T_k, so a grid over log T in [T_MIN, T_MAX] and a
    golden-section refinement find its minimum (at a bound when the labels are one
    class). A position no step reached keeps T = 1.
    """
    z = z_NG.double()
    temps: list[float] = []
    for k in range(z.shape[1]):
        reached = n_N >= k
        x_M, y_M = z[reached, k], (n_N[reached] > k).double()
        if y_M.numel() == 0:
            temps.append(1.0)
            continue

        def loss(log_t: float, x_M=x_M, y_M=y_M) -> float:
            return float(
                torch.nn.functional.binary_cross_entropy_with_logits(x_M / math.exp(log_t), y_M)
            )

        grid = torch.linspace(math.log(T_MIN), math.log(T_MAX), 121).tolist()
        i = min(range(len(grid)), key=lambda j: loss(grid[j]))
        lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
        g = (math.sqrt(5) - 1) / 2
        for _ in range(40):
            a, b = hi - g * (hi - lo), lo + g * (hi - lo)
            if loss(a) < loss(b):
                hi = b
            else:
                lo = a
        temps.append(math.exp((lo + hi) / 2))
    return temps


def fit_sts_offset(z_NG: torch.Tensor, n_N: torch.Tensor) -> tuple[list[float], float]:
    """Temperatures T_k and one shared logit offset d (step 3 of the module docstring):
    minimise the mean BCE of sigmoid((z_k + d) / T_k) over every (step, k) pair with
    n >= k, label n > k, by L-BFGS on (log T, d) from (0, 0). Temperatures are clamped to
    [T_MIN, T_MAX]; a position no step reached keeps T = 1 (no gradient reaches it).
    """
    z = z_NG.double()
    G = z.shape[1]
    k_G = torch.arange(G)
    pairs_NG = k_G[None] <= n_N[:, None]
    y_NG = (k_G[None] < n_N[:, None]).double()
    if not bool(pairs_NG.any()):
        return [1.0] * G, 0.0
    params = torch.zeros(G + 1, dtype=torch.float64, requires_grad=True)  # log T_k, d
    opt = torch.optim.LBFGS([params], max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        log_t = params[:G].clamp(math.log(T_MIN), math.log(T_MAX))
        logit_NG = (z + params[G]) * torch.exp(-log_t)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            logit_NG[pairs_NG], y_NG[pairs_NG]
        )
        loss.backward()
        return loss

    opt.step(closure)
    p = params.detach()
    temps = p[:G].clamp(math.log(T_MIN), math.log(T_MAX)).exp().tolist()
    return temps, float(p[G])


def _arrays(steps: list[Step]) -> tuple[torch.Tensor, torch.Tensor]:
    steps = [s for s in steps if s.confidence_logits]
    G = len(steps[0].confidence_logits) if steps else 0
    z = torch.tensor([s.confidence_logits for s in steps], dtype=torch.float64).reshape(-1, G)
    return z, torch.tensor([s.accepted for s in steps], dtype=torch.long)


def _conditional(z_NG: torch.Tensor, n_N: torch.Tensor, temps: list[float]) -> dict:
    """The acceptance report's pooled conditional calibration (slots k <= n) at
    temperatures `temps`."""
    c = torch.sigmoid(z_NG / torch.tensor(temps, dtype=torch.float64))
    conf, label = [], []
    for row, n in zip(c.tolist(), n_N.tolist(), strict=True):
        for k in range(min(n + 1, len(row))):
            conf.append(row[k])
            label.append(int(k < n))
    return calibration_summary(conf, label)


def evaluate_sts(
    z_NG: torch.Tensor, n_N: torch.Tensor, temps: list[float], shift: float = 0.0
) -> dict:
    """Calibration of sigmoid((z_k + shift) / T_k): `per_position` (conditional, on the
    steps that reached k, against n > k; what the fit minimises, and the STS file's ECE),
    `survival` (per position, s_k against n > k on every step) and `conditional` (pooled
    over positions, the acceptance report's figure)."""
    t_G = torch.tensor(temps, dtype=torch.float64)
    z_NG = z_NG + shift
    c_NG = torch.sigmoid(z_NG / t_G)
    per_position = []
    for k in range(z_NG.shape[1]):
        reached = n_N >= k
        per_position.append(
            calibration_summary(c_NG[reached, k].tolist(), (n_N[reached] > k).long().tolist())
        )
    surv = _survival_NG(z_NG, t_G).tolist()
    return {
        "per_position": per_position,
        "survival": survival_calibration(surv, n_N.tolist()),
        "conditional": _conditional(z_NG, n_N, temps),
    }


def collect_steps(
    target,
    drafter,
    workloads: list,
    num_prompts: int,
    max_new_tokens: int,
    embed_fn: Callable,
    logits_fn: Callable,
    temperature: float = 0.0,
    seed: int = 0,
    held_by_workload: dict[str, list[Step]] | None = None,
) -> tuple[list[Step], list[Step]]:
    """Decode every conversation (all drafts verified); returns (fit steps, eval steps);
    `held_by_workload` (when given) receives the eval steps per workload name."""
    gen = torch.Generator().manual_seed(seed)
    split: tuple[list[Step], list[Step]] = ([], [])
    for workload in workloads:
        for conv in load_conversations(workload, num_prompts):
            messages: list[dict] = []
            for text in conv.turns:
                messages.append({"role": "user", "content": text})
                ids = render(target.tokenizer, messages)
                g = speculative_generate(
                    target,
                    drafter,
                    ids,
                    max_new_tokens,
                    embed_fn,
                    logits_fn,
                    temperature=temperature,
                    generator=gen,
                )
                split[conv.index % 2].extend(g.steps)
                if held_by_workload is not None and conv.index % 2:
                    held_by_workload.setdefault(workload.name, []).extend(g.steps)
                answer = answer_text(target.tokenizer, g.tokens, target.eos_ids)
                messages.append({"role": "assistant", "content": answer})
    return split


def save_recorded(path: Path, z_fit, n_fit, z_eval, n_eval) -> None:
    """The recorded steps in SGLang's StsDataRecorder layout (float32 `logits` [N, G],
    `prefix_mask` [N, G] = k < accepted), per split, so a fit can be redone offline."""
    G = z_fit.shape[1]

    def shard(z, n):
        mask = (torch.arange(G)[None] < n[:, None]).float()
        return {"logits": z.float(), "prefix_mask": mask}

    torch.save({"fit": shard(z_fit, n_fit), "eval": shard(z_eval, n_eval)}, path)


def position_eces(report: dict) -> list[float]:
    """Per-position conditional ECE of an `evaluate_sts` report (0.0 where no step
    reached the position): the STS file's ece_before / ece_after."""
    return [0.0 if p["ece"] is None else p["ece"] for p in report["per_position"]]


def calibrate_draft(
    target_path: str | Path,
    draft: str | Path,
    workloads: list[str],
    num_prompts: int,
    max_new_tokens: int,
    out_dir: str | Path,
    export_dir: str | Path | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    data_dir: str | Path | None = None,
    device: str = "cpu",
    log: Callable[[str], None] = print,
    offset: bool = True,
) -> dict:
    """Fit STS on held-out prompts and write OUT/sts_calibration.json, calibration.json
    and sts_data.pt; with `export_dir` also calibrate that export in place (and, with
    `offset`, shift its confidence bias). Returns the report (module docstring)."""
    from specforge_dspark.decoding.loading import check_pair, head_fns, load_drafter
    from specforge_dspark.decoding.prompts import parse_workload
    from specforge_dspark.decoding.sampling import SamplingTarget
    from specforge_dspark.objective.frozen_head import load_frozen_head

    if num_prompts < 2:
        raise ValueError(f"--num-prompts must be >= 2 (a fit and an eval split), got {num_prompts}")
    if export_dir is not None:  # before minutes of decoding
        check_export_dir(Path(export_dir), Path(draft), offset)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parsed = [parse_workload(w, Path(data_dir) if data_dir else None) for w in workloads]
    drafter = load_drafter(draft, device, torch.float32)
    if getattr(drafter, "confidence_head", None) is None:
        raise ValueError(f"--draft {draft}: the drafter has no confidence head to calibrate")
    G = int(drafter.config.block_size)
    target = SamplingTarget.load(target_path, list(drafter.config.target_layer_ids), device=device)
    check_pair(drafter, target)
    embed_fn, logits_fn = head_fns(load_frozen_head(target_path, device=device))
    by_workload: dict[str, list[Step]] = {}
    fit, held = collect_steps(
        target, drafter, parsed, num_prompts, max_new_tokens, embed_fn, logits_fn, temperature,
        seed, by_workload,
    )  # fmt: skip
    z_fit, n_fit = _arrays(fit)
    z_eval, n_eval = _arrays(held)
    save_recorded(out / "sts_data.pt", z_fit, n_fit, z_eval, n_eval)
    temps_only = fit_sts(z_fit, n_fit)
    before = evaluate_sts(z_eval, n_eval, [1.0] * G)
    after_temps_only = evaluate_sts(z_eval, n_eval, temps_only)
    temps, shift = temps_only, 0.0
    if offset and export_dir is not None:
        temps, shift = fit_sts_offset(z_fit, n_fit)
    after = evaluate_sts(z_eval, n_eval, temps, shift)
    dataset = ",".join(w.name for w in parsed)
    sts_path = out / STS_FILE
    eces = position_eces(before), position_eces(after)
    write_sts_file(sts_path, temps, dataset, len(n_fit), *eces)
    if validate_sts_file(sts_path, G) != temps:
        raise RuntimeError(f"{sts_path}: SGLang's loader read other temperatures")
    report = {
        "target": str(target_path),
        "draft": str(draft),
        "block_size": G,
        "workloads": [w.name for w in parsed],
        "num_prompts": num_prompts,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "fit_steps": len(n_fit),
        "eval_steps": len(n_eval),
        "temperatures": temps,
        "bias_shift": shift,
        "temperatures_only": temps_only,
        "before": before,
        "after": after,
        "after_temperature_only": after_temps_only,
        "sts_file": str(sts_path),
    }
    if export_dir is not None:
        report["export_sts_file"] = str(copy_into_export(sts_path, Path(export_dir)))
        how = {"target": str(target_path), "prompts_per_workload": num_prompts // 2,
               "max_new_tokens": max_new_tokens, "temperature": temperature}  # fmt: skip
        report["export_profile"] = str(write_profile(Path(export_dir), by_workload, G, how))
        if shift:
            report["export_bias_shift_total"] = shift_confidence_bias(Path(export_dir), shift)
    (out / "calibration.json").write_text(json.dumps(report, indent=1))
    pooled_b, pooled_a = before["conditional"]["ece"], after["conditional"]["ece"]
    pooled_t = after_temps_only["conditional"]["ece"]
    log(
        f"STS temperatures {[round(t, 3) for t in temps]}, confidence bias shift {shift:+.3f}; "
        f"held-out ECE per position {_fmt_eces(before)} -> {_fmt_eces(after)}; "
        f"conditional ECE {_fmt(pooled_b)} -> {_fmt(pooled_a)} "
        f"(temperatures only: {_fmt(pooled_t)}; {len(n_fit)} fit / {len(n_eval)} eval steps) "
        f"-> {sts_path}"
    )
    return report


def calibrate_export(
    target_path: str | Path,
    export_dir: str | Path,
    workloads: list[str] | tuple[str, ...] = ("gsm8k", "mt_bench"),
    num_prompts: int = 8,
    max_new_tokens: int = 64,
    out_dir: str | Path | None = None,
    **options,
) -> dict:
    """Calibrate an SGLang-layout export in place: EXPORT/sts_calibration.json (and, with
    `offset`, its confidence bias), the report in `out_dir` (default EXPORT/../calibration;
    calibration.json, without the markdown and plot of `python -m evaluation.calibrate`).
    `options`: `calibrate_draft`'s keywords (temperature, seed, data_dir, device, log,
    offset)."""
    export_dir = Path(export_dir)
    out = Path(out_dir) if out_dir is not None else export_dir.parent / "calibration"
    return calibrate_draft(
        target_path,
        export_dir,
        list(workloads),
        num_prompts,
        max_new_tokens,
        out,
        export_dir=export_dir,
        **options,
    )


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _fmt_eces(report: dict) -> str:
    """Per-position ECE; n/a where no held-out step reached the position."""
    return "[" + ", ".join(_fmt(p["ece"]) for p in report["per_position"]) + "]"
