"""How the forward runs on a CUDA device: the compilation level and the sizes of the CUDA
graphs captured (``worker.cuda_graphs``, ``worker.compile``)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_CUDA_GRAPH_BATCH_SIZE = 512


def cuda_graph_batch_sizes(
    max_num_seqs: int, limit: int = MAX_CUDA_GRAPH_BATCH_SIZE
) -> tuple[int, ...]:
    """The decode batch sizes that get a CUDA graph (vLLM's ladder): 1, 2, 4, then every
    multiple of 8, up to ``min(max_num_seqs, limit)``, which is always included so that every
    decode batch the scheduler can form up to that size has a graph to pad to."""
    top = min(max_num_seqs, limit)
    if top < 1:
        return ()
    ladder = [1, 2, 4, *range(8, top + 1, 8)]
    return tuple(sorted({s for s in ladder if s < top} | {top}))


# Steps of up to this many tokens replay a CUDA graph; larger ones keep the GPU busy anyway.
MAX_CUDA_GRAPH_NUM_TOKENS = 2048


def cuda_graph_num_tokens(
    max_num_batched_tokens: int, limit: int = MAX_CUDA_GRAPH_NUM_TOKENS
) -> tuple[int, ...]:
    """The step sizes in tokens that get a mixed-step CUDA graph: 16, 32, then steps of 32 up
    to 128, of 64 up to 512, of 128 up to 1024, of 256 beyond (above 96 tokens a step pads by
    at most a third), up to ``min(max_num_batched_tokens, limit)``, which is always included."""
    top = min(max_num_batched_tokens, limit)
    if top < 1:
        return ()
    ladder = [16, *range(32, 129, 32), *range(192, 513, 64), *range(640, 1025, 128)]
    ladder += range(1280, top + 1, 256)
    return tuple(sorted({s for s in ladder if s < top} | {top}))


@dataclass(frozen=True)
class CompilationConfig:
    """How the forward runs (``worker.cuda_graphs``, ``worker.compile``), on a CUDA device.

    ``level`` 0 runs every step eagerly; 1 replays CUDA graphs: decode-only steps padded to
    the next of ``cuda_graph_batch_sizes``, other steps to the next of
    ``cuda_graph_num_tokens`` (larger steps run eagerly), the vision tower per image-size
    bucket; 2 also compiles the LM forward with ``torch.compile`` for the steps that are not
    decode-only (graphed or not). CPU is always level 0.
    """

    level: int = 1
    cuda_graph_batch_sizes: tuple[int, ...] = ()
    cuda_graph_num_tokens: tuple[int, ...] = ()

    @property
    def enforce_eager(self) -> bool:
        return self.level == 0
