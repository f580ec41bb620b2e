"""Building blocks shared by the drafter networks (torch only): `dspark.py` and `dflash.py`
assemble them; `context_kv` (the context's keys and values, once per layer) then
`decode_blocks` (any number of times, one per chunk of blocks) is the one decoder pass
both run.

Each block matches the SGLang 0.5.23 module it is served by (see dspark.py's docstring
for the files checked). The layers read their sizes from any object with the attributes
of `DecoderConfig` / `HeadsConfig` (the kinds' config dataclasses): this file imports no
drafter module.

Shape legend:
  B batch, S context positions, N blocks (anchors) per sequence, G block size,
  Q = N*G block queries, K = S + Q keys, T any number of rows, H hidden,
  A attention heads, C key/value heads, E head_dim, V vocab rows, R Markov rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from specforge_dspark.drafters.rope import rope_tables


class DecoderConfig(Protocol):
    """What the decoder layers read from a drafter's config."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict
    layer_types: list[str]


class HeadsConfig(Protocol):
    """What the Markov and confidence heads read from a drafter's config."""

    hidden_size: int
    vocab_size: int
    markov_rank: int
    markov_head_type: str
    confidence_head_with_markov: bool


class RMSNorm(nn.Module):
    """SGLang `RMSNorm.forward_native`: statistics and weight multiply in (at least) fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 in exact tests
        xw = x.to(wide)
        xw = xw * torch.rsqrt(xw.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xw * self.weight.to(wide)).to(x.dtype)


def apply_rope(x_BTnE: torch.Tensor, cos_BTe: torch.Tensor, sin_BTe: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation of the two halves of each head (cos/sin cast to x's dtype)."""
    cos, sin = cos_BTe[:, :, None].to(x_BTnE.dtype), sin_BTe[:, :, None].to(x_BTnE.dtype)
    x1, x2 = x_BTnE.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    """Qwen3 GQA attention with KV injection: block queries over [context ; block] keys."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        H, A, C, E = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = A, C, E
        self.q_proj = nn.Linear(H, A * E, bias=False)
        self.k_proj = nn.Linear(H, C * E, bias=False)
        self.v_proj = nn.Linear(H, C * E, bias=False)
        self.o_proj = nn.Linear(A * E, H, bias=False)
        self.q_norm = RMSNorm(E, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(E, cfg.rms_norm_eps)

    def keys_values(self, x_BTH: torch.Tensor, rope: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[B, A, T, E]` of rows x (k_proj -> k_norm -> RoPE; v_proj), the
        KV heads repeated for their query heads (head h uses KV head h // (A / C)): the
        layout SDPA takes, which keeps its fused kernels eligible."""
        B, T, _ = x_BTH.shape
        k_BTCE = apply_rope(self.k_norm(self.k_proj(x_BTH).view(B, T, -1, self.head_dim)), *rope)
        v_BTCE = self.v_proj(x_BTH).view(B, T, -1, self.head_dim)
        group = self.heads // self.kv_heads
        return tuple(x.transpose(1, 2).repeat_interleave(group, 1) for x in (k_BTCE, v_BTCE))

    def forward(
        self,
        x_BQH: torch.Tensor,
        kv_ctx: tuple[torch.Tensor, torch.Tensor],
        rope_blk: tuple,
        visible_B1QK: torch.Tensor,
        empty_B1Q1: torch.Tensor,
        attend: Attend | None = None,
    ) -> torch.Tensor:
        """kv_ctx: this layer's context keys and values `[B, A, S, E]` (`keys_values` of the
        context, computed once for every chunk of blocks); `attend`: `attend_local`, or the
        sequence-parallel attention over every rank's keys (objective/sequence_parallel.py)."""
        B, Q, _ = x_BQH.shape
        q_BQAE = apply_rope(
            self.q_norm(self.q_proj(x_BQH).view(B, Q, -1, self.head_dim)), *rope_blk
        )
        k_blk, v_blk = self.keys_values(x_BQH, rope_blk)
        k_BAKE = torch.cat((kv_ctx[0], k_blk), 2)
        v_BAKE = torch.cat((kv_ctx[1], v_blk), 2)
        qkv = (q_BQAE.transpose(1, 2), k_BAKE, v_BAKE, visible_B1QK, empty_B1Q1)
        o_BAQE = attend_local(*qkv) if attend is None else attend(*qkv, local=attend_local)
        return self.o_proj(o_BAQE.transpose(1, 2).reshape(B, Q, -1))


