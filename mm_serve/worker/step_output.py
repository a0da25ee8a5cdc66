"""A step's sampled tokens on their way to the host, so that the next step can launch first.

With async scheduling (vLLM V1's ``async_scheduling``) the engine core launches step ``n + 1``
before it reads step ``n``'s tokens: the host schedules and prepares the next step while the
device runs this one. Two things make that work:

- ``SampledTokens``: the token ids stay on the device, and the next step's ``input_ids`` take
  them from there (the host does not know them yet);
- ``PendingOutput``: the ids (and logprobs) are copied to pinned host memory without blocking,
  behind an event; ``get()`` waits for that event only, then hands the tokens to the runner's
  bookkeeping and returns the step's ``ModelRunnerOutput``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from mm_serve.sched.output import ModelRunnerOutput
from mm_serve.worker.sampling_metadata import LogprobsTensors


@dataclass
class SampledTokens:
    """The tokens one step sampled, still on the device.

    ``token_ids[i]`` belongs to batch row ``rows[i]`` (request ``req_ids[i]``) and sits at
    position ``positions[i]`` of that request; ``num_logprobs[i]`` is what it asked for
    (``num_logprobs`` is None when no row asked for logprobs).
    """

    token_ids: torch.Tensor  # [num_sampled] int64, on the device
    rows: list[int]
    req_ids: list[str]
    positions: np.ndarray  # [num_sampled] int64
    num_logprobs: list[int | None] | None

    def destinations(
        self,
        row_of: dict[str, int],
        num_computed: np.ndarray,  # [num_reqs] int64, before the step
        num_scheduled: np.ndarray,  # [num_reqs] int64
        query_start_loc: np.ndarray,  # [num_reqs + 1]
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Where these tokens go in the next step's ``input_ids``: ``(dst [k], src [k])``,
        indices into ``input_ids`` and into ``token_ids``, for those inside the next step's
        windows (requests found by ``row_of``, their batch rows); None if none."""
        rows = np.array([row_of.get(r, -1) for r in self.req_ids], dtype=np.int64)
        src = np.nonzero(rows >= 0)[0]
        rows = rows[src]
        offset = self.positions[src] - num_computed[rows]
        inside = (offset >= 0) & (offset < num_scheduled[rows])
        if not inside.any():
            return None
        return query_start_loc[rows[inside]] + offset[inside], src[inside]


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Start a non-blocking copy of ``tensor`` into pinned host memory (a no-op on CPU)."""
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def _per_row(tokens: list[int], rows: list[int], num_reqs: int) -> list[list[int]]:
    """``[num_reqs]`` lists: ``[tokens[i]]`` at ``rows[i]``, empty for the other rows."""
    if len(rows) == num_reqs:  # every row sampled (rows are increasing): a decode step
        return [[token] for token in tokens]
    per_row: list[list[int]] = [[] for _ in range(num_reqs)]
    for row, token in zip(rows, tokens, strict=True):
        per_row[row] = [token]
    return per_row


class PendingOutput:
    """One step's ``ModelRunnerOutput`` on its way to the host: the batch ``req_ids`` in row
    order, the ``sampled`` tokens (None when every request was mid-prompt), the sampled rows'
    top-k ``logprobs`` (device tensors, or None), the step's ``prompt_logprobs`` (on the host
    already) and the pooling runner's embeddings (``pooled``: request id -> ``[d]`` float32 on
    the device). ``on_tokens(sampled, token ids as a list)`` runs once when they arrive: the
    runner records them in its request states."""

    def __init__(
        self,
        req_ids: list[str],
        sampled: SampledTokens | None = None,
        logprobs: LogprobsTensors | None = None,
        prompt_logprobs: dict | None = None,
        on_tokens: Callable[[SampledTokens, list[int]], None] | None = None,
        pooled: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.req_ids = req_ids
        self.sampled = sampled
        self.prompt_logprobs = prompt_logprobs or {}
        self.on_tokens = on_tokens
        self._output: ModelRunnerOutput | None = None
        device_tensors = []
        if sampled is not None:
            device_tensors = [sampled.token_ids]
            if logprobs is not None:
                device_tensors += [logprobs.token_ids, logprobs.logprobs, logprobs.ranks]
        self._host = [_to_host(t) for t in device_tensors]
        self._pooled = {req_id: _to_host(t) for req_id, t in (pooled or {}).items()}
        self._event = None
        if any(t.device.type == "cuda" for t in [*device_tensors, *(pooled or {}).values()]):
            self._event = torch.cuda.Event()
            self._event.record()

    @property
    def done(self) -> bool:
        """True once ``get()`` has run: the tokens are in the runner's host-side state."""
        return self._output is not None

    def get(self) -> ModelRunnerOutput:
        """Wait for this step's tokens (only this step's), record them once, return them."""
        if self._output is not None:
            return self._output
        num_reqs = len(self.req_ids)
        logprobs: list = [None] * num_reqs
        sampled = self.sampled
        if self._event is not None:
            self._event.synchronize()
        if sampled is None:
            sampled_token_ids: list[list[int]] = [[] for _ in range(num_reqs)]
        else:
            tokens = self._host[0].tolist()
            sampled_token_ids = _per_row(tokens, sampled.rows, num_reqs)
            if len(self._host) > 1:  # some row asked for logprobs
                ids, values, ranks = (t.tolist() for t in self._host[1:])
                for i, (row, k) in enumerate(zip(sampled.rows, sampled.num_logprobs, strict=True)):
                    if k is not None:
                        logprobs[row] = (ids[i][: k + 1], values[i][: k + 1], ranks[i])
            if self.on_tokens is not None:
                self.on_tokens(sampled, tokens)
        pooled = {req_id: t.tolist() for req_id, t in self._pooled.items()}
        self._output = ModelRunnerOutput(
            self.req_ids, sampled_token_ids, logprobs, self.prompt_logprobs, pooled
        )
        return self._output
