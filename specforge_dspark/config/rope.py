"""A draft's RoPE settings as config.json and the recipe write them: the scaling types the
draft reproduces (drafters/rope.py builds the tables), the checks on a `draft.rope_scaling`,
and the conversions to and from a config's `rope_parameters` (transformers v5; v4's
`rope_scaling` read too)."""

from __future__ import annotations

from typing import Any

SCALINGS = ("default", "linear", "llama3", "yarn")
"""RoPE types the draft reproduces (`rope_scaling["rope_type"]`)."""
NEEDS = {"linear": ("factor",), "llama3": ("factor", "original_max_position_embeddings"),
         "yarn": ("factor", "original_max_position_embeddings")}  # fmt: skip


def rope_type(scaling: dict[str, Any] | None) -> str:
    scaling = scaling or {}
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def rope_scaling_problems(scaling: dict[str, Any] | None, key: str) -> list[str]:
    """What is wrong with a `rope_scaling` dict (named by `key` in each message)."""
    kind = rope_type(scaling)
    if kind not in SCALINGS:
        why = " (its tables change with the served length)" if kind == "dynamic" else ""
        return [f"{key}: rope_type {kind!r} is not supported{why}; supported: {list(SCALINGS)}"]
    missing = [k for k in NEEDS.get(kind, ()) if k not in (scaling or {})]
    problems = [f"{key}: rope_type {kind!r} needs {k}" for k in missing]
    if "factor" in (scaling or {}) and not float(scaling["factor"]) >= 1.0:
        problems.append(f"{key}: factor must be >= 1, got {scaling['factor']}")
    return problems


def rope_parameters(theta: float, scaling: dict[str, Any] | None) -> dict[str, Any]:
    """config.json's `rope_parameters` for a draft (what SGLang's get_rope_config reads)."""
    extra = {k: v for k, v in (scaling or {}).items() if k not in ("rope_type", "type")}
    return {"rope_type": rope_type(scaling), "rope_theta": theta, **extra}


def scaling_from_parameters(rope: dict[str, Any]) -> dict[str, Any]:
    """`rope_scaling` from a config's `rope_parameters` (or v4 `rope_scaling`): {} when default."""
    if rope_type(rope) == "default":
        return {}
    skip = ("rope_type", "type", "rope_theta")
    return {"rope_type": rope_type(rope), **{k: v for k, v in rope.items() if k not in skip}}
