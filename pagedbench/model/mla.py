"""Multi-head latent attention (DeepSeek-V3), run absorbed over the paged latent cache.

Each token caches one latent per layer, shared by every head: the normalized kv_lora_rank
compression and the rotated qk_rope_head_dim key part, as one "KV head" of latent_dim numbers.
The key up-projection W_UK (kv_b_proj's key rows) is folded into the query, so H query heads of
latent_dim meet that single head: scores = (q_nope W_UK) . latent + q_rope . k_rope, which is
transformers' q . k with k = [W_UK latent, k_rope]. The values are the latent's first
kv_lora_rank dims (a view of the same pages) and the value up-projection W_UV comes after
attention. Module names are Hugging Face's, so checkpoints load by name; tensor parallelism shards
the heads and replicates the latent, as vLLM does.
"""

import torch
from einops import rearrange
from torch import nn

from pagedbench.model.config import ModelConfig
from pagedbench.model.fused import EAGER, LayerOps
from pagedbench.model.layers import AttentionContext, RMSNorm, column_parallel, row_parallel
from pagedbench.model.parallel import TPShard, all_reduce
from pagedbench.model.sparse_index import Indexer

LORA_NORM_EPS = 1e-6  # transformers builds the q_a / kv_a norms with RMSNorm's default eps, not rms_norm_eps


class MLAAttention(nn.Module):
    """This rank's heads [h0, h0 + H) of a latent-attention layer; the latent is computed in full."""

    ops: LayerOps = EAGER

    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPShard):
        super().__init__()
        self.layer_idx, self.tp, self.mla = layer_idx, tp, cfg.mla
        m, h = cfg.mla, cfg.hidden_size
        h0, self.num_heads = tp.heads(cfg.num_heads)

        def per_head(rows: int, inputs: int) -> nn.Linear:  # rows per head, this rank's heads
            return column_parallel(inputs, cfg.num_heads * rows, h0 * rows, self.num_heads * rows, bias=False)

        if m.q_lora_rank is None:
            self.q_proj = per_head(m.qk_head_dim, h)
        else:
            self.q_a_proj = nn.Linear(h, m.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = per_head(m.qk_head_dim, m.q_lora_rank)
        self.kv_a_proj_with_mqa = nn.Linear(h, m.latent_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = per_head(m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        self.o_proj = row_parallel(cfg.num_heads * m.v_head_dim, h, h0 * m.v_head_dim, self.num_heads * m.v_head_dim)
        # DeepSeek-V3.2: an indexer picks the tokens attention reads (every rank computes it whole)
        self.indexer = Indexer(cfg, layer_idx) if cfg.indexer is not None else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext) -> torch.Tensor:
        m = self.mla
        q_resid = None if m.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_proj(x) if q_resid is None else self.q_b_proj(q_resid)
        q_nope, q_rope = rearrange(q, "t (h d) -> t h d", d=m.qk_head_dim).split(
            [m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1
        )
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        k_rope = k_rope[:, None]  # [T, 1, rope]: one key part for every head
        q_rope, k_rope = self.ops.latent_rope(q_rope, k_rope, *rope, m.rope_interleave)
        # kv_b_proj's rows per head: W_UK [H, nope, rank], then W_UV [H, v, rank] (views, no copy)
        w_uk, w_uv = self.kv_b_proj.weight.view(self.num_heads, -1, m.kv_lora_rank).split(
            [m.qk_nope_head_dim, m.v_head_dim], dim=1
        )
        query = torch.cat((torch.einsum("thn,hnr->thr", q_nope, w_uk), q_rope), dim=-1)  # [T, H, latent_dim]
        key = torch.cat((self.kv_a_layernorm(latent)[:, None], k_rope), dim=-1)  # [T, 1, latent_dim]
        selected = None if self.indexer is None else self.indexer(x, q_resid, rope, ctx)  # [T, topk] slots
        out = ctx.attend(self.layer_idx, query, key, None, selected=selected)  # [T, H, kv_lora_rank]
        out = torch.einsum("thr,hvr->thv", out, w_uv)
        return all_reduce(self.o_proj(rearrange(out, "t h v -> t (h v)")), self.tp)
