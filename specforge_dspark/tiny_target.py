"""Build the small targets used on CPU (tests, demo): Inkling, and Qwen3 beside it.

    python -m specforge_dspark.tiny_target --out .cache/tiny_target
    python -m specforge_dspark.tiny_target --arch qwen3 --out .cache/tiny_qwen3

The result is saved exactly like a real checkpoint (config.json, model.safetensors,
tokenizer files with a chat template), so every code path loads the target from a
path. The default uses transformers' own `InklingForCausalLM` (hybrid sliding/full
attention, short convolutions, MoE, muP logits multiplier, padded LM head) at a tiny
size; `arch="qwen3"` builds a `Qwen3ForCausalLM` of the same width and depth (the
architecture SGLang's CPU engine serves, see engines/sglang.py). Both use a
byte-level BPE trained offline on ../shared/data text, and a brief seeded pre-training
on that text so that its greedy continuations are text-like. Building is cached: a
folder holding a `.build_key` equal to this builder's key is reused as it is.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import random
import shutil
import time
from pathlib import Path

import torch

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
BUILD_VERSION = 3
ARCHS = ("inkling", "qwen3")

SPECIAL_TOKENS = [
    "<|pad|>",
    "<|bos|>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<|mask|>",
]

# ChatML-like template. Assistant turns may carry `reasoning_content` (rendered inside
# <think>) and `tool_calls`; `enable_thinking=false` closes an empty think block in the
# generation prompt (a chat-template kwarg, like real reasoning models have).
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' and m.get('reasoning_content') %}"
    "{{ '<think>' + m['reasoning_content'] + '</think>' }}"
    "{% endif %}"
    "{% if m['content'] is string %}{{ m['content'] }}{% endif %}"
    "{% if m['role'] == 'assistant' and m.get('tool_calls') %}"
    "{{ '<tool_call>' + (m['tool_calls'] | tojson) + '</tool_call>' }}"
    "{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think></think>' }}{% endif %}"
    "{% endif %}"
)


def build_key(settings: dict) -> str:
    if settings.get("arch") == "inkling":  # keys of Inkling builds predate the field
        settings = {k: v for k, v in settings.items() if k != "arch"}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def _corpus(limit: int = 4000) -> list[dict]:
    """Question/answer pairs and ShareGPT turns from ../shared/data, as chat messages."""
    rows: list[list[dict]] = []
    gsm = SHARED_DATA / "train" / "gsm8k_train.jsonl"
    with gsm.open() as f:
        for i, line in enumerate(f):
            if i >= limit:
                break
            r = json.loads(line)
            rows.append(
                [
                    {"role": "user", "content": r["question"]},
                    {"role": "assistant", "content": r["answer"]},
                ]
            )
    share = json.loads((SHARED_DATA / "train" / "sharegpt_sample.json").read_text())
    roles = {"human": "user", "gpt": "assistant"}
    for conv in share:
        msgs = [
            {"role": roles.get(t["from"], "user"), "content": t["value"]}
            for t in conv["conversations"]
        ]
        rows.append(msgs)
    return rows


def train_tokenizer(texts: list[str], vocab: int):
    """Byte-level BPE with our special tokens and chat template (offline, < 1 s)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        mask_token="<|mask|>",
        additional_special_tokens=SPECIAL_TOKENS[2:9],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    return fast


def make_config(tokenizer, hidden: int, layers: int, arch: str = "inkling"):
    from transformers.models.inkling import InklingTextConfig

    n_tok = len(tokenizer)
    padded = (n_tok // 64 + 1) * 64  # like Inkling: LM head rows > tokenizer entries
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if arch == "qwen3":
        return _qwen3_config(tokenizer, hidden, layers, padded, im_end)
    cfg = InklingTextConfig(
        vocab_size=padded,
        unpadded_vocab_size=n_tok,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=hidden // 4,
        sliding_window_size=128,
        d_rel=8,
        rel_extent=256,
        local_layer_ids=[i for i in range(layers) if i % 2 == 0],
        mlp_layer_types=["dense"] + ["sparse"] * (layers - 1),
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        logits_mup_width_multiplier=4.0,
        max_position_embeddings=4096,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=im_end,
        tie_word_embeddings=False,
    )
    cfg.architectures = ["InklingForCausalLM"]
    return cfg


def _qwen3_config(tokenizer, hidden: int, layers: int, padded: int, im_end: int):
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        vocab_size=padded,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        intermediate_size=2 * hidden,
        max_position_embeddings=4096,
        rope_theta=1e6,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=im_end,
        tie_word_embeddings=False,
    )
    cfg.architectures = ["Qwen3ForCausalLM"]
    return cfg


def pretrain(model, tokenizer, convs: list[list[dict]], steps: int, seed: int, log) -> list[float]:
    """A brief causal-LM pre-training on the chat-rendered corpus (seeded)."""
    if steps <= 0:
        return []
    ids = []
    for msgs in convs:
        ids.extend(tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False))
    data = torch.tensor(ids, dtype=torch.long)
    seq, batch = 128, 16
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / steps)
    )
    model.train()
    losses = []
    t0 = time.time()
    for step in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s : s + seq] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            took = time.time() - t0
            log(f"  pretrain step {step + 1}/{steps} loss {loss.item():.3f} ({took:.0f}s)")
    model.eval()
    return losses


def build(
    out: Path,
    vocab: int = 1024,
    arch: str = "inkling",
    hidden: int = 128,
    layers: int = 4,
    pretrain_steps: int = 300,
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
        "pretrain_steps": pretrain_steps,
        "seed": seed,
    }
    key = build_key(settings)
    marker = out / ".build_key"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent builders (test workers) wait here
        if not force and marker.is_file() and marker.read_text().strip() == key:
            log(f"tiny target: reusing {out} (build key {key})")
            return out
        _build_into(out, settings, key, log)
    return out


def _build_into(out: Path, settings: dict, key: str, log) -> None:
    from transformers import AutoModelForCausalLM

    vocab, hidden, layers = settings["vocab"], settings["hidden"], settings["layers"]
    pretrain_steps, seed = settings["pretrain_steps"], settings["seed"]

    log(f"tiny target: building {out} ({settings})")
    random.seed(seed)
    torch.manual_seed(seed)
    convs = _corpus()
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

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "build_info.json").write_text(
        json.dumps(
            {
                "settings": settings,
                "key": key,
                "pretrain_losses": losses[:: max(1, len(losses) // 20)],
                "mask_token_id": tokenizer.mask_token_id,
                "tokenizer_size": len(tokenizer),
            },
            indent=1,
        )
    )
    (tmp / ".build_key").write_text(key)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"tiny target: saved to {out}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--arch", choices=ARCHS, default="inkling")
    ap.add_argument("--vocab", type=int, default=1024, help="BPE vocabulary (before padding)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--pretrain-steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    a = ap.parse_args(argv)
    build(a.out, a.vocab, a.arch, a.hidden, a.layers, a.pretrain_steps, a.seed, a.force)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
