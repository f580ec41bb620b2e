"""Sequential temperature scaling (STS) of the DSpark confidence head, for SGLang.

    python -m evaluation.calibrate --target T --draft EXPORT --workloads gsm8k,mt_bench \
        --num-prompts 16 --max-new-tokens 64 --out DIR [--export EXPORT]

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
     d is added to the export's `confidence_head.proj.bias` (the head is one linear
     layer) and the T_k are the STS file; only the confidence changes, never a drafted
     token. This is what --export applies (`--no-offset`: temperatures only); without
     --export the file alone is written, from the temperature-only fit.
4. On the evaluation split: per-position ECE, Brier score and AUROC before (T = 1) and
   after, of the conditional c_k and of the survival, the pooled conditional calibration
   of metrics.py, for the applied fit (`after`) and for the temperature-only fit
   (`after_temperature_only`).
Writes DIR/sts_calibration.json (a `DSparkStsCalibration`, validated by loading it with
SGLang's own loader; serve with `--speculative-dspark-confidence-sts-path`),
calibration.json (the full report), calibration.md and calibration.png; --export also
copies the JSON into that export directory and adds the offset to its confidence bias
(recorded in the safetensors metadata as `confidence_bias_shift`, accumulated over
repeated calibrations).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from evaluation.metrics import calibration_summary, survival_calibration
from specforge_dspark.decoding.spec_decode import Step, speculative_generate

STS_FILE = "sts_calibration.json"
T_MIN, T_MAX = 0.02, 50.0


BIAS_KEY = "confidence_head.proj.bias"
SHIFT_META = "confidence_bias_shift"


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
    """metrics.py's pooled conditional calibration (slots k <= n) at temperatures `temps`."""
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


def read_bias_shift(export_dir: str | Path) -> float:
    """The confidence-bias offset calibrations have added to an export (0.0 if none)."""
    from safetensors import safe_open

    with safe_open(str(Path(export_dir) / "model.safetensors"), "pt") as f:
        return float((f.metadata() or {}).get(SHIFT_META, 0.0))


def _check_same_head(draft: Path, export_dir: Path) -> None:
    """The offset is fit on `draft`'s logits: `export_dir` must hold the same head."""
    from safetensors import safe_open

    if draft.resolve() == export_dir.resolve():
        return
    heads = []
    for d in (draft, export_dir):
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            heads.append([f.get_tensor(k) for k in (BIAS_KEY, "confidence_head.proj.weight")])
    if not all(torch.equal(a, b) for a, b in zip(*heads, strict=True)):
        raise ValueError(
            f"--export {export_dir}: its confidence head differs from --draft {draft}'s; the "
            "bias offset fit on one cannot be applied to the other (use --no-offset)"
        )


def shift_confidence_bias(export_dir: Path, shift: float) -> float:
    """Add `shift` to EXPORT/model.safetensors' confidence bias (atomic rewrite, other
    tensors byte-identical); returns the accumulated shift now recorded in its metadata."""
    from safetensors.torch import load_file, save_file

    path = Path(export_dir) / "model.safetensors"
    tensors = load_file(str(path))
    if BIAS_KEY not in tensors:
        raise ValueError(f"{path}: no {BIAS_KEY} to shift (export without a confidence bias)")
    total = read_bias_shift(export_dir) + shift
    tensors[BIAS_KEY] = tensors[BIAS_KEY] + torch.tensor(shift, dtype=tensors[BIAS_KEY].dtype)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt", SHIFT_META: repr(total)})
    tmp.replace(path)
    return total


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
) -> tuple[list[Step], list[Step]]:
    """Decode every conversation (all drafts verified); returns (fit steps, eval steps)."""
    from evaluation.acceptance import _answer_text
    from specforge_dspark.decoding.prompts import load_conversations, render

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
                answer = _answer_text(target.tokenizer, g.tokens, target.eos_ids)
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


def validate_sts_file(path: Path, block_size: int) -> list[float]:
    """Load the file with SGLang's own DSparkStsCalibration loader (what the server
    does) and check the planner's gamma rule; returns its temperatures."""
    from sglang.srt.speculative.dspark_components.dspark_sts import (
        load_sts_calibration_from_path,
    )

    cal = load_sts_calibration_from_path(str(path))
    if len(cal.temperatures) != block_size:
        raise ValueError(f"{path}: {len(cal.temperatures)} temperatures for gamma {block_size}")
    return list(cal.temperatures)


