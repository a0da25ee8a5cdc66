"""Llama-family decoder LM (Llama 2/3, Qwen2, Mistral, Qwen3) over a flattened varlen batch.

Parameter names follow the HF checkpoints (``model.layers.{i}.self_attn...``) except that
q/k/v are stacked into ``qkv_proj`` and gate/up into ``gate_up_proj``; ``load_weights`` maps
the checkpoint names. Qwen2 differs from Llama only in having q/k/v biases; Qwen3 (and
Qwen3-VL's LM) only in an RMSNorm over each head of q and of k before RoPE (``q_norm``,
``k_norm``, weights ``[head_dim]``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from mm_serve.kernels.attention_metadata import AttentionMetadata
from mm_serve.kernels.dispatch_linear import linear_silu_and_mul
from mm_serve.models.layers.attention import Attention
from mm_serve.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from mm_serve.models.layers.layernorm import RMSNorm, rms_norm_then_linear
from mm_serve.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from mm_serve.models.layers.rotary import RotaryEmbedding, get_rope, rope_params_from_config

logger = logging.getLogger(__name__)

# (our parameter, checkpoint name part, shard id) for the fused projections.
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
_SHARDS = {"qkv_proj": {"q", "k", "v"}, "gate_up_proj": {0, 1}}
# A layer's MLP module, or None for the gated MLP: ``(text config, layer index) -> module``.
MakeMLP = Callable[[Any, int], nn.Module | None]


def _attention_biases(config: Any) -> tuple[bool, bool]:
    """``(qkv_bias, o_proj_bias)``: Qwen2 has biases on q/k/v only; Llama and Mistral follow
    ``attention_bias`` for all four projections."""
    if config.model_type.startswith("qwen2"):
        return True, False
    bias = bool(getattr(config, "attention_bias", False))
    return bias, bias


def _has_qk_norm(config: Any) -> bool:
    """Qwen3's per-head q/k RMSNorm (HF ``Qwen3Attention``, ``Qwen3VLTextAttention``)."""
    return config.model_type.startswith("qwen3")


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        head_dim = rotary_emb.head_dim  # the config's, as LlamaModel reads it
        qkv_bias, o_bias = _attention_biases(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, total_heads, total_kv_heads, bias=qkv_bias
        )
        self.o_proj = RowParallelLinear(total_heads * head_dim, config.hidden_size, bias=o_bias)
        self.split_sizes = [self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size]
        self.head_dim = head_dim
        if _has_qk_norm(config):
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(
            self.qkv_proj.num_heads,
            head_dim,
            head_dim**-0.5,
            self.qkv_proj.num_kv_heads,
            rotary_emb,  # one module shared by all layers
        )

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        qkv: torch.Tensor,  # [T, (heads + 2 kv_heads) * head_dim], from qkv_proj
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        if self.q_norm is not None:  # each head normed on its own, before RoPE
            d = self.head_dim
            q = self.q_norm(q.reshape(-1, d)).view(q.shape[0], -1)
            k = self.k_norm(k.reshape(-1, d)).view(k.shape[0], -1)
        return self.o_proj(self.attn(positions, q, k, v, attn_metadata))


class LlamaMLP(nn.Module):
    """The gated MLP's projections: ``down_proj(silu(gate) * up)`` with ``[gate | up]`` from
    ``gate_up_proj``; the decoder layer calls them (the norm before is fused into the first)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"Unsupported hidden_act {config.hidden_act!r}; only silu is.")
        bias = bool(getattr(config, "mlp_bias", False))
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter] * 2, bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias)


class LlamaDecoderLayer(nn.Module):
    """``mlp``: the gated MLP of ``config`` (``LlamaMLP``) unless given, e.g. a sparse MoE block
    (``[T, hidden] -> [T, hidden]``, after the post-attention norm)."""

    def __init__(
        self, config: Any, rotary_emb: RotaryEmbedding, mlp: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary_emb)
        self.mlp = LlamaMLP(config) if mlp is None else mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        attn_metadata: AttentionMetadata | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mlp_out, residual)``; the caller adds them (fused into the next norm).
        Each norm is fused into the projection after it for one token; for more, the MLP's
        activation is fused into its first projection (``linear_silu_and_mul``)."""
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = rms_norm_then_linear(
            self.input_layernorm, attn.qkv_proj, hidden_states, residual
        )
        hidden_states = attn(positions, qkv, attn_metadata)
        if not isinstance(mlp, LlamaMLP):  # a sparse MoE block: the norm, then the block
            normed, residual = self.post_attention_layernorm(hidden_states, residual)
            return mlp(normed), residual
        proj = mlp.gate_up_proj
        if hidden_states.shape[0] > 1 and proj.quant_method is None:
            # The activation in gate_up's GEMM (large steps, Hopper).
            normed, residual = self.post_attention_layernorm(hidden_states, residual)
            return mlp.down_proj(linear_silu_and_mul(normed, proj.weight, proj.bias)), residual
        gate_up, residual = rms_norm_then_linear(
            self.post_attention_layernorm, mlp.gate_up_proj, hidden_states, residual
        )
        return mlp.down_proj(gate_up, gated=True), residual


