"""vLLM side of the closed loop's in-place swap (`loop.swap: reload`): a weight-transfer
backend for vLLM's own draft weight update that reads an exported drafter from disk.

vLLM 0.32 updates a serving draft model's weights in place through its RL endpoints
(`/start_draft_weight_update`, `/update_weights`, `/finish_weight_update`, mounted with
`VLLM_SERVER_DEV_MODE=1`; vllm/entrypoints/rl/online/api_router.py), each worker handing
the chunks to the backend named by `--weight-transfer-config` (vllm/v1/worker/gpu_worker.py
`_start_weight_update`, `update_weights`). Its backends move tensors from a trainer's GPUs
(NCCL, CUDA IPC, RDMA): none runs on this CPU, and a loop's candidate is a file anyway. This
backend, `specforge_dir`, receives `{"path": <the export's speculators directory>}` and
loads that directory's safetensors into the draft model with the model's own
`load_weights` (the loader vLLM used when it started: qwen3_dspark.py maps the names and
rebuilds its fused KV buffers), inside vLLM's layerwise reload (start and finish, as its
NCCL backend). Loading is synchronous, so `update_weights` skips the
base class's `torch.accelerator.synchronize()` where no accelerator exists (a CPU worker
raises there).

Registered by entry point `specforge_dspark` in group `vllm.general_plugins` (pyproject),
which vLLM loads in every process; the backend acts only when a server is started with
`--weight-transfer-config '{"backend": "specforge_dir"}'` (serving/vllm.py
`reloadable`). Imports vLLM: loaded only in vLLM's own venv.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

BACKEND = "specforge_dir"


def register() -> None:
    """Entry point: make `specforge_dir` a weight-transfer backend in this vLLM process."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "DirWeightTransferEngine")
    except ValueError:  # registered already (plugins loaded twice in one process)
        pass


@dataclass
class DirInitInfo:
    """Nothing to set up: the weights come from a path named in each update."""


@dataclass
class DirUpdateInfo:
    path: str
    """A drafter export in the layout the server loaded (config.json + *.safetensors)."""


class DirWeightTransferEngine(WeightTransferEngine):
    """Loads an exported drafter's tensors from disk into the update's target model."""

    init_info_cls = DirInitInfo
    update_info_cls = DirUpdateInfo
    supports_draft_weight_update = True

    def init_transfer_engine(self, init_info: DirInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        """The layerwise reload's start, as vLLM's NCCL backend does for weights in
        checkpoint format: after the first load a CPU worker repacks linear weights for its
        GEMM and leaves the parameters empty; this restores them to take a checkpoint."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        """Process the loaded weights again (as after the first load: a CPU worker repacks
        each linear weight for its GEMM and leaves the parameter empty), then renew what
        the DSpark / DFlash draft derives from them (qwen3_dflash.py
        `_build_fused_kv_buffers`: the norms' weights, and one fused KV weight stacked
        from the projections). The layerwise reload processes each layer as its weights
        arrive, so the projections are packed by then: the fused weight is dropped and the
        context KV goes through each layer's own projection, the path vLLM takes for
        packed (quantized) projections."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        inner = getattr(self.model, "model", None)
        if hasattr(inner, "_build_fused_kv_buffers"):
            inner._build_fused_kv_buffers()
            inner._fused_kv_weight = inner._fused_kv_bias = None

    def shutdown(self) -> None:
        pass

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: DirUpdateInfo) -> None:
        from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

        files = sorted(str(f) for f in Path(update_info.path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"{BACKEND}: no *.safetensors in {update_info.path} (update_info.path must "
                "name an exported drafter directory)"
            )
        self.model.load_weights(safetensors_weights_iterator(files, use_tqdm_on_load=False))
