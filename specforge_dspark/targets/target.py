"""Build the small targets used on CPU (tests, demo): Inkling, and Qwen3 beside it.

    python -m specforge_dspark.targets --out .cache/tiny_target
    python -m specforge_dspark.targets --arch qwen3 --out .cache/tiny_qwen3

The result is saved exactly like a real checkpoint (config.json, model.safetensors,
tokenizer files with a chat template), so every code path loads the target from a
path. The default uses transformers' own `InklingForCausalLM` (hybrid sliding/full
attention, short convolutions, MoE, muP logits multiplier, padded LM head) at a tiny
size; `arch="qwen3"` builds a `Qwen3ForCausalLM` of the same width and depth (the
architecture SGLang's CPU engine serves, see engines/sglang.py).

Both use a byte-level BPE trained offline on ../shared/data text and a seeded causal-LM
pre-training (cosine schedule) on chat-rendered GSM8K, ShareGPT, MATH and HumanEval
rows that the evaluation never uses (see `corpus`). The build measures and writes to
`build_info.json`:
  - `heldout_loss`: nats/token on GSM8K test answers and held-out ShareGPT turns;
  - `loop_rate`: the share of greedy 128-token continuations of the evaluation prompts
    that loop (`loops`: the last 48 tokens periodic with a period <= 8).
Building is cached (store.py): a folder holding a `.build_key` equal to this builder's key
(its settings, the builder's sources and the data files' contents) is reused as it is.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import time
from pathlib import Path

import torch

from specforge_dspark.targets.corpus import corpus, data_files
from specforge_dspark.targets.model import make_config, train_tokenizer
from specforge_dspark.targets.pretrain import (
    PRETRAIN_STEPS,
    greedy_loop_rate,
    heldout_loss,
    pretrain,
)
from specforge_dspark.targets.store import cached

BUILD_VERSION = 4
ARCHS = ("inkling", "qwen3")
BUILDER = ("corpus.py", "model.py", "pretrain.py", "target.py")
"""The modules a tiny build runs: a change to one of them builds the targets anew."""


def build_key(settings: dict) -> str:
    """Settings plus the builder's sources (BUILDER) and the data files' bytes (v4 on)."""
    if settings.get("arch") == "inkling":  # keys of Inkling builds predate the field
        settings = {k: v for k, v in settings.items() if k != "arch"}
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    if settings.get("version", 0) >= 4:
        for name in BUILDER:
            h.update((Path(__file__).parent / name).read_bytes())
        for f in data_files():
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def build(
    out: Path,
    vocab: int = 1024,
    arch: str = "inkling",
    hidden: int = 128,
    layers: int = 4,
    pretrain_steps: int | None = None,
    seed: int = 0,
    force: bool = False,
    log=print,
) -> Path:
    """Build (or reuse) the tiny target at `out`; returns `out`."""
    if arch not in ARCHS:
        raise ValueError(f"tiny target: arch must be one of {ARCHS}, got {arch!r}")
    settings = {
        "version": BUILD_VERSION,
        "arch": arch,
        "vocab": vocab,
        "hidden": hidden,
        "layers": layers,
        "pretrain_steps": PRETRAIN_STEPS[arch] if pretrain_steps is None else pretrain_steps,
        "seed": seed,
    }
    key = build_key(settings)
    make = lambda o: _build_into(o, settings, key, log)  # noqa: E731
    return cached(out, arch, key, make, force, log, label="tiny target")


def _build_into(out: Path, settings: dict, key: str, log) -> None:
    from transformers import AutoModelForCausalLM

    vocab, hidden, layers = settings["vocab"], settings["hidden"], settings["layers"]
    pretrain_steps, seed = settings["pretrain_steps"], settings["seed"]

    log(f"tiny target: building {out} ({settings})")
    t0 = time.time()
    random.seed(seed)
    torch.manual_seed(seed)
    convs, heldout = corpus()
    tmp = out.with_name(out.name + ".tmp")
    pretrained = tmp / ".pretrained_key"  # a finished pre-training is not redone
    if pretrained.is_file() and pretrained.read_text() == key:
        from transformers import AutoTokenizer

        log(f"tiny target: reusing the finished pre-training in {tmp}")
        model = AutoModelForCausalLM.from_pretrained(tmp).eval()
        tokenizer = AutoTokenizer.from_pretrained(tmp)
        losses = json.loads((tmp / "pretrain_losses.json").read_text())
    else:
        texts = [m["content"] for c in convs for m in c]
        tokenizer = train_tokenizer(texts, vocab)
        cfg = make_config(tokenizer, hidden, layers, settings["arch"])
        model = AutoModelForCausalLM.from_config(cfg)
        losses = pretrain(model, tokenizer, convs, pretrain_steps, seed, log)
        model.generation_config.eos_token_id = [
            cfg.eos_token_id,
            tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        ]
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.do_sample = False
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "pretrain_losses.json").write_text(json.dumps(losses))
        pretrained.write_text(key)
    t_train = time.time() - t0

    held = heldout_loss(model, tokenizer, heldout)
    log(f"tiny target: held-out loss {held} (nats/token)")
    if settings["arch"] == "inkling":
        looping = greedy_loop_rate(model, tokenizer)
        per = ", ".join(f"{w} {r:.2f}" for w, r in looping["per_workload"].items())
        log(f"tiny target: greedy loop rate {looping['loop_rate']:.3f} ({per})")
    else:  # the Qwen3 target serves SGLang tests; its text is not what they measure
        looping = {"loop_rate": None, "per_workload": None, "continuations": []}
    (tmp / "build_info.json").write_text(
        json.dumps(
            {
                "settings": settings,
                "key": key,
                "pretrain_losses": losses[:: max(1, len(losses) // 20)],
                "final_pretrain_loss": round(sum(losses[-20:]) / max(1, len(losses[-20:])), 4)
                if losses
                else None,
                "heldout_loss": held,
                "loop_rate": looping["loop_rate"],
                "loop_rate_per_workload": looping["per_workload"],
                "loop_definition": "last 48 of 128 greedy tokens periodic with period <= 8",
                "continuations": looping["continuations"],
                "seconds": {"pretrain": round(t_train, 1), "total": round(time.time() - t0, 1)},
                "mask_token_id": tokenizer.mask_token_id,
                "tokenizer_size": len(tokenizer),
            },
            indent=1,
        )
    )
    (tmp / ".build_key").write_text(key)
    pretrained.unlink()
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"tiny target: saved to {out} ({time.time() - t0:.0f} s)")
