"""Incremental detokenization and stop strings."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from mm_serve.messages.sampling_params import SamplingParams

# Prompt tokens fed to the decoder first, so the first output token decodes in context
# (a leading space, a multi-byte character continued from the prompt).
_PROMPT_CONTEXT_TOKENS = 6
# A deferred text drops at most this many last tokens that end in an incomplete character.
_MAX_HELD_BACK = 4


class IncrementalDetokenizer:
    """Turns output tokens into text as they arrive and stops at the first stop string.

    Uses the ``tokenizers`` library's ``DecodeStream``, which holds back tokens until they form
    whole UTF-8 characters. Given ``output_token_ids`` (the caller's list of the output's
    tokens, for a whole output read once it is finished) and no stop strings, nothing is
    decoded per token: the text is decoded from that list when read (``decode_whole``), the
    same text in one decode call per request instead of a stream step per token.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_token_ids: list[int] | None = None,
    ) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._skip_special_tokens = skip = params.skip_special_tokens
        self._stop = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._deferred = None if params.stop else output_token_ids  # read, never written
        if self._deferred is None:
            self._stream = DecodeStream(ids=self._context, skip_special_tokens=skip)
        self._text, self._num_decoded = "", 0  # deferred: the text of the first tokens

    @property
    def text(self) -> str:
        """The output's text so far."""
        deferred = self._deferred
        if deferred is not None and self._num_decoded < len(deferred):
            self._text, self._num_decoded = self.decode_whole(deferred), len(deferred)
        return self._text

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens' text; return the stop string that ended the text, if one did."""
        if self._deferred is not None:  # the caller's list holds them already
            return None
        for token_id in new_token_ids:
            piece = self._stream.step(self._backend, token_id)
            if not piece:
                continue
            self._text += piece
            stop = self._check_stop_strings(len(piece))
            if stop is not None:
                return stop
        return None

    def decode_whole(self, token_ids: list[int]) -> str:
        """The text that ``DecodeStream`` makes of ``token_ids`` after the prompt's context, in
        a few decode calls: the decoded context and tokens less the decoded context, without
        the last tokens whose text ends in a replacement character (an incomplete UTF-8
        sequence, which the stream holds back). Where the decoded context is not a prefix, or
        more than ``_MAX_HELD_BACK`` tokens end so, the tokens go through a stream instead."""
        decode, skip = self._backend.decode, self._skip_special_tokens
        context = decode(self._context, skip_special_tokens=skip)
        for end in range(len(token_ids), max(-1, len(token_ids) - _MAX_HELD_BACK - 1), -1):
            whole = decode(self._context + token_ids[:end], skip_special_tokens=skip)
            if not whole.startswith(context):
                break
            if not whole.endswith("\ufffd"):
                return whole[len(context) :]
        stream = DecodeStream(ids=self._context, skip_special_tokens=skip)
        return "".join(stream.step(self._backend, t) or "" for t in token_ids)

    def _check_stop_strings(self, num_new_chars: int) -> str | None:
        """Find the earliest stop string that ends in the new text and cut the text there."""
        text = self._text
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
        self._text = text[: index + len(stop)] if self._include_stop else text[:index]
        return stop
