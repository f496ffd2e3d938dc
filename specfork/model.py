"""Llama-family forward (Llama 2/3/3.1, Mistral, Qwen2, SmolLM2; GQA) over the paged KV tree.

Weights are borrowed from a transformers model (no copies). One entry point, `forward`, covers
prefill, decode and tree verification: new tokens at explicit positions attend to a gathered
prefix plus each other under a mask, and their K/V are written into KV-tree slots.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specfork.kernels.tree_attention import tree_attention, tree_attention_torch
from specfork.errors import SpecforkError
from specfork.kv_tree import BlockPool

SUPPORTED = ("llama", "mistral", "qwen2")


class UnsupportedModel(SpecforkError):
    pass


@dataclass
class Layer:
    ln1: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    ln2: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """As HF: normalise in fp32, scale in the model dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[T, heads, D]`, cos/sin `[T, D]` (HF's rotate-half convention)."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


class Model:
    """Plain-tensor forward of a causal LM whose K/V live in a `BlockPool`."""

    def __init__(self, hf):
        cfg = hf.config
        if cfg.model_type not in SUPPORTED:
            raise UnsupportedModel(f"model type '{cfg.model_type}' is not supported "
                                   f"(supported: {', '.join(SUPPORTED)})")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"activation '{cfg.hidden_act}' is not supported")
        self.hf = hf
        self.config = cfg
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = cfg.vocab_size
        self.eps = cfg.rms_norm_eps
        self.max_positions = cfg.max_position_embeddings
        self.scale = self.head_dim ** -0.5
        body = hf.model
        self.embed = body.embed_tokens.weight
        self.norm = body.norm.weight
        self.lm_head = hf.lm_head.weight
        self.rotary = body.rotary_emb
        self.dtype, self.device = self.embed.dtype, self.embed.device

        def bias(m):
            return None if m.bias is None else m.bias

        self.layers = []
        for blk in body.layers:
            a, m = blk.self_attn, blk.mlp
            self.layers.append(Layer(
                ln1=blk.input_layernorm.weight, wq=a.q_proj.weight, wk=a.k_proj.weight,
                wv=a.v_proj.weight, bq=bias(a.q_proj), bk=bias(a.k_proj), bv=bias(a.v_proj),
                wo=a.o_proj.weight, bo=bias(a.o_proj), ln2=blk.post_attention_layernorm.weight,
                w_gate=m.gate_proj.weight, w_up=m.up_proj.weight, w_down=m.down_proj.weight))

    def make_pool(self, num_blocks: int | None = None, max_bytes: int | None = None,
                  block_size: int = 16) -> BlockPool:
        return BlockPool(self.num_layers, self.kv_heads, self.head_dim, block_size=block_size,
                         num_blocks=num_blocks, max_bytes=max_bytes, dtype=self.dtype,
                         device=self.device)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin `[T, D]` from the HF rotary module itself (covers Llama 3.1 scaling etc.)."""
        cos, sin = self.rotary(self.embed[:1], positions[None])
        return cos[0], sin[0]

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, pool: BlockPool,
                prefix_slots: torch.Tensor, write_slots: torch.Tensor | None = None,
                write_src: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
                prefix_mask: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                logits_idx: torch.Tensor | slice | None = None) -> torch.Tensor:
        """Logits `[T', V]` for `tokens [T]` at `positions [T]`.

        Each new token attends to the pool slots `prefix_slots [L]` (all of them, or those where
        `prefix_mask [T, L]` is True) and to the new tokens where `tree_mask [T, T]` is True
        (None: every new token sees every other — use it only for T=1). The new K/V row
        `write_src[i]` (default i) is written to slot `write_slots[i]`; a tree node that lies on
        several draft forks is written once per fork. `block_table` (paged prefix, GPU path)
        may stand in for `prefix_slots`.
        """
        T = tokens.shape[0]
        H, KVH, D = self.num_heads, self.kv_heads, self.head_dim
        x = self.embed[tokens]                                           # [T, hidden]
        cos, sin = self.rope(positions)
        use_kernel = block_table is not None and prefix_mask is None
        for i, ly in enumerate(self.layers):
            h = rms_norm(x, ly.ln1, self.eps)
            q = apply_rope(F.linear(h, ly.wq, ly.bq).view(T, H, D), cos, sin)
            k = apply_rope(F.linear(h, ly.wk, ly.bk).view(T, KVH, D), cos, sin)
            v = F.linear(h, ly.wv, ly.bv).view(T, KVH, D)
            kf, vf = pool.layer_slots(i)                                # [slots, KVH, D]
            if use_kernel:
                a = tree_attention(q, pool.k[i], pool.v[i], block_table, prefix_slots.numel(),
                                   k, v, tree_mask, self.scale)
            elif prefix_mask is None:
                a = tree_attention_torch(q, kf.index_select(0, prefix_slots),
                                         vf.index_select(0, prefix_slots), k, v,
                                         tree_mask, self.scale)
            else:
                a = _masked_attention(q, kf.index_select(0, prefix_slots),
                                      vf.index_select(0, prefix_slots), k, v,
                                      prefix_mask, tree_mask, self.scale)
            if write_slots is not None:
                src = slice(None) if write_src is None else write_src
                kf[write_slots] = k[src]
                vf[write_slots] = v[src]
            x = x + F.linear(a.reshape(T, H * D), ly.wo, ly.bo)
            h = rms_norm(x, ly.ln2, self.eps)
            x = x + F.linear(F.silu(F.linear(h, ly.w_gate)) * F.linear(h, ly.w_up), ly.w_down)
        if logits_idx is not None:
            x = x[logits_idx]
        return F.linear(rms_norm(x, self.norm, self.eps), self.lm_head)


def _masked_attention(q, k_prefix, v_prefix, k_new, v_new, prefix_mask, tree_mask, scale):
    """Queries that each see their own subset of a shared prefix (beams over a KV tree)."""
    T = q.shape[0]
    k = torch.cat([k_prefix, k_new]).transpose(0, 1)
    v = torch.cat([v_prefix, v_new]).transpose(0, 1)
    if tree_mask is None:
        tree_mask = torch.eye(T, dtype=torch.bool, device=q.device)
    mask = torch.cat([prefix_mask, tree_mask], dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[0])
    return out.transpose(0, 1)


def causal_mask(T: int, device=None) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()
