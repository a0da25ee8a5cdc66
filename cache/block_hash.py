"""Prefix-cache hashes of full KV blocks, chained from the parent block's hash.

A block's hash covers its parent's hash, its token ids and its *extra keys* (the mm_hash and
offset of every image overlapping the block, and the request's cache_salt and LoRA adapter id on
the first block), so two different images behind identical placeholder tokens never share KV,
nor do two adapters (or an adapter and the base model) behind identical tokens. The scheme follows
vLLM V1 (vllm/v1/core/kv_cache_utils.py); the hash is xxh3-128 over a type-tagged,
length-framed encoding, seeded per process so collisions cannot be precomputed.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, NewType

import xxhash

if TYPE_CHECKING:
    from mm_serve.messages.request import Request

# 16 bytes of xxh3-128 digest.
BlockHash = NewType("BlockHash", bytes)
# A flat or nested tuple of str / int / bytes / None values.
ExtraKeys = tuple[object, ...]

# Random per process: hashes are only ever compared inside one engine process, and a seed an
# attacker cannot know stops them from crafting colliding prompts offline.
_SEED: int = int.from_bytes(os.urandom(8), "little")

_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")


def _encode(value: object, out: list[bytes]) -> None:
    """Append a type-tagged, length-framed encoding of ``value`` to ``out``.

    Raises:
        TypeError: for a value that is not None, int, str, bytes, tuple or list.
    """
    if value is None:
        out.append(b"N")
    elif isinstance(value, int):
        out.append(b"I" + _I64.pack(value))
    elif isinstance(value, str):
        data = value.encode("utf-8")
        out.append(b"S" + _U64.pack(len(data)) + data)
    elif isinstance(value, bytes):
        out.append(b"B" + _U64.pack(len(value)) + value)
    elif isinstance(value, (tuple, list)):
        out.append(b"T" + _U64.pack(len(value)))
        for item in value:
            _encode(item, out)
    else:
        raise TypeError(f"Cannot hash a block extra key of type {type(value).__name__}.")


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: ExtraKeys | None = None,
) -> BlockHash:
    """Hash of one full block: xxh3-128 of (parent hash, token ids, extra keys).

    ``parent_hash`` is None for the first block of a sequence.
    """
    parts: list[bytes] = []
    tokens = struct.pack(f"<{len(token_ids)}q", *token_ids)
    _encode((parent_hash, tokens, extra_keys or ()), parts)
    return BlockHash(xxhash.xxh3_128_digest(b"".join(parts), seed=_SEED))


def block_extra_keys(request: Request, start: int, end: int) -> ExtraKeys:
    """Extra keys of the tokens [start, end) of ``request`` (positions in tokens).

    One ``(mm_hash, start - placeholder.offset)`` pair per image whose placeholder range overlaps
    the block (the offset is negative when the image starts inside the block), then
    ``request.cache_salt`` and ``("lora", lora_int_id)`` of its adapter when ``start == 0``:
    they enter the first block only, and the hash chain carries them to every later block.
    """
    keys: list[object] = []
    for feature in request.mm_features:
        placeholder = feature.placeholder
        if placeholder.offset < end and start < placeholder.end:
            keys.append((feature.mm_hash, start - placeholder.offset))
    if start == 0 and request.cache_salt is not None:
        keys.append(request.cache_salt)
    if start == 0 and request.lora_request is not None:
        keys.append(("lora", request.lora_request.lora_int_id))
    return tuple(keys)


def update_block_hashes(request: Request, block_size: int) -> None:
    """Append to ``request.block_hashes`` the hash of every new full block of its tokens.

    Incremental: blocks already hashed are skipped, so it is cheap to call after every step as
    output tokens are appended. A trailing partial block is never hashed.
    """
    hashes = request.block_hashes
    token_ids = request.all_token_ids
    start = len(hashes) * block_size
    while start + block_size <= len(token_ids):
        end = start + block_size
        parent = hashes[-1] if hashes else None
        extra = block_extra_keys(request, start, end)
        hashes.append(hash_block_tokens(parent, token_ids[start:end], extra))
        start = end