Attend = Callable[..., torch.Tensor]
"""(q `[B, A, Q, E]`, k and v `[B, A, K, E]`, visible `[B, 1, Q, K]`, empty `[B, 1, Q, 1]`,
local=`attend_local`) -> attention output `[B, A, Q, E]`: the layer passes its own local
attention for the function to run over every rank's keys."""


def attend_local(
    q_BAQE: torch.Tensor,
    k_BAKE: torch.Tensor,
    v_BAKE: torch.Tensor,
    visible_B1QK: torch.Tensor,
    empty_B1Q1: torch.Tensor,
) -> torch.Tensor:
    """Masked attention of block queries over their keys; a row that may see nothing
    (`empty`, given key 0 by `decode_blocks`) attends to 0."""
    o_BAQE = F.scaled_dot_product_attention(q_BAQE, k_BAKE, v_BAKE, attn_mask=visible_B1QK)
    return o_BAQE.masked_fill(empty_B1Q1, 0.0)


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x_BQH: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x_BQH)) * self.up_proj(x_BQH))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x_BQH: torch.Tensor, kv_ctx: tuple, *attn_args) -> torch.Tensor:
        x_BQH = x_BQH + self.self_attn(self.input_layernorm(x_BQH), kv_ctx, *attn_args)
        return x_BQH + self.mlp(self.post_attention_layernorm(x_BQH))


def build_visibility_mask(
    anchors_BN: torch.Tensor,
    block_valid_BN: torch.Tensor,
    ctx_valid_BS: torch.Tensor,
    block_size: int,
    starts_BN: torch.Tensor | None = None,
) -> torch.Tensor:
    """Who each block query may attend to: bool `[B, N*G, S + N*G]`, True = visible.

    Context key c is visible to block j iff starts[j] <= c < anchors[j], ctx_valid[c] and
    block_valid[j] (the anchor itself has no hidden state yet; `starts_BN`: the first
    position of each anchor's conversation in a packed row, training/packing.py; None =
    0). Block keys are visible iff in the same block and the block is valid
    (bidirectional inside a block); blocks never see each other.
    """
    B, N = anchors_BN.shape
    S, G = ctx_valid_BS.shape[1], block_size
    c_S = torch.arange(S, device=anchors_BN.device)
    ctx_BNS = (c_S < anchors_BN[..., None]) & ctx_valid_BS[:, None, :].bool()
    if starts_BN is not None:
        ctx_BNS = ctx_BNS & (c_S >= starts_BN[..., None])
    ctx_BNS = ctx_BNS & block_valid_BN[..., None].bool()
    ctx_BQS = ctx_BNS[:, :, None, :].expand(B, N, G, S).reshape(B, N * G, S)
    block_of_Q = torch.arange(N * G, device=anchors_BN.device) // G
    same_QQ = block_of_Q[:, None] == block_of_Q[None, :]
    valid_BQ = block_valid_BN.bool().repeat_interleave(G, dim=1)
    blk_BQQ = same_QQ[None] & valid_BQ[:, :, None] & valid_BQ[:, None, :]
    return torch.cat((ctx_BQS, blk_BQQ), dim=-1)


Masks = dict[str, torch.Tensor] | torch.Tensor
"""Attention visibility of block queries (bool `[B, Q, K]`, True = visible) by layer type,
or one tensor for drafters whose layers are all "full_attention"."""


