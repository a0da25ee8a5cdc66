"""The Gemma 3 decoder LM over a flattened varlen batch.

Differences from Llama (HF ``modeling_gemma3``, checked against it in ``tests/test_gemma3.py``):

- token embeddings scaled by ``sqrt(hidden_size)`` (rounded to the weight's dtype, as HF);
- Gemma's RMSNorm, ``x / rms(x) * (1 + weight)`` in float32 (its weights are zero-centred),
  four per layer: before and after attention, before and after the MLP;
- RMSNorm over each head's query and key (``q_norm``, ``k_norm``) before RoPE;
- attention scale ``query_pre_attn_scalar ** -0.5``; GELU-tanh gated MLP;
- ``layer_types``: sliding-window layers (window ``sliding_window``, RoPE base
  ``rope_parameters["sliding_attention"]``, 10,000) and full-attention layers (RoPE of
  ``rope_parameters["full_attention"]``: base 1,000,000, with its scaling, e.g. ``linear``);
- tied embeddings; an optional ``final_logit_softcapping``.

Parameter names as the Llama LM's (``model.layers.{i}.self_attn.qkv_proj``, ``mlp.gate_up_proj``
stacked; ``load_weights`` is the Llama loader) plus ``self_attn.{q,k}_norm`` and
``{input,post_attention,pre_feedforward,post_feedforward}_layernorm``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mm_serve.kernels.attention_metadata import AttentionMetadata
from mm_serve.kernels.dispatch import get_activation
from mm_serve.models.layers.attention import Attention
from mm_serve.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from mm_serve.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from mm_serve.models.layers.rotary import LinearScalingRotaryEmbedding, RotaryEmbedding, get_rope
from mm_serve.models.llama import LlamaForCausalLM

SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_ROPE_THETA = {SLIDING: 10_000.0, FULL: 1_000_000.0}  # HF Gemma3TextConfig's


class GemmaRMSNorm(nn.Module):
    """``x / sqrt(mean(x**2) + eps) * (1 + weight)``, computed in float32 and cast back at the
    end (HF ``Gemma3RMSNorm``); ``[..., dim]`` in and out."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def gemma3_rope(config: Any, layer_type: str) -> RotaryEmbedding:
    """The RoPE of ``layer_type``'s layers, from ``config.rope_parameters[layer_type]``.

    A ``linear`` scaling divides the frequencies by its factor over positions up to
    ``max_position_embeddings`` (already the scaled context for Gemma 3: the table is not
    stretched by the factor, unlike ``get_rope`` for Llama configs).
    """
    params = dict((getattr(config, "rope_parameters", None) or {}).get(layer_type) or {})
    base = float(params.get("rope_theta") or DEFAULT_ROPE_THETA[layer_type])
    head_dim, max_position = config.head_dim, config.max_position_embeddings
    if params.get("rope_type") == "linear":
        return LinearScalingRotaryEmbedding(head_dim, max_position, base, params["factor"])
    return get_rope(head_dim, max_position, base, params)


class Gemma3Attention(nn.Module):
    """QKV projection, per-head q/k RMSNorm, RoPE and paged attention (windowed on sliding
    layers), output projection: ``[T, hidden] -> [T, hidden]``."""

    def __init__(self, config: Any, layer_type: str, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        head_dim, bias = config.head_dim, bool(config.attention_bias)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=bias,
        )
        num_heads, num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim, config.hidden_size, bias=bias
        )
        self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.split_sizes = [self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size]
        self.head_dim = head_dim
        window = config.sliding_window if layer_type == SLIDING else None
        scale = config.query_pre_attn_scalar**-0.5
        self.attn = Attention(num_heads, head_dim, scale, num_kv_heads, rotary_emb, window)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden_states: torch.Tensor,  # [T, hidden]
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split(self.split_sizes, dim=-1)
        heads = (q.shape[0], -1, self.head_dim)
        q = self.q_norm(q.reshape(heads)).flatten(1)
        k = self.k_norm(k.reshape(heads)).flatten(1)
        return self.o_proj(self.attn(positions, q, k, v, attn_metadata))


class Gemma3MLP(nn.Module):
    """``down_proj(act(gate) * up)``, ``act`` the config's ``hidden_activation`` (GELU-tanh)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter] * 2)
        self.down_proj = RowParallelLinear(inter, config.hidden_size)
        self.act = get_activation(config.hidden_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Gemma3DecoderLayer(nn.Module):
    """``h += post_attn_norm(attn(input_norm(h)))``, then
    ``h += post_ff_norm(mlp(pre_ff_norm(h)))``."""

    def __init__(self, config: Any, layer_type: str, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, layer_type, rotary_emb)
        self.mlp = Gemma3MLP(config)
        self.input_layernorm = GemmaRMSNorm(dim, eps)
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden_states), attn_metadata)
        hidden_states = hidden_states + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return hidden_states + self.post_feedforward_layernorm(mlp)


class Gemma3TextModel(nn.Module):
    """Embedding, decoder layers and final norm: ``forward(...) -> [T, hidden]``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        # One rotary table per layer type, shared by the layers of that type.
        self.rotary_emb = nn.ModuleDict(
            {kind: gemma3_rope(config, kind) for kind in (SLIDING, FULL)}
        )
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, kind, self.rotary_emb[kind]) for kind in layer_types(config)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T] -> [T, hidden]`` scaled token embeddings (the scale rounded to the weight's
        dtype first, as HF's ``Gemma3TextScaledWordEmbedding``)."""
        # A Python float (no host-to-device copy, so CUDA graphs can capture it).
        scale = torch.tensor(self.embed_scale, dtype=self.embed_tokens.weight.dtype).item()
        return self.embed_tokens(input_ids) * scale

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata | None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden_states = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states, attn_metadata)
        return self.norm(hidden_states)


def layer_types(config: Any) -> list[str]:
    """Each layer's type: ``config.layer_types``, else HF's default (every 6th layer full).

    Raises:
        ValueError: a type other than sliding or full attention, or an attention feature
            this implementation lacks (logit soft-capping, bidirectional text attention).
    """
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError("Gemma 3 with attn_logit_softcapping is not supported.")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("Gemma 3 with use_bidirectional_attention is not supported.")
    types = getattr(config, "layer_types", None) or [
        SLIDING if (i + 1) % 6 else FULL for i in range(config.num_hidden_layers)
    ]
    unknown = set(types) - {SLIDING, FULL}
    if unknown:
        raise ValueError(f"Unsupported Gemma 3 layer types {sorted(unknown)}.")
    return list(types)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """The Gemma 3 LM with the Llama LM's engine interface (``forward``, ``attention_layers``,
    ``bind_kv_cache``, ``load_weights``: the same parameter layout); ``config`` is the HF
    ``Gemma3TextConfig``. The Llama decoder itself is not built."""

    def __init__(self, config: Any) -> None:
        nn.Module.__init__(self)  # LlamaForCausalLM.__init__ would build a Llama decoder
        self.config = config
        self.inputs_embeds_size: int = config.hidden_size
        self.model = Gemma3TextModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T] -> [T, hidden]``: the scaled token embeddings (images' replace some rows)."""
        return self.model.embed(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden] -> [N, vocab]`` in the model's dtype, soft-capped by ``c * tanh(x / c)``
        when the config sets ``final_logit_softcapping`` (HF ``Gemma3ForCausalLM``)."""
        logits = self.lm_head(hidden_states)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