def write_sts_file(path: Path, temps: list[float], dataset: str, num_samples: int, before, after):
    from sglang.srt.speculative.dspark_components.dspark_sts import DSparkStsCalibration

    cal = DSparkStsCalibration(
        temperatures=[float(t) for t in temps],
        dataset=dataset,
        num_samples=int(num_samples),
        ece_before=[float(x) for x in before],
        ece_after=[float(x) for x in after],
    )
    tmp = path.with_suffix(".tmp")
    tmp.write_text(cal.to_json())
    tmp.replace(path)


def copy_into_export(sts_path: Path, export_dir: Path) -> Path:
    """Put the calibration beside an export's config.json (atomic)."""
    export_dir = Path(export_dir)
    if not (export_dir / "config.json").is_file():
        raise ValueError(f"--export {export_dir}: not an export directory (no config.json)")
    dest = export_dir / STS_FILE
    tmp = dest.with_suffix(".tmp")
    shutil.copyfile(sts_path, tmp)
    tmp.replace(dest)
    return dest


def _ece_list(report: dict) -> list[float]:
    return [0.0 if p["ece"] is None else p["ece"] for p in report["per_position"]]


def calibrate(
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
    """Fit STS on held-out prompts and write DIR/sts_calibration.json; with `export_dir`
    also calibrate that export in place (and, with `offset`, shift its confidence bias).
    Returns the report."""
    from evaluation.acceptance import check_pair, head_fns, load_drafter
    from specforge_dspark.decoding.prompts import parse_workload
    from specforge_dspark.decoding.sampling import SamplingTarget
    from specforge_dspark.frozen_head import load_frozen_head

    if num_prompts < 2:
        raise ValueError(f"--num-prompts must be >= 2 (a fit and an eval split), got {num_prompts}")
    if export_dir is not None:  # before minutes of decoding
        for name in ("config.json", "model.safetensors"):
            if not (Path(export_dir) / name).is_file():
                raise ValueError(f"--export {export_dir}: not an export directory (no {name})")
        if offset:
            _check_same_head(Path(draft), Path(export_dir))
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
    fit, held = collect_steps(
        target, drafter, parsed, num_prompts, max_new_tokens, embed_fn, logits_fn, temperature, seed
    )
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
    write_sts_file(sts_path, temps, dataset, len(n_fit), _ece_list(before), _ece_list(after))
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
        if shift:
            report["export_bias_shift_total"] = shift_confidence_bias(Path(export_dir), shift)
    (out / "calibration.json").write_text(json.dumps(report, indent=1))
    write_markdown(report, out / "calibration.md")
    write_plot(report, out / "calibration.png")
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
    temperature: float = 0.0,
    seed: int = 0,
    data_dir: str | Path | None = None,
    device: str = "cpu",
    log: Callable[[str], None] = print,
    offset: bool = True,
) -> dict:
    """Calibrate an SGLang-layout export in place: EXPORT/sts_calibration.json (and, with
    `offset`, its confidence bias), the report in `out_dir` (default EXPORT/../calibration)."""
    export_dir = Path(export_dir)
    out = Path(out_dir) if out_dir is not None else export_dir.parent / "calibration"
    return calibrate(
        target_path,
        export_dir,
        list(workloads),
        num_prompts,
        max_new_tokens,
        out,
        export_dir=export_dir,
        temperature=temperature,
        seed=seed,
        data_dir=data_dir,
        device=device,
        log=log,
        offset=offset,
    )


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _fmt_eces(report: dict) -> str:
    """Per-position ECE; n/a where no held-out step reached the position."""
    return "[" + ", ".join(_fmt(p["ece"]) for p in report["per_position"]) + "]"


def _fmt_list(xs: list[float]) -> str:
    return "[" + ", ".join(f"{x:.3f}" for x in xs) + "]"


