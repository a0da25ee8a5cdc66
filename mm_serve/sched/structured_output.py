"""The engine's side of structured outputs: compiled grammars, one matcher per request, and
each step's token bitmask (see ``mm_serve/messages/structured_outputs.py`` for the method).

Grammars compile on a worker thread, never on the engine loop, through one xgrammar
``GrammarCompiler`` that caches compiled grammars by their text (a schema sent with every
request compiles once). The scheduler leaves a request waiting until its grammar is ready.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from mm_serve.checkpoint.hub import eos_token_ids, load_generation_config
from mm_serve.config import ModelConfig
from mm_serve.messages.request import Request
from mm_serve.messages.structured_outputs import compiler_message, json_schema_grammar
from mm_serve.sched.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class GrammarBitmask:
    """The tokens each grammar request may sample this step.

    ``bitmask[i]`` belongs to ``req_ids[i]``: ``[ceil(num_tokens / 32)]`` int32 words, bit
    ``j`` of word ``w`` set when token ``32 * w + j`` is allowed (xgrammar's layout). Logits
    past the tokenizer's size (the model's padding of its vocabulary) are never allowed.
    """

    req_ids: list[str]
    bitmask: torch.Tensor  # [len(req_ids), ceil(num_tokens / 32)] int32, on the CPU
    num_tokens: int  # the tokenizer's size: the bits past it are not xgrammar's


@dataclass
class RequestGrammar:
    """One request's grammar: compiling (``compiled``), then followed by ``matcher``."""

    compiled: Future
    matcher: Any = None  # xgrammar.GrammarMatcher, once compiled
    num_accepted: int = 0  # output tokens the matcher has taken
    done: bool = False  # the output is complete, or took a token the grammar forbids

    def accept(self, token_id: int, index: int) -> None:
        """Take output token number ``index`` (from 0), unless already taken or done."""
        if self.done or self.num_accepted != index:
            return
        self.num_accepted += 1
        if not self.matcher.accept_token(token_id):
            logger.warning("A request sampled token %d, which its grammar forbids.", token_id)
            self.done = True
        else:
            self.done = self.matcher.is_terminated()


class StructuredOutputManager:
    """Compiles grammars off the engine loop and fills the bitmask of each step.

    Args:
        model_config: its tokenizer defines the vocabulary (the bitmask's width is the
            tokenizer's size: xgrammar's work per token grows with the ids it does not know).
        pin_memory: the bitmask buffer is pinned, for an asynchronous copy to the device.
    """

    def __init__(self, model_config: ModelConfig, pin_memory: bool = False) -> None:
        self.model_config = model_config
        self.pin_memory = pin_memory
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-compiler")
        self._compiler: Any = None  # made on the executor's thread, with the first grammar
        self._tokenizer_size = 0  # the bitmask's width in tokens, set with the compiler
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(tokenizer size / 32)] int32
        self._batch_matcher: Any = None  # xgrammar.BatchGrammarMatcher

    def add_request(self, request: Request) -> None:
        """Start compiling the request's grammar (``request.grammar``)."""
        key = request.sampling_params.structured_outputs.key
        request.grammar = RequestGrammar(self._executor.submit(self._compile, key))

    def is_ready(self, request: Request) -> bool:
        """Whether the request's grammar is compiled (it then gets its matcher).

        Raises:
            ValueError: the grammar did not compile (the front end checks first, so only a
                request that bypassed it gets here).
        """
        grammar = request.grammar
        if grammar.matcher is None:
            if not grammar.compiled.done():
                return False
            import xgrammar

            try:
                compiled = grammar.compiled.result()
            except Exception as e:  # xgrammar raises RuntimeError; the loader OSError
                raise ValueError(compiler_message(e)) from e
            grammar.matcher = xgrammar.GrammarMatcher(compiled)
        return True

    def accept_tokens(self, runner_output: ModelRunnerOutput, requests: dict[str, Request]) -> None:
        """Advance the matchers of the grammar requests by the tokens they sampled in a step,
        ahead of ``update_from_output``: the engine then fills the next bitmask before that
        update. (One call per token: xgrammar's threaded ``batch_accept_token`` is slower at
        these batch sizes.)"""
        outputs = zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True)
        for req_id, sampled in outputs:
            request = requests.get(req_id)
            if request is not None and request.grammar is not None and sampled:
                # One token per step and request (no speculative decoding).
                request.grammar.accept(sampled[0], request.num_output_tokens)

    def accept_token(self, request: Request, token_id: int) -> bool:
        """Advance the request's matcher by its last output token (unless ``accept_tokens``
        did); True when its output is complete (the grammar accepted a stop token) or cannot
        continue (a token the grammar forbids)."""
        request.grammar.accept(token_id, request.num_output_tokens - 1)
        return request.grammar.done

    def grammar_bitmask(
        self, scheduler_output: SchedulerOutput, requests: dict[str, Request]
    ) -> GrammarBitmask | None:
        """The tokens each grammar request (of ``requests``, the scheduler's, by id) sampling in
        the step may sample, from its matcher's state: call it once the tokens of earlier steps
        are appended (the scheduler's ``update_from_output``). None when the step has none
        (finished ones are left out)."""
        ids = scheduler_output.structured_output_request_ids
        live = [requests[i] for i in ids if i in requests]
        live = [r for r in live if not r.grammar.done]
        if not live:
            return None
        if self._bitmask is None or len(self._bitmask) < len(live):
            # Allocating costs more than filling: one buffer, grown as needed. Its copy to the
            # device is queued before the step's sampling, whose tokens the engine reads before
            # it fills the buffer again.
            rows = max(len(live), 2 * len(self._bitmask if self._bitmask is not None else ()))
            words = -(-self._tokenizer_size // 32)
            self._bitmask = torch.empty((rows, words), dtype=torch.int32)
            if self.pin_memory:
                self._bitmask = self._bitmask.pin_memory()
        if self._batch_matcher is None:
            import xgrammar

            self._batch_matcher = xgrammar.BatchGrammarMatcher()
        bitmask = self._bitmask[: len(live)]
        matchers = [r.grammar.matcher for r in live]
        self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask)
        return GrammarBitmask([r.request_id for r in live], bitmask, self._tokenizer_size)

    # ---- on the compiler thread ------------------------------------------------------------

    def _compile(self, key: tuple[str, str]) -> Any:
        compiler = self._compiler or self._make_compiler()
        kind, text = key
        if kind == "json":
            return compiler.compile_grammar(json_schema_grammar(text))
        if kind == "regex":
            return compiler.compile_regex(text)
        return compiler.compile_grammar(text)

    def _make_compiler(self) -> Any:
        """The compiler for the model's tokenizer. Its stop tokens (allowed once the output is
        complete) are the tokenizer's EOS and those of ``generation_config.json``."""
        import xgrammar
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model_config.tokenizer)
        generation_config = load_generation_config(self.model_config.path)
        stop_ids = eos_token_ids(tokenizer.eos_token_id, generation_config)
        self._tokenizer_size = len(tokenizer)
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self._tokenizer_size, stop_token_ids=stop_ids
        )
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=4, cache_enabled=True)
        return self._compiler
