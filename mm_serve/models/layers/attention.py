"""The attention op of one layer: RoPE and the KV-cache write, then paged attention.

Under ``torch.compile`` (``worker.compile``) the whole op is one opaque custom op,
``mm_serve::attention``: Dynamo traces the layers around it, while the op reads the step's
``AttentionMetadata`` from :func:`step_metadata` and its layer from the compiled model's
registry, so that no host-side value of the batch enters the traced graph.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from mm_serve.kernels import paged_attention
from mm_serve.kernels.attention_metadata import AttentionMetadata

# Set around a compiled forward: the step's metadata; and every compiled model's layers by
# ``layer_index``, unique in the process (held weakly: several engines may share it).
_step: AttentionMetadata | None = None
_layers: dict[int, weakref.ReferenceType[Attention]] = {}
_next_layer_index = itertools.count()


@contextlib.contextmanager
def step_metadata(metadata: AttentionMetadata) -> Iterator[None]:
    """Within the block, ``mm_serve::attention`` attends with ``metadata``."""
    global _step
    _step, previous = metadata, _step
    try:
        yield
    finally:
        _step = previous


def register_layers(layers: list[Attention]) -> None:
    """Give each of ``layers`` its ``layer_index`` for ``mm_serve::attention``."""
    for layer in layers:
        layer.layer_index = next(_next_layer_index)
        _layers[layer.layer_index] = weakref.ref(layer)


@torch.library.custom_op("mm_serve::attention", mutates_args=())
def attention_op(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: int
) -> torch.Tensor:
    """``Attention.forward`` of layer ``layer_index`` with the metadata of ``step_metadata``:
    ``[T, num_heads * head_dim]``. It writes the layer's KV cache, which it does not declare:
    its output depends on the write, and nothing else reads the cache within the step."""
    return _layers[layer_index]().forward(positions, q, k, v, _step)


@attention_op.register_fake
def _(positions, q, k, v, layer_index):
    return torch.empty_like(q)


class Attention(nn.Module):
    """Causal GQA attention for a flattened varlen batch.

    ``self.kv_cache`` (``[2, num_blocks, block_size, num_kv_heads, head_dim]``) is bound by the
    model runner after it sizes the pool; until then it is an empty tensor. It is a plain
    attribute, not a buffer: it is not part of the weights and must survive ``to_empty``.

    ``sliding_window`` (None: full attention) limits each query to the keys less than that many
    positions behind it; ``kv_cache_group`` is the KV-cache group whose block table the layer
    reads (``AttentionMetadata.for_group``; set with the cache, ``cache.kv_cache_groups``).
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        rotary_emb: nn.Module,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.rotary_emb = rotary_emb  # RotaryEmbedding, may be shared by all layers
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.kv_cache_group = 0
        self.kv_cache = torch.tensor([])
        self.layer_index = -1  # set by register_layers, for a compiled forward

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] or [3, num_tokens] (M-RoPE)
        q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        """Returns ``[num_tokens, num_heads * head_dim]``.

        q and k are rotated by ``positions`` first.
        With metadata and a bound cache: writes this step's K/V to ``slot_mapping`` (in the
        same kernel as the rotation), then each request attends to its ``seq_lens[i]`` cached
        tokens. Without either (a model run outside the engine, as in the tests): causal
        attention within each request's new tokens only (no cached prefix); no metadata means
        one sequence.
        """
        if torch.compiler.is_compiling():
            return torch.ops.mm_serve.attention(positions, q, k, v, self.layer_index)
        cached = attn_metadata is not None and self.kv_cache.numel() > 0
        if cached and self.kv_cache_group:
            attn_metadata = attn_metadata.for_group(self.kv_cache_group)
        kv_write = (v, self.kv_cache, attn_metadata.slot_mapping) if cached else None
        q, k = self.rotary_emb(positions, q, k, kv_write)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if cached:  # k/v too: a fresh prefill may attend to them without reading the cache
            out = paged_attention(
                q, self.kv_cache, attn_metadata, self.scale, k, v, self.sliding_window
            )
        else:
            out = self._forward_no_cache(q, k, v, attn_metadata)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)

    def _forward_no_cache(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        # SDPA: memory-efficient on GPU, one call per request.
        num_tokens = q.shape[0]
        starts = [0, num_tokens] if attn_metadata is None else attn_metadata.query_start_loc_cpu
        out = torch.zeros_like(q)
        for start, end in zip(starts[:-1], starts[1:], strict=True):
            if end > start:
                qs, ks, vs = (x[start:end].transpose(0, 1) for x in (q, k, v))
                mask, causal = None, True
                if self.sliding_window is not None:  # causal and within the window
                    pos = torch.arange(end - start, device=q.device)
                    offset = pos[:, None] - pos[None, :]
                    mask, causal = (offset >= 0) & (offset < self.sliding_window), False
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, mask, is_causal=causal, scale=self.scale, enable_gqa=True
                )
                out[start:end] = o.transpose(0, 1)
        return out