def write_markdown(report: dict, path: Path) -> None:
    G = report["block_size"]
    lines = [
        "# DSpark confidence calibration (sequential temperature scaling)",
        "",
        f"- draft `{report['draft']}`, target `{report['target']}`, workloads "
        f"{', '.join(report['workloads'])}, {report['num_prompts']} prompts each, "
        f"max {report['max_new_tokens']} new tokens, temperature {report['temperature']}",
        f"- fit on {report['fit_steps']} verify steps (even conversations), evaluated on "
        f"{report['eval_steps']} held-out steps (odd conversations)",
        f"- temperatures: {_fmt_list(report['temperatures'])} -> `{report['sts_file']}`; "
        f"confidence bias shift {report['bias_shift']:+.4f} (added to the export's "
        f"`{BIAS_KEY}`)",
        f"- temperatures-only fit: {_fmt_list(report['temperatures_only'])}, held-out pooled "
        f"conditional ECE {_fmt(report['after_temperature_only']['conditional']['ece'])}",
    ]
    for key, title in (
        ("per_position", "conditional c_k = sigmoid(z_k / T_k) on steps that reached k"),
        ("survival", "survival s_k = prod_{i<=k} c_i on every step (what the budget ranks)"),
    ):
        lines += [
            "",
            f"Held-out, {title}, against draft k accepted:",
            "",
            "| position | steps | ECE before | ECE after | Brier before | Brier after "
            "| AUROC before | AUROC after | P(accepted) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for k in range(G):
            b, a = report["before"][key][k], report["after"][key][k]
            lines.append(
                f"| {k} | {b['pairs']} | {_fmt(b['ece'])} | {_fmt(a['ece'])} "
                f"| {_fmt(b['brier'])} | {_fmt(a['brier'])} | {_fmt(b['auroc'])} "
                f"| {_fmt(a['auroc'])} | {_fmt(b['acceptance'])} |"
            )
    cb, ca = report["before"]["conditional"], report["after"]["conditional"]
    lines += [
        "",
        f"Pooled conditional calibration (slots the verifier judged, as in the acceptance "
        f"report): ECE {_fmt(cb['ece'])} -> {_fmt(ca['ece'])}, Brier {_fmt(cb['brier'])} -> "
        f"{_fmt(ca['brier'])}, AUROC {_fmt(cb['auroc'])} -> {_fmt(ca['auroc'])}.",
        "",
        "![calibration](calibration.png)",
        "",
    ]
    path.write_text("\n".join(lines))


def write_plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.5))
    ax1.plot([0, 1], [0, 1], color="grey", lw=1)
    for name, style in (("before", "o--"), ("after_temperature_only", "s:"), ("after", "o-")):
        bins = report[name]["conditional"]["bins"]
        ax1.plot(
            [b["confidence"] for b in bins],
            [b["accepted"] for b in bins],
            style,
            label=f"{name} (ECE {_fmt(report[name]['conditional']['ece'])})",
        )
    ax1.set(
        xlabel="confidence sigmoid(z_k / T_k)",
        ylabel="observed acceptance",
        xlim=(0, 1),
        ylim=(0, 1),
        title="Reliability, held-out (conditional)",
    )
    ax1.legend(fontsize=8)
    G = report["block_size"]
    width = 0.4
    for i, name in enumerate(("before", "after")):
        eces = _ece_list(report[name])
        ax2.bar([k + (i - 0.5) * width for k in range(G)], eces, width, label=name)
    ax2.set(xlabel="position k", ylabel="ECE of c_k", title="Per-position ECE, held-out")
    ax2.set_xticks(range(G))
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True, help="SGLang-layout export directory")
    ap.add_argument("--workloads", default="gsm8k,mt_bench")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument(
        "--export",
        type=Path,
        default=None,
        help="calibrate this export in place: copy the file here and shift its confidence bias",
    )
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--no-offset",
        action="store_true",
        help="with --export: temperatures only, leave the export's confidence bias as it is",
    )
    a = ap.parse_args(argv)
    calibrate(
        a.target,
        a.draft,
        [w for w in a.workloads.split(",") if w.strip()],
        a.num_prompts,
        a.max_new_tokens,
        a.out,
        a.export,
        a.temperature,
        a.seed,
        a.data_dir,
        a.device,
        offset=not a.no_offset,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
