"""EncoderCacheManager: ref counts, eviction order, and that nothing referenced is ever evicted."""

from __future__ import annotations

from mm_serve.cache.encoder_cache_manager import EncoderCacheManager
from mm_serve.messages.request import MultiModalFeature, PlaceholderRange, Request
from mm_serve.messages.sampling_params import SamplingParams


def image_request(req_id: str, *images: tuple[str, int]) -> Request:
    """A request whose prompt is the given images (mm_hash, num_tokens) back to back."""
    features, offset = [], 0
    for mm_hash, length in images:
        features.append(MultiModalFeature(mm_hash, PlaceholderRange(offset, length)))
        offset += length
    return Request(req_id, [7] * offset, SamplingParams(), mm_features=features)


def encode(cache: EncoderCacheManager, request: Request, input_id: int, budget: int = 100):
    """What the scheduler does for one image: hit, or allocate if it fits. Returns 'hit',
    'miss' (allocated) or 'full'."""
    if cache.check_and_update_cache(request, input_id):
        return "hit"
    length = request.mm_features[input_id].placeholder.length
    if not cache.can_allocate(length, budget, 0):
        return "full"
    cache.allocate(request, input_id)
    return "miss"


def assert_all_free(cache: EncoderCacheManager) -> None:
    assert all(not refs for refs in cache.cached.values())
    assert cache.num_freeable_slots == cache.cache_size
    assert len(cache.freeable) == len(cache.cached)


def test_shared_image_is_ref_counted_and_kept_after_release():
    cache = EncoderCacheManager(cache_size=20)
    a, b = image_request("a", ("x", 8)), image_request("b", ("x", 8))
    assert encode(cache, a, 0) == "miss"
    assert encode(cache, b, 0) == "hit"
    assert cache.cached["x"] == {"a", "b"}
    assert encode(cache, a, 0) == "hit"  # re-checking while holding it counts no new hit
    assert (cache.hits, cache.misses, cache.num_encoder_tokens) == (1, 1, 8)
    cache.free(a)
    assert cache.cached["x"] == {"b"} and not cache.freeable
    cache.free(b)
    # Unreferenced but still cached: a third request hits without encoding.
    assert "x" in cache.freeable and cache.num_free_slots == 12
    c = image_request("c", ("x", 8))
    assert encode(cache, c, 0) == "hit"
    assert not cache.freeable and cache.num_freeable_slots == 12
    cache.free(c)
    assert_all_free(cache)
    assert cache.get_freed_mm_hashes() == []  # nothing was ever evicted


def test_eviction_is_oldest_first_and_only_when_space_is_needed():
    cache = EncoderCacheManager(cache_size=24)
    for name in ("p", "q", "r"):
        request = image_request(name, (name, 8))
        assert encode(cache, request, 0) == "miss"
        cache.free(request)  # released in the order p, q, r
    assert cache.num_free_slots == 0 and cache.num_freeable_slots == 24
    # q is used again: it becomes the newest (and referenced, so not evictable).
    user = image_request("user", ("q", 8))
    assert encode(cache, user, 0) == "hit"
    big = image_request("big", ("s", 12))
    assert encode(cache, big, 0) == "miss"
    # 12 tokens needed: p (oldest) then r go; q is referenced and stays.
    assert cache.get_freed_mm_hashes() == ["p", "r"]
    assert cache.get_freed_mm_hashes() == []  # reported once
    assert set(cache.cached) == {"q", "s"}
    cache.free(user)
    cache.free(big)
    assert_all_free(cache)


def test_referenced_entries_are_never_evicted():
    cache = EncoderCacheManager(cache_size=16)
    holder = image_request("holder", ("a", 8), ("b", 8))
    assert encode(cache, holder, 0) == "miss"
    assert encode(cache, holder, 1) == "miss"
    newcomer = image_request("new", ("c", 8))
    assert encode(cache, newcomer, 0) == "full"  # both entries are still needed
    assert cache.get_freed_mm_hashes() == []
    cache.free_encoder_input(holder, 0)  # "a" fully computed: released, still cached
    assert encode(cache, newcomer, 0) == "miss"
    assert cache.get_freed_mm_hashes() == ["a"]
    assert cache.cached["b"] == {"holder"}
    cache.free(holder)
    cache.free(newcomer)
    assert_all_free(cache)


def test_compute_budget_and_pending_tokens_limit_allocation():
    cache = EncoderCacheManager(cache_size=16)
    assert not cache.can_allocate(10, compute_budget=8, num_tokens_pending=0)
    assert cache.can_allocate(8, compute_budget=8, num_tokens_pending=8)
    assert not cache.can_allocate(8, compute_budget=8, num_tokens_pending=9)
    assert cache.get_freed_mm_hashes() == []
    assert_all_free(cache)


def test_free_is_idempotent_and_ignores_unknown_requests():
    cache = EncoderCacheManager(cache_size=8)
    a = image_request("a", ("x", 8))
    stranger = image_request("stranger", ("x", 8))
    assert encode(cache, a, 0) == "miss"
    cache.free(stranger)  # holds no reference
    assert cache.cached["x"] == {"a"}
    cache.free(a)
    cache.free(a)
    assert cache.num_freeable_slots == 8
    assert_all_free(cache)
