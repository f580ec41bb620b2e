"""vLLM side of the `vllm` backend: captured hidden states go to the trainer by shared
memory, through the same slots, tickets and slot writer as the SGLang plugin (shm.py,
tickets.py, slot_writer.py).

Loaded by vLLM itself (`--kv-transfer-config '{"kv_connector": "ShmHiddenStatesConnector",
"kv_connector_module_path": "specforge_dspark.engines.vllm_connector", ...}'`), in a vLLM
server running the `extract_hidden_states` speculative method: every forward writes the
aux hidden states of `eagle_aux_hidden_state_layer_ids` into a cache-only "KV" layer, one
head per layer (vllm/model_executor/models/extract_hidden_states.py). vLLM's
`ExampleHiddenStatesConnector` copies a finished request's rows out of that cache to a
safetensors file, through pinned memory and CUDA events. This subclass keeps its
scheduler side (which blocks a finished request's cache rows until the worker has read
them) and replaces the worker side: it copies the rows straight into the trainer's slot
named by the request's `kv_transfer_params` ({"sfdspark_slot": path, "sfdspark_ticket":
i, "sfdspark_nonce": n}), synchronously, and marks the ticket done
(slot_writer.write_features: nothing when n is no longer the ticket's nonce). No file,
no pinned memory, no event: the same code runs on CPU (where the example fails:
"pin_memory=True requires a CUDA or other accelerator backend", and the CPU event
placeholder has no `.query()`) and on GPU (one device-to-host copy per request).

Requests without those parameters are left to nothing: their blocks are freed at once.
Only tensor-parallel rank 0 writes (every rank caches the same rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
    extract_from_kv_cache,
)

from specforge_dspark.engines.vllm import NONCE_KEY, SLOT_KEY, TICKET_KEY
from specforge_dspark.transport.slot_writer import fail, write_features


@dataclass
class SlotSave(PendingSave):
    ticket: int = 0
    nonce: int = 0


class ShmHiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector whose worker writes into shared-memory slots
    (engines/vllm.py names it: CONNECTOR_NAME, CONNECTOR_MODULE)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._written: set[str] = set()

    # ------------------------------------------------------------- scheduler side

    def request_finished(self, request, block_ids: list[int]):
        """Keep the finished request's cache blocks until the worker copied its rows."""
        self._request_filenames.pop(request.request_id, None)
        params = request.kv_transfer_params or {}
        if SLOT_KEY not in params:
            return False, None
        self._pending_saves[request.request_id] = SlotSave(
            req_id=request.request_id,
            filename=str(params[SLOT_KEY]),
            token_ids=torch.tensor(request.prompt_token_ids or [], dtype=torch.long),
            block_ids=list(block_ids),
            ticket=int(params[TICKET_KEY]),
            nonce=int(params.get(NONCE_KEY, 0)),
        )
        return True, None

    # ---------------------------------------------------------------- worker side

    def wait_for_save(self) -> None:
        """Nothing to prepare: the trainer created the slot and its tickets."""

    def get_finished(self, finished_req_ids: set[str]):
        """Copy the rows of requests finished in the last step into their slots; report
        them done so that the scheduler frees their blocks."""
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, ExampleHiddenStatesConnectorMetadata):
                for pending in meta.pending_saves:
                    if isinstance(pending, SlotSave):
                        self._copy_to_slot(pending)
                    self._written.add(pending.req_id)
        self._accumulated_finished_req_ids.update(finished_req_ids)
        done = self._accumulated_finished_req_ids & self._written
        self._accumulated_finished_req_ids -= done
        self._written -= done
        return done or None, None

    def _copy_to_slot(self, pending: SlotSave) -> None:
        if not self._is_tp_rank_zero:
            return
        try:
            assert self._kv_cache is not None
            n = pending.token_ids.shape[0]
            blocks = torch.tensor(pending.block_ids, dtype=torch.long)
            offsets = torch.arange(self._block_size, dtype=torch.long)
            slots = (blocks[:, None] * self._block_size + offsets[None, :]).flatten()[:n]
            rows_NKH = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), n)
            rows_NKH = rows_NKH.to("cpu")
            # heads: the aux layers in order, then the final layer's (pre-norm) output
            aux_ND = rows_NKH[:, :-1].reshape(n, -1)
            last_NH = rows_NKH[:, -1]
            write_features(pending.filename, pending.ticket, pending.nonce, 0, aux_ND, last_NH)
        except Exception as e:  # the trainer reads the reason from the ticket
            message = f"{type(e).__name__}: {e}"
            fail(pending.filename, pending.ticket, pending.nonce, message, lost=True)
