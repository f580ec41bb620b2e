"""The mask token of a target's drafter (cli/init_recipe.py): the token the draft's block
carries in the positions it drafts, one the target never emits in training data."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

MASK_NAMES = re.compile(r"^(<\|?mask\|?>|\[mask\])$", re.I)
RESERVED_NAMES = re.compile(r"reserved|unused|place.?holder", re.I)


def tokenizer_tokens(target: Path) -> tuple[dict[int, str], dict[str, str], int]:
    """(added/special tokens by id, declared special tokens by role, tokenizer size)."""
    tok_json, tok_cfg = target / "tokenizer.json", target / "tokenizer_config.json"
    if not tok_json.is_file() and not tok_cfg.is_file():
        msg = f"--target: no {tok_json} (nor tokenizer_config.json) to take the mask token from"
        raise ValueError(msg + "; pass --mask-token-id")
    data = json.loads(tok_json.read_text()) if tok_json.is_file() else {}
    v = (data.get("model") or {}).get("vocab") or {}  # BPE: token -> id; Unigram: [piece, score]
    vocab = v if isinstance(v, dict) else {p[0]: i for i, p in enumerate(v)}
    tokens = {t["id"]: t["content"] for t in data.get("added_tokens", [])}
    roles: dict[str, str] = {}
    for path in (target / "special_tokens_map.json", tok_cfg):
        cfg = json.loads(path.read_text()) if path.is_file() else {}
        for i, t in (cfg.get("added_tokens_decoder") or {}).items():
            tokens[int(i)] = t["content"]
        for role in ("mask_token", "pad_token", "eos_token", "bos_token", "unk_token"):
            value = cfg.get(role)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                roles[role] = value
    ids = {**vocab, **{c: i for i, c in tokens.items()}}
    tokens.update({ids[c]: c for c in roles.values() if c in ids})
    return tokens, roles, max([*ids.values(), -1]) + 1


def no_mask_token(
    target: Path, free: dict[int, str], looked_for: list[str], logical: int, rows: int
) -> str:
    """The refusal when no mask token can be chosen: what was looked for, the special
    tokens considered (none of them matched), and how to pass one."""
    shown = ", ".join(f"{c} = {i}" for i, c in list(free.items())[:16])
    more = f" and {len(free) - 16} more" if len(free) > 16 else ""
    considered = f"the special tokens {shown}{more}" if free else "no special token at all"
    return (
        f"--target: no mask token in {target}/tokenizer.json or tokenizer_config.json: looked "
        f"for {'; '.join(looked_for)} among {considered} (pad, eos, bos and unk excluded); and "
        f"no padded LM-head row (the first would be {-(-logical // 64) * 64}, the head has "
        f"{rows}). Pass --mask-token-id with a token your training data never holds, e.g. one "
        "of those special tokens"
    )


def choose_mask_token(target: Path, text: dict[str, Any], given: int | None) -> tuple[int, str]:
    """(mask_token_id, why), the first of: --mask-token-id; the tokenizer's mask_token; an
    added token named like a mask; the first reserved / unused / placeholder token;
    `<|fim_pad|>`; the first padded LM-head row (>= `unpadded_vocab_size`, else the
    tokenizer's size) on a multiple of 64, as Inkling's 200064. Never pad, eos, bos, unk."""
    rows = text["vocab_size"]
    if given is not None:
        if not 0 <= given < rows:
            raise ValueError(f"--mask-token-id {given} must be in [0, {rows}) (LM-head rows)")
        return given, f"{given}, from --mask-token-id"
    tokens, roles, size = tokenizer_tokens(target)
    taken = {roles.get(r) for r in ("pad_token", "eos_token", "bos_token", "unk_token")}
    free = {i: c for i, c in sorted(tokens.items()) if c not in taken and i < rows}
    tests = [
        ("the tokenizer's mask_token", lambda c: c == roles.get("mask_token")),
        ("a mask token of the tokenizer", MASK_NAMES.match),
        ("the first reserved / unused token", RESERVED_NAMES.search),
        ("an unused special token", lambda c: c == "<|fim_pad|>"),
    ]
    for why, test in tests:
        hit = next((i for i, c in free.items() if test(c)), None)
        if hit is not None:
            return hit, f"{free[hit]} = {hit}, {why}"
    logical = text.get("unpadded_vocab_size") or min(size, rows)
    row = -(-logical // 64) * 64
    if row >= rows:
        raise ValueError(no_mask_token(target, free, [why for why, _ in tests], logical, rows))
    why = f"padded LM-head row {row}: no unused token in the tokenizer; the target never emits"
    return row, why + f" rows >= {logical} (its logical vocabulary)"
