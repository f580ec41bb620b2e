"""SGLang 0.5.23's own Inkling on the CPU engine: the four platform gaps it meets.

SGLang's `InklingForConditionalGeneration` runs on CPU with `--attention-backend triton`
under Triton's interpreter (`TRITON_INTERPRET=1`): its own attention, short-convolution
and MoE kernels execute as Python. Registered by our plugin (sglang_plugin.register,
through cpu/sglang.py register) only in CPU-engine processes (`SGLANG_USE_CPU_ENGINE=1`);
nothing here runs on GPUs, and each bridge is a platform answer or pure torch, named
after the SGLang line it bridges (found in launch order):

1. `arg_groups/mamba_hook.py` `_platform_supports_mamba_cache_extra_buffer` (~102-113)
   says no off CUDA/NPU/..., while `models/inkling.py` (~975-977) asserts the
   `extra_buffer` strategy: the CPU holds state snapshots like any device (plain copies).
2. Triton's autotuner benchmarks configs through the active driver, and the interpreter
   has none ("0 active drivers"). The interpreter runs a kernel's programs one after
   another, so its time falls with the tile: each config is timed 1 / (product of its
   BLOCK_* sizes), and the largest tile runs (ties: the first listed).
3. `models/inkling_common/moe.py` `_mm_fp32` / `_addmm_fp32` (~66-75) call
   `torch.mm(..., out_dtype=float32)`, which has no CPU kernel: the module's own upcast
   branch (`_FP32_GEMM_UPCAST`, taken on ROCm).
4. `kernels/ops/moe/inkling_moe.py` (~355) sizes a grid from
   `torch.cuda.get_device_properties(t.device).multi_processor_count`: answered for CPU
   tensors with the core count.

In SGLang's own environment (`make sglang-venv`) the FA4 package imports (its `cutlass` is
installed) and `tml-renderers` is there; its check that the served tokenizer is Inkling's
o200k (`entrypoints/openai/serving_inkling.py` ~54, ~262-280) guards the chat endpoint,
which a tiny target's tokenizer cannot pass: our CPU servers of Inkling start with
SGLang's own `--skip-tokenizer-init` (engines/sglang.py `cpu_engine_args`), as every
request we send carries `input_ids` and reads `output_ids`.
"""

from __future__ import annotations

import math
import os
import types

import torch

MAMBA_HOOK = "sglang.srt.arg_groups.mamba_hook._platform_supports_mamba_cache_extra_buffer"
MOE = "sglang.srt.models.inkling_common.moe"


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(MAMBA_HOOK, lambda: True, HookType.REPLACE)
    HookRegistry.register(f"{MOE}._mm_fp32", mm_fp32, HookType.REPLACE)
    HookRegistry.register(f"{MOE}._addmm_fp32", addmm_fp32, HookType.REPLACE)
    equal_autotune_timings()
    cpu_device_properties()


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Gap 3: moe.py's `_FP32_GEMM_UPCAST` branch of `_mm_fp32`."""
    return torch.mm(a.float(), b.float())


def addmm_fp32(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Gap 3: moe.py's `_FP32_GEMM_UPCAST` branch of `_addmm_fp32`."""
    return torch.addmm(bias.float(), a.float(), b.float())


def equal_autotune_timings() -> None:
    """Gap 2: `Autotuner._bench` answers the interpreter's cost order (fewest programs)."""
    from triton.runtime.autotuner import Autotuner

    if getattr(Autotuner._bench, "_interpreted", False):
        return

    def bench(self, *args, config, **meta):
        tile = math.prod(v for k, v in config.kwargs.items() if "BLOCK" in k and isinstance(v, int))
        return [1.0 / tile] * 3

    bench._interpreted = True
    Autotuner._bench = bench


def cpu_device_properties() -> None:
    """Gap 4: `torch.cuda.get_device_properties` of a CPU device: its core count."""
    original = torch.cuda.get_device_properties
    if getattr(original, "_cpu_answer", False):
        return

    def get_device_properties(device=None):
        if isinstance(device, torch.device | str) and torch.device(device).type == "cpu":
            return types.SimpleNamespace(
                name="cpu", multi_processor_count=os.cpu_count() or 1, total_memory=0
            )
        return original(device)

    get_device_properties._cpu_answer = True
    torch.cuda.get_device_properties = get_device_properties
