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

import contextlib

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from pagedbench.model.batch_invariant import BatchInvariantGemms
from pagedbench.model.config import ModelConfig
from pagedbench.model.fused import EAGER, LayerOps
from pagedbench.model.hybrid import GatedDeltaNet
from pagedbench.model.layers import (
    MLP,
    AttentionContext,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
    column_parallel,
    merge_linears,
    row_parallel,
)
from pagedbench.model.mla import MLAAttention
from pagedbench.model.moe import SparseMoE
from pagedbench.model.parallel import NO_TP, WHOLE_MODEL, PPStage, TPShard, all_reduce, gather_vocab, shard_param


class Attention(nn.Module):
    """This rank's heads: q heads [h0, h0 + H), KV heads [k0, k0 + H_kv) (all of them at tp=1).
    q, k and v as one GEMM over merged weights (merge_linears) unless the model runs them apart.
    With an output gate (Qwen3.5, Qwen3-Next), q_proj yields each head's query and gate side by
    side ([q | gate] per head) and the attention output is multiplied by sigmoid(gate)."""

    ops: LayerOps = EAGER
    merged = True

    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPShard):
        super().__init__()
        self.layer_idx, self.tp = layer_idx, tp
        d, h = cfg.head_dim, cfg.hidden_size
        (h0, self.num_heads), (k0, self.num_kv_heads) = tp.heads(cfg.num_heads), tp.kv_heads(cfg.num_kv_heads)
        self.head_dim, self.gated = d, cfg.attn_output_gate
        q = 2 * d if self.gated else d  # q_proj rows per head
        self.q_proj = column_parallel(h, cfg.num_heads * q, h0 * q, self.num_heads * q, cfg.qkv_bias)
        self.k_proj = column_parallel(h, cfg.num_kv_heads * d, k0 * d, self.num_kv_heads * d, cfg.qkv_bias)
        self.v_proj = column_parallel(h, cfg.num_kv_heads * d, k0 * d, self.num_kv_heads * d, cfg.qkv_bias)
        self.o_proj = row_parallel(cfg.num_heads * d, h, h0 * d, self.num_heads * d, cfg.o_proj_bias, tp.rank)
        if cfg.attention_sinks:  # gpt-oss: a learned logit per query head in the softmax denominator
            self.sinks = nn.Parameter(torch.empty(self.num_heads))
            shard_param(self.sinks, 0, h0, self.num_heads, cfg.num_heads)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.norm_offset)
        self.qk_norm, self.norm_eps, self.gemma = cfg.qk_norm, cfg.rms_norm_eps, cfg.norm_offset
        self.heads = (self.num_heads, self.num_kv_heads, d)
        self.qkv_sizes = [self.num_heads * q, self.num_kv_heads * d, self.num_kv_heads * d]
        self.qkv_weight, self.qkv_bias = merge_linears(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext) -> torch.Tensor:
        if self.merged:
            q, k, v = F.linear(x, self.qkv_weight, self.qkv_bias).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.gated:
            q, gate = rearrange(q, "t (h two d) -> two t (h d)", two=2, d=self.head_dim)
        norms = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
        q, k, v = self.ops.qkv_rope(q, k, v, *rope, self.heads, *norms, self.norm_eps, self.gemma)
        out = rearrange(ctx.attend(self.layer_idx, q, k, v, getattr(self, "sinks", None)), "t h d -> t (h d)")
        return all_reduce(self.o_proj(out * torch.sigmoid(gate) if self.gated else out), self.tp)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPShard):
        super().__init__()
        # The token mixer, under the checkpoint's name: attention (plain, latent or gated) or, in a
        # hybrid model's linear layers, gated DeltaNet (hybrid.py).
        self.mixer_name = "linear_attn" if cfg.is_linear_layer(layer_idx) else "self_attn"
        if cfg.is_linear_layer(layer_idx):
            self.linear_attn = GatedDeltaNet(cfg, layer_idx, tp)
        else:
            self.self_attn = (Attention if cfg.mla is None else MLAAttention)(cfg, layer_idx, tp)
        # The feed-forward block, under the checkpoint's name: a dense MLP or an MoE layer (moe.py).
        self.ffn_name = cfg.moe.block_name if cfg.is_moe_layer(layer_idx) else "mlp"
        setattr(self, self.ffn_name, SparseMoE(cfg, tp) if cfg.is_moe_layer(layer_idx) else MLP(cfg, tp))
        self.gemma = cfg.gemma

        def norm():
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)

        self.input_layernorm = norm()
        # Llama: the norm before the MLP. Gemma: the norm after attention, with two around the MLP.
        self.post_attention_layernorm = norm()
        if cfg.gemma:
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (x, residual), the residual stream carried apart (vLLM's layout) so that
        each add is fused with the norm after it; the first layer gets residual None."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.linear_attn(x, ctx) if self.mixer_name == "linear_attn" else self.self_attn(x, rope, ctx)
        if not self.gemma:
            x, residual = self.post_attention_layernorm(x, residual)
            return self._ffn(x, ctx), residual
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        return self.post_feedforward_layernorm(self._ffn(x, ctx)), residual

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
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)

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
        residual = None
        for i in self.own_layers:
            x, residual = self.layers[i](x, residual, local if self.sliding[i] else rope, ctx)
        if residual is None:  # a stage without layers
            return self.norm(x) if self.stage.last else x
        return self.norm(x, residual)[0] if self.stage.last else x + residual


class CausalLM(nn.Module):
    ops: LayerOps = EAGER
    batch_invariant = False  # every dense GEMM in fixed row tiles (batch_invariant.py); build_model sets it

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
        with BatchInvariantGemms() if self.batch_invariant else contextlib.nullcontext():
            return self._forward(input_ids, positions, ctx, logits_indices, hidden)

    def _forward(self, input_ids, positions, ctx, logits_indices, hidden):
        hidden = self.model(input_ids, positions, ctx, hidden)
        if not self.stage.last:
            return hidden
        logits = gather_vocab(self.lm_head(hidden[logits_indices]).float(), self.config.vocab_size, self.tp)
        cap = self.config.final_softcap
        return logits if logits is None or cap is None else self.ops.softcap(logits, cap)

    def use_ops(self, ops: LayerOps, merged: bool = True) -> "CausalLM":
        """Every layer calls `ops` (eager or compiled, fused.py) and, with `merged`, one GEMM for
        q/k/v and one for gate/up."""
        for module in self.modules():
            if hasattr(type(module), "ops"):
                module.ops = ops
            if hasattr(type(module), "merged"):
                module.merged = merged
        return self
