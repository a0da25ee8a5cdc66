"""Incremental detokenization and stop strings."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from mm_serve.sampling_params import SamplingParams

# Prompt tokens fed to the decoder first, so the first output token decodes in context
# (a leading space, a multi-byte character continued from the prompt).
_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns output tokens into text as they arrive and stops at the first stop string.

    Uses the ``tokenizers`` library's ``DecodeStream``, which holds back tokens until they form
    whole UTF-8 characters.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(
            ids=list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]),
            skip_special_tokens=params.skip_special_tokens,
        )
        self._stop = params.stop
        self._include_stop = params.include_stop_str_in_output
        self.text = ""

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens' text; return the stop string that ended the text, if one did."""
        for token_id in new_token_ids:
            piece = self._stream.step(self._backend, token_id)
            if not piece:
                continue
            self.text += piece
            stop = self._check_stop_strings(len(piece))
            if stop is not None:
                return stop
        return None

    def _check_stop_strings(self, num_new_chars: int) -> str | None:
        """Find the earliest stop string that ends in the new text and cut the text there."""
        text = self.text
        # Only matches that end inside the new characters are new matches.
        first_end = len(text) - num_new_chars + 1
        found = [
            (i, stop)
            for stop in self._stop
            if (i := text.find(stop, max(0, first_end - len(stop)))) != -1
        ]
        if not found:
            return None
        index, stop = min(found, key=lambda match: match[0])  # the first of the earliest
        self.text = self.text[: index + len(stop)] if self._include_stop else self.text[:index]
        return stop
