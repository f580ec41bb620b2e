"""Build the small targets used on CPU (tests, demo): Inkling, and Qwen3 beside it.

    python -m specforge_dspark.tiny --out .cache/tiny_target
    python -m specforge_dspark.tiny --arch qwen3 --out .cache/tiny_qwen3

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
Building is cached: a folder holding a `.build_key` equal to this builder's key (its
settings, this file's source and the data files' contents) is reused as it is.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import math
import random
import shutil
import time
from pathlib import Path

import torch

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
BUILD_VERSION = 4
ARCHS = ("inkling", "qwen3")
# Pre-training steps by architecture: the Inkling target is the one that must write
# (the demo and the acceptance figures use it); the Qwen3 one serves SGLang tests.
PRETRAIN_STEPS = {"inkling": 900, "qwen3": 300}
PRETRAIN_TOKENS = 2048  # per step
PRETRAIN_LR = 3e-3
EVAL_ROWS_RESERVED = 100  # MATH500 / HumanEval rows below this are evaluation-only
HELDOUT_GSM8K = 100
HELDOUT_SHAREGPT = 50
HELDOUT_MT_BENCH = 40
LOOP_WORKLOADS = ("gsm8k", "math500", "humaneval", "mt_bench")

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


def _data_files() -> list[Path]:
    train, ev = SHARED_DATA / "train", SHARED_DATA / "eval"
    return [
        train / "gsm8k_train.jsonl",
        train / "sharegpt_sample.json",
        ev / "math500_test.jsonl",
        ev / "humaneval.jsonl",
        ev / "gsm8k_test.jsonl",
        ev / "mt_bench_questions.jsonl",
    ]


def build_key(settings: dict) -> str:
    """Settings plus this file's source and the data files' bytes (v4 on)."""
    if settings.get("arch") == "inkling":  # keys of Inkling builds predate the field
        settings = {k: v for k, v in settings.items() if k != "arch"}
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    if settings.get("version", 0) >= 4:
        h.update(Path(__file__).read_bytes())
        for f in _data_files():
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _jsonl(path: Path) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def _pair(user: str, assistant: str) -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


def corpus() -> tuple[list[list[dict]], dict[str, tuple[list[list[dict]], str]]]:
    """(pre-training conversations, {name: (held-out conversations, role scored)}).

    Pre-training: every GSM8K train pair, ShareGPT but its last HELDOUT_SHAREGPT
    conversations, and the MATH500 / HumanEval rows from EVAL_ROWS_RESERVED on (the
    evaluation reads the first rows of each workload, at most EVAL_ROWS_RESERVED).
    Held out: the answers of the first HELDOUT_GSM8K GSM8K test pairs, the first turns of
    HELDOUT_MT_BENCH MT-Bench questions (prose no training row holds) and the answers of
    the last HELDOUT_SHAREGPT ShareGPT conversations (templated, so the loss is low).
    """
    train, ev = SHARED_DATA / "train", SHARED_DATA / "eval"
    convs = [_pair(r["question"], r["answer"]) for r in _jsonl(train / "gsm8k_train.jsonl")]
    roles = {"human": "user", "gpt": "assistant"}
    share = [
        [{"role": roles.get(t["from"], "user"), "content": t["value"]} for t in c["conversations"]]
        for c in json.loads((train / "sharegpt_sample.json").read_text())
    ]
    convs += share[:-HELDOUT_SHAREGPT]
    math = _jsonl(ev / "math500_test.jsonl")[EVAL_ROWS_RESERVED:]
    convs += [_pair(r["problem"], r["solution"]) for r in math]
    code = _jsonl(ev / "humaneval.jsonl")[EVAL_ROWS_RESERVED:]
    convs += [_pair(r["prompt"], r["prompt"] + r["canonical_solution"]) for r in code]
    gsm_test = _jsonl(ev / "gsm8k_test.jsonl")[:HELDOUT_GSM8K]
    mt = _jsonl(ev / "mt_bench_questions.jsonl")[:HELDOUT_MT_BENCH]
    heldout = {
        "gsm8k_test_answers": ([_pair(r["question"], r["answer"]) for r in gsm_test], "assistant"),
        "mt_bench_questions": ([[{"role": "user", "content": r["turns"][0]}] for r in mt], "user"),
        "sharegpt_answers": (share[-HELDOUT_SHAREGPT:], "assistant"),
    }
    return convs, heldout


def loops(tokens: list[int], window: int = 48, max_period: int = 8) -> bool:
    """True if the last `window` tokens repeat with a period <= `max_period`."""
    if len(tokens) < window:
        return False
    tail = tokens[-window:]
    return any(
        all(tail[i] == tail[i + p] for i in range(window - p)) for p in range(1, max_period + 1)
    )


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


def pretrain(
    model, tokenizer, convs: list[list[dict]], steps: int, seed: int, log, seq: int = 256
) -> list[float]:
    """Causal-LM pre-training on the chat-rendered corpus, packed (seeded).

    AdamW at PRETRAIN_LR with a 3% warmup and a cosine decay to a tenth; every step
    reads `PRETRAIN_TOKENS` tokens as `PRETRAIN_TOKENS // seq` random windows.
    """
    if steps <= 0:
        return []
    ids = []
    for msgs in convs:
        ids.extend(tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False))
    data = torch.tensor(ids, dtype=torch.long)
    batch = PRETRAIN_TOKENS // seq
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(
        model.parameters(), lr=PRETRAIN_LR, weight_decay=0.01, betas=(0.9, 0.95)
    )
    warmup = max(1, steps * 3 // 100)

    def lr_scale(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_scale)
    log(f"  pretrain: {len(data)} corpus tokens, {steps} steps of {batch}x{seq} tokens")
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
        if step % 100 == 0 or step == steps - 1:
            took = time.time() - t0
            log(f"  pretrain step {step + 1}/{steps} loss {loss.item():.3f} ({took:.0f}s)")
    model.eval()
    return losses


@torch.inference_mode()
def heldout_loss(model, tokenizer, heldout: dict) -> dict[str, float]:
    """Mean nats/token of each held-out set's scored turns, and the sets' mean."""
    out = {}
    for name, (convs, role) in heldout.items():
        total, count = 0.0, 0
        for msgs in convs:
            ids, labels = [], []
            for i, m in enumerate(msgs):
                n_before = len(ids)
                ids = tokenizer.apply_chat_template(msgs[: i + 1], tokenize=True, return_dict=False)
                keep = m["role"] == role
                labels += ids[n_before:] if keep else [-100] * (len(ids) - n_before)
            ids, labels = ids[:1024], labels[:1024]
            x, y = torch.tensor([ids]), torch.tensor([labels])
            n = int((y[:, 1:] != -100).sum())
            if n:
                total += model(input_ids=x, labels=y).loss.item() * n
                count += n
        out[name] = round(total / max(1, count), 4)
    out["mean"] = round(sum(out.values()) / len(out), 4)
    return out


@torch.inference_mode()
def greedy_loop_rate(
    model, tokenizer, workloads=LOOP_WORKLOADS, num_prompts: int = 20, max_new_tokens: int = 128
) -> dict:
    """Greedy continuations of the first `num_prompts` evaluation prompts of each workload
    (first turn), and the share that `loops`. Each workload's prompts are decoded as one
    left-padded batch (equal to one-by-one greedy decoding; the test checks it)."""
    from specforge_dspark.decoding.hf_target import batched_greedy
    from specforge_dspark.decoding.prompts import load_conversations, parse_workload, render

    gen_eos = model.generation_config.eos_token_id
    eos = set(gen_eos if isinstance(gen_eos, list) else [gen_eos]) | {tokenizer.eos_token_id}
    eos.discard(None)
    rows = []
    for w in workloads:
        convs = load_conversations(parse_workload(w), num_prompts)
        prompts = [render(tokenizer, [{"role": "user", "content": c.turns[0]}]) for c in convs]
        outs = batched_greedy(model, prompts, max_new_tokens, eos, tokenizer.pad_token_id)
        for conv, new in zip(convs, outs, strict=True):
            rows.append(
                {
                    "workload": w,
                    "index": conv.index,
                    "tokens": len(new),
                    "loops": loops(new),
                    "text": tokenizer.decode(new, skip_special_tokens=True),
                }
            )
    rate = sum(r["loops"] for r in rows) / len(rows)
    per = {w: sum(r["loops"] for r in rows if r["workload"] == w) / num_prompts for w in workloads}
    return {"loop_rate": round(rate, 4), "per_workload": per, "continuations": rows}


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--arch", choices=ARCHS, default="inkling")
    ap.add_argument("--vocab", type=int, default=1024, help="BPE vocabulary (before padding)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument(
        "--pretrain-steps", type=int, default=None, help=f"default by arch: {PRETRAIN_STEPS}"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    a = ap.parse_args(argv)
    build(a.out, a.vocab, a.arch, a.hidden, a.layers, a.pretrain_steps, a.seed, a.force)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
