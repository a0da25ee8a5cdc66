"""The preprocessing pool: worker processes that decode, validate and preprocess images and
videos, while the front end keeps tokenizing, scheduling and detokenizing.

Workers are forked from a forkserver that has imported torch, torchvision and the processors
(fast start, shared pages, none of the front end's threads) and never run the user's main
script (``mp_context``). Each builds the checkpoint's image processor once and warms it; a video
job carries its ``VideoProcessor`` and decodes with PyAV, checking ``VideoLimits`` first.
Results come back as numpy arrays (pickled: no torch shared memory or file descriptors) and
become tensors in the caller (``PreprocessResult.to_processed_image``)."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import io
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import weakref
from collections.abc import Hashable
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from mm_serve.config import ModelConfig, MultiModalConfig
from mm_serve.distributed.mp_context import no_main_context
from mm_serve.encoders.base import ImageProcessor, ProcessedImage
from mm_serve.encoders.image_io import load_image
from mm_serve.encoders.processors import get_image_processor
from mm_serve.encoders.video_processors import VideoLimits, VideoProcessor

logger = logging.getLogger(__name__)

# Imported once by the forkserver, so that every forked worker starts with them loaded. This
# module first: importing mm_serve makes torchvision importable on CPU hosts (see _compat).
# PyAV (0.15 s to import) and the video processor: a worker's first video pays no import.
_FORKSERVER_PRELOAD = [
    __name__,
    "torchvision.transforms.v2.functional",
    "av",
    "mm_serve.encoders.qwen2_vl_video_processor",
    "mm_serve.encoders.qwen3_vl_video_processor",
]

# The worker process's image processor, built by _init_worker.
_processor: ImageProcessor | None = None
_max_pixels: int = 0
_video_limits = VideoLimits()


@dataclass
class PreprocessResult:
    """One preprocessed image as it crosses the process boundary.

    ``pixel_values`` is ``ProcessedImage.pixel_values`` as a numpy array (uint8 where the
    family defers normalisation to the device, else float32; shape per family: see
    ``ProcessedImage``); ``pid`` is the worker process that made it.
    """

    pixel_values: np.ndarray
    num_tokens: int
    image_grid_thw: tuple[int, int, int] | None
    pid: int
    pixel_mean: tuple[float, ...] = ()
    pixel_std: tuple[float, ...] = ()
    token_ids: tuple[int, ...] | None = None  # ``ProcessedImage.token_ids``
    image_size: tuple[int, int] | None = None  # ``ProcessedImage.image_size``
    modality: str = "image"  # ``ProcessedImage.modality``
    second_per_grid_t: float | None = None  # ``ProcessedImage.second_per_grid_t``

    @classmethod
    def of(cls, item: ProcessedImage) -> PreprocessResult:
        """The numpy form of ``item``, made in this worker (no copy)."""
        return cls(
            item.pixel_values.numpy(),
            item.num_tokens,
            item.image_grid_thw,
            os.getpid(),
            item.pixel_mean,
            item.pixel_std,
            item.token_ids,
            item.image_size,
            item.modality,
            item.second_per_grid_t,
        )

    def to_processed_image(self) -> ProcessedImage:
        """The torch form, sharing the array's memory (no copy)."""
        pixels, grid = torch.from_numpy(self.pixel_values), self.image_grid_thw
        return ProcessedImage(
            pixels,
            self.num_tokens,
            grid,
            self.pixel_mean,
            self.pixel_std,
            self.token_ids,
            self.image_size,
            self.modality,
            self.second_per_grid_t,
        )


def warm_up_image(size: int = 224) -> bytes:
    """A ``size`` x ``size`` PNG (a colour gradient): what start-up pushes through the pipeline
    so that the first user image finds every code path loaded."""
    ramp = np.linspace(0, 255, size, dtype=np.uint8)
    pixels = np.stack(np.broadcast_arrays(ramp[None, :], ramp[:, None], ramp[::-1, None]), -1)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _init_worker(
    model_path: str,
    hf_config: dict[str, Any],
    processor_max_pixels: int | None,
    mm_processor_kwargs: dict[str, Any] | None,
    max_pixels: int,
    video_limits: VideoLimits,
) -> None:
    global _processor, _max_pixels, _video_limits
    _exit_with_owner()
    # One image per worker at a time: parallelism comes from the number of workers.
    torch.set_num_threads(1)
    _processor = get_image_processor(
        model_path, hf_config, processor_max_pixels, mm_processor_kwargs
    )
    _max_pixels, _video_limits = max_pixels, video_limits
    # Pillow's plugins and the first resize load lazily: pay that now, not on a user's image.
    _run_job(warm_up_image())


