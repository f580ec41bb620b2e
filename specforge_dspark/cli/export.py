"""The export command line: `python -m specforge_dspark.cli.export` (see the
specforge_dspark.export docstring); export/dispatch.py picks the drafter kind's export."""

from __future__ import annotations

import sys

from specforge_dspark.config.command_line import command_parser
from specforge_dspark.export.dispatch import export_checkpoint
from specforge_dspark.export.dspark import FORMATS
from specforge_dspark.export.speculators import SPECULATORS_VOCABS


def main(argv: list[str] | None = None) -> int:
    parser = command_parser(
        "specforge_dspark.cli.export",
        "Export a DSpark draft checkpoint for SGLang or vLLM (speculators).",
        (
            "python -m specforge_dspark.cli.export --checkpoint runs/demo/ckpt/step-1500 "
            "--format sglang --out runs/demo/export/sglang"
        ),
    )
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="step-N checkpoint, a checkpoint root (latest complete), or an SGLang export",
    )
    parser.add_argument("--format", required=True, choices=FORMATS)
    parser.add_argument(
        "--out",
        required=True,
        help="output directory: new, empty, or an earlier export (replaced whole)",
    )
    parser.add_argument(
        "--target", default=None, help="target model directory (default: recipe target.path)"
    )
    parser.add_argument(
        "--verifier-name",
        default=None,
        help="verifier recorded in the speculators config (default: export.verifier_name, "
        "else the target's absolute path)",
    )
    parser.add_argument(
        "--speculators-vocab",
        default=None,
        choices=SPECULATORS_VOCABS,
        help="speculators draft vocabulary: full (every LM-head row, no t2d/d2t) or reduced "
        "(logical vocab + t2d/d2t, for vLLM builds without the full-vocab identity map); "
        "default: export.speculators_vocab, else full",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=("bfloat16", "float32"),
        help="weights as written (default: the checkpoint's export.dtype, else bfloat16)",
    )
    args = parser.parse_args(argv)
    if args.speculators_vocab and args.format != "speculators":
        print(f"warning: --speculators-vocab is ignored by --format {args.format}", file=sys.stderr)
    try:
        out = export_checkpoint(
            args.checkpoint,
            args.format,
            args.out,
            args.target,
            args.verifier_name,
            args.speculators_vocab,
            args.dtype,
        )
    except ValueError as e:  # ExportError, RecipeError, bad config.json
        print(f"export failed: {e}", file=sys.stderr)
        return 2
    print(f"{args.format} export written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
