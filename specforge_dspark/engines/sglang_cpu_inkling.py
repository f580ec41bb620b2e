"""SGLang 0.5.23's own Inkling on the CPU engine: the six platform gaps it meets.

SGLang's `InklingForConditionalGeneration` runs on CPU with `--attention-backend triton`
under Triton's interpreter (`TRITON_INTERPRET=1`): its own attention, short-convolution
and MoE kernels execute as Python. Registered by our plugin (sglang_plugin.register,
through sglang_cpu.register) only in CPU-engine processes (`SGLANG_USE_CPU_ENGINE=1`);
nothing here runs on GPUs, and each bridge is a platform answer or pure torch, named
after the SGLang line it bridges (found in launch order):

1. `arg_groups/mamba_hook.py` `_platform_supports_mamba_cache_extra_buffer` (~102-113)
   says no off CUDA/NPU/..., while `models/inkling.py` (~975-977) asserts the
   `extra_buffer` strategy: the CPU holds state snapshots like any device (plain copies).
2. `models/inkling_common/attn.py` line 9 imports the FA4 package
   (`sglang.kernels.ops.attention.flash_attn.cute`), whose `__init__` imports `cutlass`
   for its CUDA kernels: the package is registered without running its `__init__`, so
   the one submodule Inkling imports on every backend (`batch_invariance`) loads.
3. `entrypoints/openai/serving_inkling.py` (~52-54) loads the `tml-renderers` wheel and
   checks the served tokenizer against its o200k tokenizer when the HTTP server starts:
   without the wheel the chat adapter's renderers raise when used (the chat endpoint),
   and the tokenizer check is skipped; `/generate` with `input_ids` never uses either.
4. Triton's autotuner benchmarks configs through the active driver, and the interpreter
   has none ("0 active drivers"). The interpreter runs a kernel's programs one after
   another, so its time falls with the tile: each config is timed 1 / (product of its
   BLOCK_* sizes), and the largest tile runs (ties: the first listed).
5. `models/inkling_common/moe.py` `_mm_fp32` / `_addmm_fp32` (~66-75) call
   `torch.mm(..., out_dtype=float32)`, which has no CPU kernel: the module's own upcast
   branch (`_FP32_GEMM_UPCAST`, taken on ROCm).
6. `kernels/ops/moe/inkling_moe.py` (~355) sizes a grid from
   `torch.cuda.get_device_properties(t.device).multi_processor_count`: answered for CPU
   tensors with the core count.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import types
from pathlib import Path

import torch

MAMBA_HOOK = "sglang.srt.arg_groups.mamba_hook._platform_supports_mamba_cache_extra_buffer"
FA4_PACKAGE = "sglang.kernels.ops.attention.flash_attn.cute"
RENDERERS = "sglang.srt.parser.inkling_renderer.load_tml_renderers"
TOKENIZER_CHECK = "sglang.srt.entrypoints.openai.serving_inkling._check_served_tokenizer"
MOE = "sglang.srt.models.inkling_common.moe"
NO_RENDERERS = (
    "tml-renderers is not installed in this CPU-engine server, so SGLang's Inkling chat "
    "endpoint is off; /generate with input_ids works"
)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    register_fa4_package()  # before anything imports inkling_common.attn
    HookRegistry.register(MAMBA_HOOK, lambda: True, HookType.REPLACE)
    HookRegistry.register(RENDERERS, load_tml_renderers, HookType.AROUND)
    HookRegistry.register(TOKENIZER_CHECK, check_served_tokenizer, HookType.AROUND)
    HookRegistry.register(f"{MOE}._mm_fp32", mm_fp32, HookType.REPLACE)
    HookRegistry.register(f"{MOE}._addmm_fp32", addmm_fp32, HookType.REPLACE)
    equal_autotune_timings()
    cpu_device_properties()


def register_fa4_package() -> None:
    """Gap 2: the FA4 package as a namespace of its files, its `__init__` not run."""
    if FA4_PACKAGE in sys.modules or importlib.util.find_spec("cutlass") is not None:
        return
    parent = importlib.util.find_spec(FA4_PACKAGE.rsplit(".", 1)[0])
    if parent is None or not parent.submodule_search_locations:
        return
    package = types.ModuleType(FA4_PACKAGE)
    package.__path__ = [str(Path(next(iter(parent.submodule_search_locations))) / "cute")]
    package.__package__ = FA4_PACKAGE
    sys.modules[FA4_PACKAGE] = package


def tml_renderers_installed() -> bool:
    return importlib.util.find_spec("tml_renderers") is not None


class _NoRenderers(types.SimpleNamespace):
    def __getattr__(self, name: str):
        raise ImportError(f"{NO_RENDERERS} (asked for tml_renderers.{name})")


def load_tml_renderers(original):
    """Gap 3: the real renderers when installed, else a namespace that raises on use."""
    return original() if tml_renderers_installed() else _NoRenderers()


def check_served_tokenizer(original, tokenizer) -> None:
    """Gap 3: nothing to compare the served tokenizer with without the renderers."""
    if tml_renderers_installed():
        original(tokenizer)


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Gap 5: moe.py's `_FP32_GEMM_UPCAST` branch of `_mm_fp32`."""
    return torch.mm(a.float(), b.float())


def addmm_fp32(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Gap 5: moe.py's `_FP32_GEMM_UPCAST` branch of `_addmm_fp32`."""
    return torch.addmm(bias.float(), a.float(), b.float())


def equal_autotune_timings() -> None:
    """Gap 4: `Autotuner._bench` answers the interpreter's cost order (fewest programs)."""
    from triton.runtime.autotuner import Autotuner

    if getattr(Autotuner._bench, "_interpreted", False):
        return

    def bench(self, *args, config, **meta):
        tile = math.prod(v for k, v in config.kwargs.items() if "BLOCK" in k and isinstance(v, int))
        return [1.0 / tile] * 3

    bench._interpreted = True
    Autotuner._bench = bench


def cpu_device_properties() -> None:
    """Gap 6: `torch.cuda.get_device_properties` of a CPU device: its core count."""
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
