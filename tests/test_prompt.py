"""``Prompt.parse``: vLLM's prompt forms become one typed ``Prompt``, or a ValueError."""

from __future__ import annotations

import pytest

from mm_serve.frontend.processor import Prompt


def test_parse_types_each_form() -> None:
    assert Prompt.parse("Hi.") == Prompt(text="Hi.")
    assert Prompt.parse({"prompt": "Hi."}) == Prompt(text="Hi.")
    prompt = {
        "prompt_token_ids": (1, 2),
        "multi_modal_data": {"image": b"png"},
        "multi_modal_uuids": {"image": "u-1"},
        "cache_salt": "salt",
    }
    typed = Prompt(token_ids=[1, 2], images=[b"png"], image_uuids=["u-1"], cache_salt="salt")
    assert Prompt.parse(prompt) == typed
    assert Prompt.parse(typed) is typed
    assert Prompt.parse({"prompt": "a", "multi_modal_data": {"image": []}}).images == []


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        (3, "must be a str or a dict"),
        ({"prompt": "a", "images": []}, "Unknown prompt keys"),
        ({"prompt": "a", "cache_salt": 1}, "cache_salt must be a str"),
        ({"cache_salt": "s"}, "needs 'prompt' or 'prompt_token_ids'"),
    ],
)
def test_parse_refuses_malformed_prompts(prompt, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Prompt.parse(prompt)
