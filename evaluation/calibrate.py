"""Sequential temperature scaling (STS) of the DSpark confidence head, for SGLang.

    python -m evaluation.calibrate --target T --draft EXPORT --workloads gsm8k,mt_bench \
        --num-prompts 16 --max-new-tokens 64 --out DIR [--export EXPORT]

Real speculative decoding (every draft verified) of held-out prompts, a fit on half of
the conversations and a report on the other half (the method:
specforge_dspark/decoding/calibration.py). Without --export the temperature-only fit
goes to the file; --export fits temperatures and one shared logit offset and applies
both to that export (`--no-offset`: temperatures only).
Writes DIR/sts_calibration.json (a `DSparkStsCalibration`, validated by loading it with
SGLang's own loader; serve with `--speculative-dspark-confidence-sts-path`),
calibration.json (the full report), calibration.md and calibration.png; --export also
copies the JSON into that export directory and adds the offset to its confidence bias
(recorded in the safetensors metadata as `confidence_bias_shift`, accumulated over
repeated calibrations).
"""

from __future__ import annotations

from pathlib import Path

from evaluation.report import reliability
from specforge_dspark.config.command_line import command_parser
from specforge_dspark.decoding.calibration import calibrate_draft, position_eces
from specforge_dspark.decoding.sts import BIAS_KEY


def calibrate(
    target_path: str | Path,
    draft: str | Path,
    workloads: list[str],
    num_prompts: int,
    max_new_tokens: int,
    out_dir: str | Path,
    **options,
) -> dict:
    """`decoding.calibration.calibrate_draft` (the fit, the STS file, calibration.json,
    the export calibrated in place; `options` as there) plus DIR/calibration.md and
    calibration.png."""
    report = calibrate_draft(
        target_path, draft, workloads, num_prompts, max_new_tokens, out_dir, **options
    )
    write_markdown(report, Path(out_dir) / "calibration.md")
    write_plot(report, Path(out_dir) / "calibration.png")
    return report


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


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
    styles = (("before", "o--"), ("after_temperature_only", "s:"), ("after", "o-"))
    curves = [(name, style, report[name]["conditional"]) for name, style in styles]
    reliability(ax1, curves, "confidence sigmoid(z_k / T_k)", "Reliability, held-out (conditional)")
    G = report["block_size"]
    width = 0.4
    for i, name in enumerate(("before", "after")):
        eces = position_eces(report[name])
        ax2.bar([k + (i - 0.5) * width for k in range(G)], eces, width, label=name)
    ax2.set(xlabel="position k", ylabel="ECE of c_k", title="Per-position ECE, held-out")
    ax2.set_xticks(range(G))
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = command_parser(
        "evaluation.calibrate",
        __doc__.split("\n\n")[0],
        (
            "python -m evaluation.calibrate --target .cache/tiny_target "
            "--draft runs/demo/export/sglang --out runs/calibration"
        ),
    )
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
