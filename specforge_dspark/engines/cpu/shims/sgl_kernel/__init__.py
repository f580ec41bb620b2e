"""The `*_cpu` names SGLang's CPU engine imports from sgl_kernel, in pure torch.

See ../README.md. Each implemented op follows the Triton kernel SGLang uses on GPUs
(named in its docstring) and is tested against a direct reading of that kernel in
tests/test_cpu_shims.py. Any other name raises ImportError, so that SGLang's own
fallbacks engage (e.g. `layers/quantization/utils.py` probes for optional kernels).
"""

from __future__ import annotations

import ctypes

import torch

__version__ = "0.0.0+specforge-dspark-cpu-shim"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,  # [B]
    req_to_token: torch.Tensor,  # [pool, max_len]
    start_offset: torch.Tensor,  # [B]
    end_offset: torch.Tensor,  # [B]
    out_cache_loc: torch.Tensor,  # [sum(end - start)]
    pool_len: int,
) -> None:
    """`mem_cache/allocation.py:assign_req_to_token_pool`: request b's new cache slots
    (its run of `out_cache_loc`, runs laid out in batch order) go to
    req_to_token[req_pool_indices[b], start_offset[b]:end_offset[b]]."""
    del pool_len  # the row length of req_to_token; implied by the tensor here
    pos = 0
    rows = req_pool_indices.tolist()
    for b, (lo, hi) in enumerate(zip(start_offset.tolist(), end_offset.tolist(), strict=True)):
        n = hi - lo
        req_to_token[rows[b], lo:hi] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,  # [B]
    req_to_token: torch.Tensor,  # [pool, max_len]
    start_offset: torch.Tensor,  # [B]
    end_offset: torch.Tensor,  # [B]
    out_cache_loc: torch.Tensor,  # [sum(end - start)] written
    pool_len: int,
) -> None:
    """`kernels/ops/speculative/cache_locs.py:assign_extend_cache_locs`, the reverse of
    assign_req_to_token_pool: request b's cache slots req_to_token[req_pool_indices[b],
    start_offset[b]:end_offset[b]] are gathered into its run of `out_cache_loc`."""
    del pool_len
    pos = 0
    rows = req_pool_indices.tolist()
    for b, (lo, hi) in enumerate(zip(start_offset.tolist(), end_offset.tolist(), strict=True)):
        n = hi - lo
        out_cache_loc[pos : pos + n] = req_to_token[rows[b], lo:hi].to(out_cache_loc.dtype)
        pos += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,  # [L] int64 base addresses of the per-layer K/V buffers
    strides: torch.Tensor,  # [L] int64 bytes per cache row of each buffer
    tgt_loc: torch.Tensor,  # [N] cache rows to write
    src_loc: torch.Tensor,  # [N] cache rows to read
) -> None:
    """`kernels/ops/kvcache/cache_move.py:copy_all_layer_kv_cache_tiled`: in every
    buffer, rows src_loc are copied to rows tgt_loc, all sources read before any target
    is written (the kernel loads a tile's sources, then stores: safe in place)."""
    if tgt_loc.numel() == 0:
        return
    rows = int(torch.maximum(tgt_loc.max(), src_loc.max())) + 1
    src, tgt = src_loc.long(), tgt_loc.long()
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(base)
        buf = torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride)
        buf[tgt] = buf[src]  # advanced indexing gathers a copy first


def _not_on_this_path(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: the specforge_dspark CPU shim does not implement this op "
            "(SGLang's CPU engine imports it; feature capture and greedy DSPARK decoding "
            "never call it)"
        )

    op.__name__ = name
    return op


_IMPORTED_ONLY = (
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
)
globals().update({name: _not_on_this_path(name) for name in _IMPORTED_ONLY})


def __getattr__(name: str):
    raise AttributeError(f"module 'sgl_kernel' (specforge_dspark CPU shim) has no {name!r}")
