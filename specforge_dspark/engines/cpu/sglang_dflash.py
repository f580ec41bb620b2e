"""SGLang 0.5.23's DFLASH speculative decoding on the CPU engine: the gaps it meets.

`evaluation.serve_check` serves our DFlash exports with SGLang's own DFLASH worker
(`speculative/dflash_worker_v2.py`) and SGLang's Inkling on CPU, and compares prompt by
prompt with our harness. Registered by our plugin through `cpu.sglang.register` only in
CPU-engine processes (`SGLANG_USE_CPU_ENGINE=1`); nothing here runs on GPUs. Each bridge
is a platform answer named after the SGLang line it bridges (found in launch order):

1. `arg_groups/speculative_hook.py` `_handle_dflash` (~291-301) accepts only cuda, npu
   and xpu devices: its checks run with the device gate seeing a GPU, then overlap
   scheduling is turned off as SGLang's EAGLE/NGRAM handlers do on CPU.
2. `model_executor/model_runner.py` `_extend_forward_kwargs` (~1771-1772) casts a
   batch's `input_embeds` to bfloat16 whatever the model's dtype; the DFLASH worker
   hands its draft the noise embeddings that way (`dflash_worker_v2.py` ~2575-2582,
   `ForwardBatch(input_embeds=...)`), and a float32 draft's first linear then refuses
   bf16 input. The CPU engine serves in float32 (where engine and harness are exact):
   the embeddings reach the model in the runner's own dtype, unrounded.
3. `models/dflash.py` `_radix_topk` (~66-70), the DFlash2 selector's candidate top-K,
   calls flashinfer's CUDA top-k whenever flashinfer imports (SGLang's venv has it;
   flashinfer 0.7.2 raises "device must be a cuda device" for a CPU tensor); for CPU
   tensors it takes SGLang's own fallback branch there, `torch.topk`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SPECULATIVE_HOOK = "sglang.srt.arg_groups.speculative_hook"
MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
DFLASH_MODEL = "sglang.srt.models.dflash"


def register(device_gate: Callable) -> None:
    """`device_gate(original, server_args)`: the CPU engine's speculative device gate
    (cpu/sglang.py handle_dspark), applied to `_handle_dflash` as to `_handle_dspark`."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{SPECULATIVE_HOOK}._handle_dflash", device_gate, HookType.AROUND)
    HookRegistry.register(
        f"{MODEL_RUNNER}._extend_forward_kwargs", extend_forward_kwargs, HookType.AROUND
    )
    HookRegistry.register(f"{DFLASH_MODEL}._radix_topk", radix_topk, HookType.AROUND)


def radix_topk(original, scores: torch.Tensor, k: int):
    """Bridge 3: `torch.topk` (SGLang's fallback) for CPU tensors, flashinfer's otherwise."""
    if scores.is_cuda:
        return original(scores, k)
    return torch.topk(scores, k, dim=-1)


def extend_forward_kwargs(original, self, forward_batch, pp_proxy_tensors) -> dict:
    """Bridge 2: `_extend_forward_kwargs` with `input_embeds` in the runner's dtype
    (`self.dtype`) instead of bfloat16; replaced token embeddings are scattered again."""
    kwargs = original(self, forward_batch, pp_proxy_tensors)
    embeds = forward_batch.input_embeds
    if embeds is None or self.dtype == torch.bfloat16:
        return kwargs
    kwargs["input_embeds"] = embeds.to(self.dtype)
    if forward_batch.replace_embeds is not None and forward_batch.replace_positions is not None:
        kwargs["input_embeds"][forward_batch.replace_positions] = forward_batch.replace_embeds.to(
            self.dtype
        )
    return kwargs
