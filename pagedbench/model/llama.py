"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3; DeepSeek-V3 with latent
attention, mla.py; the MoE layers of Mixtral, Qwen3-MoE and DeepSeek-V3, moe.py) over one flat,
unpadded token batch.

Module names match Hugging Face's so checkpoints load by name. Gemma differs in a few switches
(`cfg.gemma`): RMSNorm scales by 1 + weight, every block has norms before and after, embeddings
are scaled by sqrt(hidden_size), the MLP uses GeLU-tanh, final logits may be soft-capped, and
Gemma 3's sliding-window layers have their own RoPE base. Attention goes through the step's
`AttentionContext`: the KV write is shared code, the attention itself is the layer's backend's.
A pipeline stage (PPStage) builds only its own layers (the others are MissingLayer placeholders,
so parameter names stay the checkpoint's), the embedding on the first stage, the final norm and
LM head on the last.
"""

import torch
from einops import rearrange
from torch import nn

from pagedbench.model.config import ModelConfig
from pagedbench.model.layers import (
    MLP,
    AttentionContext,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
    apply_rope,
    column_parallel,
    row_parallel,
)
from pagedbench.model.mla import MLAAttention
from pagedbench.model.moe import SparseMoE
from pagedbench.model.parallel import NO_TP, WHOLE_MODEL, PPStage, TPShard, all_reduce, gather_vocab, shard_param


class Attention(nn.Module):
    """This rank's heads: q heads [h0, h0 + H), KV heads [k0, k0 + H_kv) (all of them at tp=1)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPShard):
        super().__init__()
        self.layer_idx, self.tp = layer_idx, tp
        d, h = cfg.head_dim, cfg.hidden_size
        (h0, self.num_heads), (k0, self.num_kv_heads) = tp.heads(cfg.num_heads), tp.kv_heads(cfg.num_kv_heads)
        self.head_dim = d
        self.q_proj = column_parallel(h, cfg.num_heads * d, h0 * d, self.num_heads * d, cfg.qkv_bias)
        self.k_proj = column_parallel(h, cfg.num_kv_heads * d, k0 * d, self.num_kv_heads * d, cfg.qkv_bias)
        self.v_proj = column_parallel(h, cfg.num_kv_heads * d, k0 * d, self.num_kv_heads * d, cfg.qkv_bias)
        self.o_proj = row_parallel(cfg.num_heads * d, h, h0 * d, self.num_heads * d, cfg.o_proj_bias, tp.rank)
        if cfg.attention_sinks:  # gpt-oss: a learned logit per query head in the softmax denominator
            self.sinks = nn.Parameter(torch.empty(self.num_heads))
            shard_param(self.sinks, 0, h0, self.num_heads, cfg.num_heads)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.gemma)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.gemma)
        self.qk_norm = cfg.qk_norm

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext) -> torch.Tensor:
        q = rearrange(self.q_proj(x), "t (h d) -> t h d", d=self.head_dim)
        k = rearrange(self.k_proj(x), "t (h d) -> t h d", d=self.head_dim)
        v = rearrange(self.v_proj(x), "t (h d) -> t h d", d=self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = ctx.attend(self.layer_idx, q, k, v, getattr(self, "sinks", None))
        return all_reduce(self.o_proj(rearrange(out, "t h d -> t (h d)")), self.tp)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPShard):
        super().__init__()
        self.self_attn = (Attention if cfg.mla is None else MLAAttention)(cfg, layer_idx, tp)
        # The feed-forward block, under the checkpoint's name: a dense MLP or an MoE layer (moe.py).
        self.ffn_name = cfg.moe.block_name if cfg.is_moe_layer(layer_idx) else "mlp"
        setattr(self, self.ffn_name, SparseMoE(cfg, tp) if cfg.is_moe_layer(layer_idx) else MLP(cfg, tp))
        self.gemma = cfg.gemma

        def norm():
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma)

        self.input_layernorm = norm()
        # Llama: the norm before the MLP. Gemma: the norm after attention, with two around the MLP.
        self.post_attention_layernorm = norm()
        if cfg.gemma:
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext) -> torch.Tensor:
        if not self.gemma:
            x = x + self.self_attn(self.input_layernorm(x), rope, ctx)
            return x + self._ffn(self.post_attention_layernorm(x), ctx)
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, ctx))
        return x + self.post_feedforward_layernorm(self._ffn(self.pre_feedforward_layernorm(x), ctx))

    def _ffn(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """The feed-forward block; an MoE layer's is a "moe" span of the timer."""
        ffn = getattr(self, self.ffn_name)
        start = ctx.timer.mark() if isinstance(ffn, SparseMoE) and ctx.timer is not None else None
        out = ffn(x)
        if start is not None:
            ctx.timer.span("moe", start)
        return out


class MissingLayer(nn.Module):
    """A layer another pipeline stage holds (vLLM's PPMissingLayer)."""


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPShard, stage: PPStage = WHOLE_MODEL):
        super().__init__()
        self.stage = stage
        self.rotary_emb = RotaryEmbedding(cfg, max_positions)
        # Gemma 3's sliding-window layers rotate with their own base.
        self.local_rope = cfg.local_rope_theta is not None and cfg.local_rope_theta != cfg.rope_theta
        if self.local_rope:
            self.rotary_emb_local = RotaryEmbedding(cfg, max_positions, local=True)
        self.sliding = [cfg.is_sliding(i) for i in range(cfg.num_layers)]
        if stage.first:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.embed_scale = cfg.hidden_size**0.5 if cfg.gemma else None
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, tp) if stage.owns(i) else MissingLayer() for i in range(cfg.num_layers)
        )
        self.own_layers = list(stage.layers(cfg.num_layers))
        if stage.last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext, hidden: torch.Tensor | None
    ) -> torch.Tensor:
        """The stage's layers over the embedded `input_ids` (first stage) or the previous stage's
        `hidden` [T, hidden_size]; the last stage's output is normed."""
        x = self.embed_tokens(input_ids) if hidden is None else hidden
        if self.embed_scale is not None and hidden is None:  # Gemma rounds the scale to the activations' dtype
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        rope = self.rotary_emb(positions, x.dtype)
        local = self.rotary_emb_local(positions, x.dtype) if self.local_rope else rope
        for i in self.own_layers:
            x = self.layers[i](x, local if self.sliding[i] else rope, ctx)
        return self.norm(x) if self.stage.last else x


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPShard = NO_TP, stage: PPStage = WHOLE_MODEL):
        super().__init__()
        self.config, self.tp, self.stage = cfg, tp, stage  # a tp that divides the model (the engine validates it)
        self.model = DecoderModel(cfg, max_positions, tp, stage)
        if stage.last:
            start, length = tp.chunk(cfg.vocab_size)
            self.lm_head = column_parallel(cfg.hidden_size, cfg.vocab_size, start, length, bias=False)
        if stage.last and stage.first and cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # A last stage without the embedding loads the tied weight into its LM head (loader.py).

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        logits_indices: torch.Tensor,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """input_ids, positions [T] -> fp32 logits [len(logits_indices), vocab] of the chosen tokens
        only (on tensor-parallel rank 0; None on the other ranks). A pipeline stage before the last
        returns its hidden states [T, hidden_size] for the next; a stage after the first starts
        from the previous one's `hidden`."""
        hidden = self.model(input_ids, positions, ctx, hidden)
        if not self.stage.last:
            return hidden
        logits = gather_vocab(self.lm_head(hidden[logits_indices]).float(), self.config.vocab_size, self.tp)
        cap = self.config.final_softcap
        return logits if logits is None or cap is None else torch.tanh(logits / cap) * cap
