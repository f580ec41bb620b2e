"""Tensor parallelism on SGLang 0.5.23's CPU engine: the one gap between its TP code and
a CPU host whose SGLang venv carries the NCCL library (a CUDA build of torch, as
`pip install sglang` brings). Registered by cpu/sglang.py `register` in CPU-engine
processes only (`SGLANG_USE_CPU_ENGINE=1`); a GPU server never imports this module.

- `init_model_parallel_group` (distributed/parallel_state.py ~2180-2185) decides
  `use_pynccl` by platform alone: the CPU platform is not out-of-tree, so it asks for a
  PyNccl communicator, and `PyNcclCommunicator.__init__`
  (device_communicators/pynccl.py ~116) opens `torch.cuda.device(cpu)` once the NCCL
  library loads, which raises. A CPU device has no NCCL communicator: groups of a
  CPU-engine process are built with `use_pynccl=False`; their all-reduce then takes
  `GroupCoordinator.all_reduce`'s gloo path (`torch.distributed.all_reduce` over the CPU
  group, where `sgl_kernel.shm_allreduce` is not available).

The cores each TP rank binds its OpenMP threads to come from SGLang's own setting,
`SGLANG_CPU_OMP_THREADS_BIND` (utils/numa_utils.py `init_threads_binding` refuses more
ranks than NUMA nodes without it); engines/sglang.py sets it for the servers we start.
"""

from __future__ import annotations

PARALLEL_STATE = "sglang.srt.distributed.parallel_state"


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        f"{PARALLEL_STATE}.init_model_parallel_group", groups_without_nccl, HookType.AROUND
    )


def groups_without_nccl(original, *args, **kwargs):
    """`init_model_parallel_group` with no PyNccl communicator (CPU devices have none)."""
    if kwargs.get("use_pynccl") is None:
        kwargs["use_pynccl"] = False
    return original(*args, **kwargs)