def _exit_with_owner() -> None:
    """Exit this worker as soon as the process that owns the pool dies, even by SIGKILL (it
    then never sends the shutdown sentinel, and the worker would wait on its queue forever).

    A worker's ``parent_process()`` is the owner (the forkserver only forks it), and its
    sentinel becomes readable when the owner's end of the pipe closes, that is when it dies.
    """
    owner = multiprocessing.parent_process()
    if owner is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([owner.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="owner-watch", daemon=True).start()


def _worker_ready() -> int:
    return os.getpid()


def preprocess_image(
    source: Any, processor: ImageProcessor, max_pixels: int | None
) -> PreprocessResult:
    """Decode ``source`` (see ``load_image``; EXIF-rotated), check ``max_pixels``, convert and
    resize by ``processor``; patchifying and normalising are left to the device where the
    family allows it (uint8 pixels, see ``ProcessedImage``). What a worker does with an image
    (``_run_job``), and the front end with one whose preprocessing only copies its pixels
    (``ImageProcessor.copies_only``). Raises ``ValueError``: undecodable data, a missing
    file, too many pixels, a rejected image."""
    image = load_image(source, max_pixels)
    return PreprocessResult.of(processor.preprocess(image, defer_normalization=True))


def _run_job(source: Any, processor: ImageProcessor | None = None) -> PreprocessResult:
    """``preprocess_image`` by ``processor``, else the worker's, with the server's bound."""
    assert _processor is not None, "worker not initialised"
    return preprocess_image(source, processor or _processor, _max_pixels)


def _run_video_job(source: Any, processor: VideoProcessor) -> PreprocessResult:
    """Decode ``source`` (``video_io.VideoSource``), sample, check the server's
    ``VideoLimits`` before decoding, resize (uint8 frames: normalised and patchified on the
    device). Raises ``ValueError``: undecodable data, a missing file, a video over a limit."""
    item = processor.preprocess(source, _video_limits, defer_normalization=True)
    return PreprocessResult.of(item)


class PreprocessPool:
    """``mm_config.mm_preprocess_workers`` processes that preprocess images for one model.

    The processes start with ``start()``, or else with the first ``submit`` (a text-only model
    never starts them), and stop on ``shutdown()``, when the pool is garbage-collected, or at
    interpreter exit; they exit when the owner dies.

    Jobs are handed to the workers no more than one per worker at a time, from their
    ``group`` (a request's images) in turn, oldest first within a group: a request of a
    dozen huge images holds one worker's turn, not the whole queue ahead of the next request.

    Raises (from ``submit``'s future):
        ValueError: the image is undecodable, missing, or above ``mm_config.max_pixels``;
            the message is the worker's.
    """

    def __init__(self, model_config: ModelConfig, mm_config: MultiModalConfig) -> None:
        self.num_workers = mm_config.mm_preprocess_workers
        self.max_pixels = mm_config.max_pixels  # a larger input image is rejected
        # Plain values only: the HF config as a dict, so workers need not import transformers.
        self._init_args = (
            model_config.path,
            model_config.hf_config.to_dict(),
            mm_config.processor_max_pixels,
            mm_config.mm_processor_kwargs,
            self.max_pixels,
            VideoLimits(
                mm_config.max_video_frames, mm_config.max_video_tokens, mm_config.max_pixels
            ),
        )
        self._executor: concurrent.futures.ProcessPoolExecutor | None = None
        self._finalizer: weakref.finalize | None = None
        self._closed = False
        self._lock = threading.Lock()  # guards starting and stopping the executor
        # Jobs not yet handed to the executor, per group in turn order; the jobs handed over.
        self._queued: collections.OrderedDict[Hashable, collections.deque] = (
            collections.OrderedDict()
        )
        self._running = 0
        # Guards the two above; never held while waiting for the executor (its callbacks
        # take it).
        self._queue_lock = threading.RLock()

    def submit(
        self, source: Any, processor: ImageProcessor | None = None, group: Hashable = None
    ) -> concurrent.futures.Future[PreprocessResult]:
        """Queue one image (encoded bytes, a file path or a PIL image) for preprocessing, by
        ``processor`` (a request's variant of the checkpoint's: ``ImageProcessor.with_kwargs``,
        ``low_detail``) or else the workers' own, in ``group``'s turn (None: a group of its
        own).

        Raises:
            RuntimeError: the pool was shut down.
        """
        return self._enqueue(group, _run_job, source, processor)

    def submit_video(
        self, source: Any, processor: VideoProcessor, group: Hashable = None
    ) -> concurrent.futures.Future[PreprocessResult]:
        """Queue one video (``video_io.VideoSource``: encoded bytes, a file path or decoded
        frames) for ``processor`` (the checkpoint's video processor, or a request's variant),
        in ``group``'s turn.

        Raises:
            RuntimeError: the pool was shut down.
        """
        return self._enqueue(group, _run_video_job, source, processor)

    def _enqueue(self, group: Hashable, job: Any, source: Any, processor: Any) -> Future:
        if isinstance(source, memoryview):
            source = source.tobytes()  # memoryviews do not pickle
        future: Future = Future()
        with self._queue_lock:
            if self._closed:
                raise RuntimeError("The preprocessing pool has been shut down.")
            key = object() if group is None else group
            self._queued.setdefault(key, collections.deque()).append(
                (future, job, source, processor)
            )
            self._dispatch()
        return future

    def _dispatch(self) -> None:
        """Hand queued jobs to the executor while fewer than ``num_workers`` run: the oldest
        of the first group, which then goes to the back of the turn (under ``_queue_lock``)."""
        while self._running < self.num_workers and self._queued and not self._closed:
            group, jobs = next(iter(self._queued.items()))
            future, job, source, processor = jobs.popleft()
            if jobs:
                self._queued.move_to_end(group)
            else:
                del self._queued[group]
            if future.cancelled():
                continue
            try:
                inner = self._submit(job, source, processor)
            except Exception as e:  # a pool that cannot start: the job fails, not the caller
                future.set_exception(e)
                continue
            self._running += 1
            inner.add_done_callback(functools.partial(self._on_job_done, future))

    def _on_job_done(self, future: Future, inner: Future) -> None:
        """In the executor's thread: pass the job's outcome on, then hand over the next job."""
        with self._queue_lock:
            self._running -= 1
            self._dispatch()
        with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled by its owner
            if inner.cancelled():
                future.cancel()
            elif inner.exception() is not None:
                future.set_exception(inner.exception())
            else:
                future.set_result(inner.result())

    def _submit(self, job: Any, source: Any, processor: Any) -> concurrent.futures.Future:
        with self._lock:
            try:
                return self._get_executor().submit(job, source, processor)
            except BrokenProcessPool:
                # A worker died (killed, out of memory): its futures failed; start afresh.
                logger.warning("a preprocessing worker died; restarting the pool")
                self._stop_executor(wait=False)
                return self._get_executor().submit(job, source, processor)

    def start(self) -> list[concurrent.futures.Future[int]]:
        """Start every worker now, rather than with the first images; returns at once.

        Each worker builds its processor and preprocesses ``warm_up_image()`` before it takes
        a job. Returns the futures of small start-up jobs (a worker's pid each), done once
        warm workers took them; ``result()`` raises ``BrokenProcessPool`` when a worker failed
        to start. Images submitted meanwhile queue behind them.

        Raises:
            RuntimeError: the pool was shut down.
        """
        logger.info("Starting %d preprocessing workers", self.num_workers)
        with self._lock:
            executor = self._get_executor()
            # A submit starts one more process unless a worker is idle (one that finished
            # its job already): submit until every worker has started (bounded).
            n = self.num_workers
            jobs = [executor.submit(_worker_ready) for _ in range(n)]
            while len(executor._processes or {}) < n and len(jobs) < 4 * n:
                jobs.append(executor.submit(_worker_ready))
            return jobs

    def worker_pids(self) -> list[int]:
        """The pids of the worker processes running now (none before the first submit)."""
        with self._lock:
            if self._executor is None:
                return []
            return list(self._executor._processes or {})

    def shutdown(self) -> None:
        """Stop the workers and wait for them to exit; queued images are cancelled. Safe to
        call more than once; ``submit`` raises afterwards."""
        with self._queue_lock:
            self._closed = True
            queued = [item[0] for jobs in self._queued.values() for item in jobs]
            self._queued.clear()
        for future in queued:
            future.cancel()
        with self._lock:
            self._stop_executor(wait=True)

    def _get_executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._closed:
            raise RuntimeError("The preprocessing pool has been shut down.")
        if self._executor is None:
            context = no_main_context("forkserver")
            context.set_forkserver_preload(_FORKSERVER_PRELOAD)
            executor = concurrent.futures.ProcessPoolExecutor(
                self.num_workers,
                mp_context=context,
                initializer=_init_worker,
                initargs=self._init_args,
            )
            # Holds the executor, not the pool: runs when the pool is collected or at exit. Never
            # waits: a finalizer may run in any thread, including the executor's own manager.
            stop = functools.partial(executor.shutdown, wait=False, cancel_futures=True)
            self._finalizer = weakref.finalize(self, stop)
            self._executor = executor
        return self._executor

    def _stop_executor(self, wait: bool) -> None:
        if self._executor is None:
            return
        self._finalizer.detach()
        self._executor.shutdown(wait=wait, cancel_futures=True)
        self._executor = None