class Decoder(Protocol):
    """What `context_kv` and `decode_blocks` read from a drafter network (SGLang's weight
    names)."""

    config: DecoderConfig
    layers: nn.ModuleList
    norm: RMSNorm


ContextKV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per draft layer, the context's keys and values `[B, A, S, E]` (`context_kv`)."""


def context_kv(drafter: Decoder, ctx_BSH: torch.Tensor, ctx_pos_BS: torch.Tensor) -> ContextKV:
    """Each layer's keys and values of the S context positions, computed once for all the
    blocks decoded over this context: the layer's k_proj / v_proj applied to the context
    features as they are (SGLang's KV injection skips input_layernorm), then k_norm, then
    RoPE at `ctx_pos_BS`. Differentiable: gradients reach k_proj, v_proj, k_norm and,
    through ctx_BSH, the context features' fc and hidden_norm."""
    cfg, dtype = drafter.config, drafter.norm.weight.dtype
    rope_ctx = rope_tables(ctx_pos_BS, cfg.head_dim, cfg.rope_theta, dtype, cfg.rope_scaling)
    ctx_BSH = ctx_BSH.to(dtype)
    return [layer.self_attn.keys_values(ctx_BSH, rope_ctx) for layer in drafter.layers]


def decode_blocks(
    drafter: Decoder,
    kv_ctx: ContextKV,
    block_emb_BNGH: torch.Tensor,
    block_pos_BNG: torch.Tensor,
    masks: Masks,
    attend: Attend | None = None,
    ranks: int = 1,
) -> torch.Tensor:
    """The decoder pass of a drafter over blocks (its `layers`, then its final `norm`):
    final-normed hidden states `[B, N, G, H]` of every block row.

    kv_ctx: `context_kv` of the context these blocks attend to (any chunk of the blocks
    over one context reuses it); block_emb: frozen target embeddings of the block tokens;
    keys are the S context positions then the N*G block positions. Layer i attends with
    `masks[drafter.config.layer_types[i]]` (bool `[B, Q, K]`, True = visible; one tensor:
    every layer's). A query with no visible key gets attention output 0.
    attend, ranks: sequence parallelism over `ranks` ranks (objective/sequence_parallel.py):
    `attend` sees every rank's queries and keys, so `masks` cover `[B, ranks*Q,
    ranks*(S+Q)]` in that function's order; None, 1: this rank's alone (`attend_local`).
    """
    if isinstance(masks, torch.Tensor):
        masks = {"full_attention": masks}
    B, N, G, H = block_emb_BNGH.shape
    S, Q = kv_ctx[0][0].shape[2], N * G
    cfg, norm = drafter.config, drafter.norm
    dtype = norm.weight.dtype
    rope_blk = rope_tables(
        block_pos_BNG.reshape(B, Q), cfg.head_dim, cfg.rope_theta, dtype, cfg.rope_scaling
    )
    args = {}
    for kind, visible_BQK in masks.items():
        if visible_BQK.shape != (B, ranks * Q, ranks * (S + Q)):
            raise ValueError(
                f"visible_BQK ({kind}) has shape {tuple(visible_BQK.shape)}, "
                f"expected {(B, ranks * Q, ranks * (S + Q))}"
            )
        empty_BQ = ~visible_BQK.any(-1)
        # SDPA turns a row with no visible key into NaN: give it key 0, zero its output.
        visible_BQK = visible_BQK.clone()
        visible_BQK[..., 0] |= empty_BQ
        args[kind] = (rope_blk, visible_BQK[:, None], empty_BQ[:, None, :, None], attend)
    x_BQH = block_emb_BNGH.reshape(B, Q, H).to(dtype)
    for layer, kv, kind in zip(drafter.layers, kv_ctx, cfg.layer_types, strict=True):
        x_BQH = layer(x_BQH, kv, *args[kind])
    return norm(x_BQH).view(B, N, G, H)


