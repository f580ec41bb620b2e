"""The tiny targets' seeded causal-LM pre-training and what the build measures of it
(held-out loss, greedy loop rate)."""

from __future__ import annotations

import math
import time

import torch

from specforge_dspark.targets.corpus import loops

# Pre-training steps by architecture: the Inkling target is the one that must write
# (the demo and the acceptance figures use it); the Qwen3 one serves SGLang tests.
PRETRAIN_STEPS = {"inkling": 900, "qwen3": 300}
PRETRAIN_TOKENS = 2048  # per step
PRETRAIN_LR = 3e-3
LOOP_WORKLOADS = ("gsm8k", "math500", "humaneval", "mt_bench")


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
