"""SGLang 0.5.23's DSPARK speculative decoding on the CPU engine: the few hooks it needs.

SGLang's own DSPARK worker serves our exported drafter on CPU (fp32, where it is exact)
once these gaps are bridged; `evaluation.serve_check` uses that to compare the engine's
speculative decoding with our harness before any GPU deployment. Registered by our
plugin (sglang_plugin.register) only in CPU-engine processes (SGLANG_USE_CPU_ENGINE=1);
nothing here runs on GPUs. Each hook names the SGLang code it bridges:

- `_handle_dspark` (arg_groups/speculative_hook.py) refuses devices other than
  cuda/npu/xpu: let cpu through with overlap scheduling off, as SGLang does for EAGLE.
- `DRAFT_ATTENTION_BACKEND_CHOICES` (arg_groups/choices.py) lacks `torch_native`, so the
  draft worker would fall back to flashinfer (CUDA): add it.
- `TorchNativeAttnBackend.forward_extend` (layers/attention/torch_native_backend.py) has
  no TARGET_VERIFY path (it needs `extend_prefix_lens`, absent in verify batches): both
  the target's verify and the DSpark draft block run in that mode. `verify_extend` reads
  each request's prefix K/V through req_to_token, appends the new tokens' (written to
  out_cache_loc first), and runs SDPA as triton_backend.py's extend kernel does for that
  mode: causal for decoder layers (the target's verify), bidirectional for the draft's
  ENCODER_ONLY layers, a `spec_info.custom_mask` ([n, prefix + n] per request) when given,
  a sliding window when the layer has one.
- `Tensor.record_stream` with the CPU "stream" raises (`dspark_worker_v2.py`
  `_forward_decode`): a no-op for CPU tensors, which have no streams to order.
"""

from __future__ import annotations

import torch

from specforge_dspark.engines.cpu import sglang_dflash as sglang_cpu_dflash
from specforge_dspark.engines.cpu import sglang_inkling as sglang_cpu_inkling
from specforge_dspark.engines.cpu import sglang_tp as sglang_cpu_tp

SPECULATIVE_HOOK = "sglang.srt.arg_groups.speculative_hook"
TORCH_NATIVE = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"


def register() -> None:
    from sglang.srt.arg_groups.choices import DRAFT_ATTENTION_BACKEND_CHOICES
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{SPECULATIVE_HOOK}._handle_dspark", handle_dspark, HookType.AROUND)
    HookRegistry.register(f"{TORCH_NATIVE}.forward_extend", verify_extend, HookType.AROUND)
    if "torch_native" not in DRAFT_ATTENTION_BACKEND_CHOICES:  # one list, imported by name
        DRAFT_ATTENTION_BACKEND_CHOICES.append("torch_native")
    if not getattr(torch.Tensor.record_stream, "_cpu_noop", False):
        torch.Tensor.record_stream = _record_stream_cpu_noop(torch.Tensor.record_stream)
    sglang_cpu_inkling.register()
    sglang_cpu_dflash.register(handle_dspark)
    sglang_cpu_tp.register()


def _record_stream_cpu_noop(original):
    def record_stream(self, stream):
        if self.device.type == "cpu":
            return None
        return original(self, stream)

    record_stream._cpu_noop = True
    return record_stream


def handle_dspark(original, server_args):
    """Run SGLang's DSPARK argument checks with its device gate seeing a GPU, then turn
    overlap scheduling off as SGLang's EAGLE/NGRAM handlers do on CPU."""
    if server_args.device != "cpu":
        return original(server_args)
    from sglang.srt.arg_groups import speculative_hook

    real_view = speculative_hook.resolving_view
    speculative_hook.resolving_view = lambda args: _SeenAsCuda(real_view(args))
    try:
        result = original(server_args)
    finally:
        speculative_hook.resolving_view = real_view
    speculative_hook._disable_overlap_schedule_for_cpu(server_args)
    return result


class _SeenAsCuda:
    """A read view of ServerArgs whose `device` reads "cuda" (ServerArgs is immutable)."""

    def __init__(self, view):
        self._view = view

    def __getattr__(self, name: str):
        return "cuda" if name == "device" else getattr(self._view, name)


def verify_extend(original, self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    """TorchNativeAttnBackend.forward_extend, with a TARGET_VERIFY path (see the module
    docstring). q: [B*n, Hq*D] for B requests of n new tokens each."""
    if not forward_batch.forward_mode.is_target_verify():
        return original(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
    from sglang.srt.layers.attention import torch_native_backend as tnb

    cache_loc = forward_batch.out_cache_loc
    if save_kv_cache and k is not None and v is not None:
        loc = tnb.KVWriteLoc(cache_loc, self.swa_out_cache_loc)
        self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)
    k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)  # [slots, Hkv, D]
    v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
    req_to_token = self.req_to_token_pool.req_to_token
    B = len(forward_batch.req_pool_indices)
    n = q.shape[0] // B
    q_ = q.view(B, n, layer.tp_q_head_num, layer.qk_head_dim)
    o = q.new_empty(B, n, layer.tp_q_head_num, layer.v_head_dim)
    causal = not (layer.is_cross_attention or layer.attn_type == tnb.AttentionType.ENCODER_ONLY)
    window = layer.sliding_window_size if (layer.sliding_window_size or -1) > -1 else None
    custom = getattr(forward_batch.spec_info, "custom_mask", None)
    mask_at = 0
    prefix = forward_batch.seq_lens.tolist()
    rows = forward_batch.req_pool_indices.tolist()
    for b in range(B):
        P = prefix[b]
        kv = torch.cat([req_to_token[rows[b], :P].long(), cache_loc[b * n : (b + 1) * n].long()])
        keys = k_cache[kv].movedim(0, 1).to(q.dtype)  # [Hkv, P+n, D]
        values = v_cache[kv].movedim(0, 1).to(q.dtype)
        pos_q = torch.arange(P, P + n, device=q.device)[:, None]  # [n, 1]
        pos_k = torch.arange(P + n, device=q.device)[None, :]  # [1, P+n]
        allowed = pos_k <= pos_q if causal else torch.ones(n, P + n, dtype=torch.bool)
        if window is not None:
            allowed = allowed & (pos_k > pos_q - window - 1)
        if custom is not None:
            allowed = custom[mask_at : mask_at + n * (P + n)].view(n, P + n).bool()
            mask_at += n * (P + n)
        out = torch.nn.functional.scaled_dot_product_attention(
            q_[b].movedim(0, 1).unsqueeze(0),  # [1, Hq, n, D]
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=allowed.to(q.device),
            scale=layer.scaling,
            enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
        )
        o[b] = out.squeeze(0).movedim(0, 1)
    return o.view(B * n, layer.tp_q_head_num * layer.v_head_dim)
