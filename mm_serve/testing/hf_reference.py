"""HF transformers as the tests' reference: greedy generation with each step's log-probs."""

from __future__ import annotations

from typing import Any

import torch


@torch.inference_mode()
def hf_greedy_generate(
    model: Any, inputs: Any, max_new_tokens: int
) -> tuple[list[int], list[int], torch.Tensor]:
    """(prompt ids, greedy ids, per-step log-softmax ``[steps, vocab]``) of ``model.generate``
    on ``inputs``, a processor's output for one prompt."""
    out = model.generate(
        **inputs,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    prompt_ids = inputs["input_ids"][0].tolist()
    logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
    return prompt_ids, out.sequences[0, len(prompt_ids) :].tolist(), logprobs