def normal_init_(module: nn.Module, std: float) -> nn.Module:
    """Every Linear and Embedding weight of `module` N(0, std), biases 0 (norms keep their
    ones): transformers' `_init_weights` for a config with initializer_range `std`."""
    for m in module.modules():
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, 0.0, std)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
    return module


class MarkovHead(nn.Module):
    """Bias on a slot's logits from the previous token (SGLang VanillaMarkov / Gated / RNN).

    vanilla: z = W1[prev]; gated: z = sigmoid(gate_proj([h ; W1[prev]])) * W1[prev];
    rnn: [g, c, o] = joint_proj([s ; W1[prev] ; h]), z = tanh(o),
    s' = sigmoid(g) s + (1 - sigmoid(g)) tanh(c), with s = 0 before slot 0. The bias is W2 z.
    """

    def __init__(self, cfg: HeadsConfig) -> None:
        super().__init__()
        H, V, R = cfg.hidden_size, cfg.vocab_size, cfg.markov_rank
        self.kind = cfg.markov_head_type
        self.markov_w1 = nn.Embedding(V, R)
        self.markov_w2 = nn.Linear(R, V, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(H + R, R)
        if self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * R + H, 3 * R)

    def init_state(self, h_TH: torch.Tensor) -> torch.Tensor | None:
        if self.kind != "rnn":
            return None
        return h_TH.new_zeros(*h_TH.shape[:-1], self.markov_w1.embedding_dim)

    def step(
        self, e_TR: torch.Tensor, h_TH: torch.Tensor, state_TR: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Latent z of one slot from its prev-token embedding e = W1[prev] and hidden h."""
        if self.kind == "vanilla":
            return e_TR, state_TR
        if self.kind == "gated":
            gate_TR = torch.sigmoid(self.gate_proj(torch.cat((h_TH, e_TR.to(h_TH.dtype)), -1)))
            return gate_TR.to(e_TR.dtype) * e_TR, state_TR
        gate, cand, out = self.joint_proj(torch.cat((state_TR, e_TR, h_TH), -1)).chunk(3, -1)
        gate = torch.sigmoid(gate)
        return torch.tanh(out), gate * state_TR + (1.0 - gate) * torch.tanh(cand)

    def latents(
        self, prev_BNG: torch.Tensor, h_BNGH: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced (W1[prev], z) for every slot: `[B, N, G, R]` each."""
        e_BNGR = self.markov_w1(prev_BNG)
        if self.kind != "rnn":
            return e_BNGR, self.step(e_BNGR, h_BNGH, None)[0]
        state, z = self.init_state(h_BNGH[:, :, 0]), []
        for k in range(prev_BNG.shape[-1]):
            z_k, state = self.step(e_BNGR[:, :, k], h_BNGH[:, :, k], state)
            z.append(z_k)
        return e_BNGR, torch.stack(z, dim=2)

    def bias(self, z_TR: torch.Tensor, vocab: int) -> torch.Tensor:
        """W2 z over the first `vocab` columns (all LM-head rows unless a caller crops)."""
        return F.linear(z_TR, self.markov_w2.weight[:vocab])


class ConfidenceHead(nn.Module):
    """Acceptance logit of each slot from [h ; W1[prev]] (or h alone)."""

    def __init__(self, cfg: HeadsConfig) -> None:
        super().__init__()
        self.with_markov = cfg.confidence_head_with_markov
        extra = cfg.markov_rank if self.with_markov else 0
        self.proj = nn.Linear(cfg.hidden_size + extra, 1)

    def forward(self, h_TH: torch.Tensor, e_TR: torch.Tensor) -> torch.Tensor:
        feats = torch.cat((h_TH, e_TR.to(h_TH.dtype)), -1) if self.with_markov else h_TH
        return self.proj(feats).squeeze(-1)