class LlamaModel(nn.Module):
    """``make_mlp(config, layer_index)``: a layer's MLP module, or None for ``LlamaMLP``."""

    def __init__(self, config: Any, make_mlp: MakeMLP | None = None) -> None:
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        base, rope_scaling = rope_params_from_config(config)
        self.rotary_emb = get_rope(head_dim, config.max_position_embeddings, base, rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        make_mlp = make_mlp or (lambda config, index: None)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.rotary_emb, make_mlp(config, i))
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata | None,
        inputs_embeds: torch.Tensor | None = None,
        layer_additions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``layer_additions``: ``[T, n, hidden]``, row ``[:, i]`` added to the hidden states
        after layer ``i`` for the first ``n`` layers (Qwen3-VL's DeepStack, as HF
        ``Qwen3VLTextModel``: zero rows where nothing is added)."""
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        num_additions = 0 if layer_additions is None else layer_additions.shape[1]
        for i, layer in enumerate(self.layers):
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
            if i < num_additions:  # the residual sum made here, not in the next norm
                hidden_states = hidden_states + residual + layer_additions[:, i]
                residual = None
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Decoder LM over the flattened batch of all scheduled tokens (no padding).

    ``config`` is the HF text config (``LlamaConfig``, ``Qwen2Config``, ``MistralConfig``).
    """

    uses_mrope = False  # positions are [T]; True on VLMs whose positions are [3, T]
    bidirectional_images = False  # True: an image's tokens attend to each other (Gemma 3)

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        # Width of the rows get_input_embeddings returns and forward takes as inputs_embeds.
        self.inputs_embeds_size: int = config.hidden_size
        if getattr(config, "sliding_window", None) is not None:
            logger.warning(
                "Sliding-window attention is not implemented: outputs match HF only for "
                "sequences up to sliding_window=%d tokens.",
                config.sliding_window,
            )
        self.model = LlamaModel(config, self.make_mlp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_mlp(self, config: Any, layer_index: int) -> nn.Module | None:
        """The MLP of decoder layer ``layer_index`` of the text ``config``: None, the gated
        MLP (``LlamaMLP``); a mixture-of-experts model returns its sparse block. Called while
        ``__init__`` builds the decoder."""
        return None

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T] -> [T, hidden]`` token embeddings (a VLM merges image embeddings into them)."""
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,  # [T]
        positions: torch.Tensor,  # [T]
        attn_metadata: AttentionMetadata | None,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden], replaces input_ids
    ) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of every token of the batch."""
        return self.model(input_ids, positions, attn_metadata, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden] -> [N, vocab]`` in the model's dtype (only the rows that are sampled;
        the sampler computes in float32)."""
        return self.lm_head(hidden_states)

    def attention_layers(self) -> list[Attention]:
        """The attention op of each layer, in order (one KV cache tensor each)."""
        return [layer.self_attn.attn for layer in self.model.layers]

    def bind_kv_cache(self, kv_caches: list[torch.Tensor]) -> None:
        """Bind ``kv_caches[i]`` (``[2, num_blocks, block_size, kv_heads, d]``) to layer ``i``."""
        layers = self.attention_layers()
        if len(kv_caches) != len(layers):
            raise ValueError(f"Got {len(kv_caches)} KV caches for {len(layers)} layers.")
        for attn, kv_cache in zip(layers, kv_caches, strict=True):
            attn.kv_cache = kv_cache

    def param_name(self, ckpt_name: str) -> str:
        """Our parameter name of a checkpoint tensor (its fused projection's, for q/k/v, gate
        and up)."""
        return _param_name(ckpt_name)[0]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF checkpoint tensors (full, unsharded) into this rank's parameters.

        Returns the names of the parameters that are now fully loaded (a fused parameter only
        once all its shards came). Unknown tensors are skipped with a warning; a tensor of the
        wrong shape raises ``ValueError`` naming it.
        """
        if self.tie_word_embeddings:  # re-tie: to_empty() gives each module its own tensor
            self.lm_head.weight = self.model.embed_tokens.weight
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        shards: dict[str, set] = {}
        skipped: list[str] = []
        for ckpt_name, tensor in weights:
            if "rotary_emb.inv_freq" in ckpt_name:
                continue
            if self.tie_word_embeddings and ckpt_name == "lm_head.weight":
                continue  # the embedding matrix is the LM head
            name, shard_id = _param_name(ckpt_name)
            if name not in params:
                skipped.append(ckpt_name)
                continue
            module = self.get_submodule(name.rpartition(".")[0])
            try:
                _load_one(module, params[name], tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"Cannot load {ckpt_name!r}: {e}") from e
            if shard_id is None:
                loaded.add(name)
            else:
                shards.setdefault(name, set()).add(shard_id)
        loaded |= {n for n, s in shards.items() if s == _SHARDS[n.split(".")[-2]]}
        if skipped:
            logger.warning("Ignored %d checkpoint tensors, e.g. %s", len(skipped), skipped[:5])
        return loaded


def _param_name(ckpt_name: str) -> tuple[str, object]:
    """Checkpoint tensor name -> ``(our parameter name, shard id or None)``."""
    for param, part, shard_id in STACKED_PARAMS:
        if f".{part}." in ckpt_name:
            return ckpt_name.replace(f".{part}.", f".{param}."), shard_id
    return ckpt_name, None


def _load_one(module: nn.Module, param: nn.Parameter, tensor: torch.Tensor, shard_id) -> None:
    loader = getattr(module, "weight_loader", None)
    if loader is not None:
        loader(param, tensor, shard_id)
    elif param.shape != tensor.shape:
        raise ValueError(f"shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    else:
        param.data.copy_(tensor)
