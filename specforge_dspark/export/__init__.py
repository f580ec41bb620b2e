"""Serving layouts: SGLang (DSpark, DFlash) and speculators (vLLM)."""
