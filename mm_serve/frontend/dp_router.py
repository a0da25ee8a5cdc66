"""Which data-parallel replica runs a request: the least loaded, unless another holds its cache.

Each replica has its own prefix and encoder cache. The router remembers, for a bounded number
of recent keys, which replicas each was sent to: every image's ``mm_hash`` and the prefix-cache
hash of every full prompt block (``cache/block_hash.py``, the engine's own chained hashes).

The balanced choice is the least loaded replica (ties in turn). Another replica wins when it
holds more of the request: more of its images, or a prefix longer by more than
``MIN_PREFIX_MATCH`` of the prompt; most images first, then longest prefix. A replica with more
than ``max_imbalance`` requests in flight beyond the least loaded is skipped. Load is the engine
requests in flight as the front end counts them (sent, not finished). After SGLang's
cache-aware router (a prefix-match threshold and a balance threshold)."""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

from mm_serve.cache.block_hash import BlockHash, block_extra_keys, hash_block_tokens
from mm_serve.messages.request import Request

MIN_PREFIX_MATCH = 0.5  # a longer prefix routes when it is longer by more than this of the prompt
AFFINITY_CAPACITY = 1 << 17  # keys remembered (mm_hashes and block hashes), least recent out


def prefix_hashes(request: Request, block_size: int) -> list[BlockHash]:
    """The prefix-cache hash of every full block of ``request``'s prompt, first block first
    (``hash_block_tokens`` with ``block_extra_keys``, as the engine's KV-cache manager)."""
    token_ids = request.prompt_token_ids
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        extra = block_extra_keys(request, start, end)
        hashes.append(
            hash_block_tokens(hashes[-1] if hashes else None, token_ids[start:end], extra)
        )
    return hashes


class ReplicaRouter:
    """Chooses the replica of each request (see the module doc); thread-safe.

    Args:
        num_replicas: the data-parallel size.
        block_size: the KV-cache block size in tokens (the prefix keys' granularity).
        max_imbalance: requests in flight an affine replica may have beyond the least loaded
            one before the request goes elsewhere (at least 0).
        capacity: keys remembered.
    """

    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        max_imbalance: int,
        capacity: int = AFFINITY_CAPACITY,
    ) -> None:
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.max_imbalance = max_imbalance
        self.capacity = capacity
        # key -> bit mask of the replicas it was sent to, least recently sent first
        self._owners: collections.OrderedDict[object, int] = collections.OrderedDict()
        self._next = 0  # the replica that wins the next tie
        self._lock = threading.Lock()

    def route(self, requests: Sequence[Request], loads: Sequence[int]) -> int:
        """The replica for ``requests`` (the ``n`` siblings of one user request: one prompt,
        one set of images), given each replica's requests in flight; remembers its keys."""
        request = requests[0]
        hashes = prefix_hashes(request, self.block_size)
        mm_hashes = [feature.mm_hash for feature in request.mm_features]
        with self._lock:
            replica = self._choose(hashes, mm_hashes, len(request.prompt_token_ids), loads)
            self._remember([*hashes, *mm_hashes], replica)
        return replica

    def pin(self, requests: Sequence[Request], replica: int) -> None:
        """Remember ``requests``' keys for ``replica``, where they were sent on purpose."""
        request = requests[0]
        keys = [*prefix_hashes(request, self.block_size)]
        keys += [feature.mm_hash for feature in request.mm_features]
        with self._lock:
            self._remember(keys, replica)

    def reset(self) -> None:
        """Forget every key (the replicas' caches were emptied)."""
        with self._lock:
            self._owners.clear()

    def _choose(
        self, hashes: list[BlockHash], mm_hashes: list[str], prompt_len: int, loads: Sequence[int]
    ) -> int:
        """The balanced replica, or one that holds more of the request (see the module doc)."""
        n, least = self.num_replicas, min(loads)
        balanced = min(range(n), key=lambda r: (loads[r], (r - self._next) % n))
        prefix = self._prefix_tokens(hashes)
        images = [0] * n
        for mm_hash in mm_hashes:
            holders = self._owners.get(mm_hash, 0)
            for replica in range(n):
                images[replica] += holders >> replica & 1
        min_gain = MIN_PREFIX_MATCH * prompt_len
        better = [
            r
            for r in range(n)
            if loads[r] - least <= self.max_imbalance
            and (images[r] > images[balanced] or prefix[r] - prefix[balanced] > min_gain)
        ]
        if better:
            return max(better, key=lambda r: (images[r], prefix[r], -loads[r]))
        self._next = (balanced + 1) % n
        return balanced

    def _prefix_tokens(self, hashes: list[BlockHash]) -> list[int]:
        """Per replica, the tokens of the longest prefix of ``hashes`` it was sent."""
        prefix = [0] * self.num_replicas
        unresolved = (1 << self.num_replicas) - 1
        for index in range(len(hashes) - 1, -1, -1):
            holders = self._owners.get(hashes[index], 0) & unresolved
            for replica in range(self.num_replicas):
                if holders >> replica & 1:
                    prefix[replica] = (index + 1) * self.block_size
            unresolved &= ~holders
            if not unresolved:
                break
        return prefix

    def _remember(self, keys: list[object], replica: int) -> None:
        owners = self._owners
        for key in keys:
            owners[key] = owners.get(key, 0) | 1 << replica
            owners.move_to_end(key)
        while len(owners) > self.capacity:
            owners.popitem(last=False)
