"""Ask a question about an image through the official ``openai`` package.

    .venv/bin/python samples/client_openai.py [IMAGE] [QUESTION] [--base-url URL] [--api-key KEY]

Defaults: matplotlib's photo of Grace Hopper, "What is in this picture?", a server at
http://127.0.0.1:8000 (start one with ``make serve``). The image is sent inline as a base64
``data:`` URL; the answer streams to stdout, then the token usage.
"""

from __future__ import annotations

import argparse
import base64
import mimetypes
import os
from pathlib import Path

from openai import OpenAI


def default_image() -> str:
    import matplotlib

    return str(Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg")


def data_url(path: str) -> str:
    mime = mimetypes.guess_type(path)[0] or "application/octet-stream"
    return f"data:{mime};base64,{base64.b64encode(Path(path).read_bytes()).decode()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("image", nargs="?", default=default_image())
    parser.add_argument("question", nargs="?", default="What is in this picture?")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=os.environ.get("MM_SERVE_API_KEY", "EMPTY"))
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    client = OpenAI(base_url=f"{args.base_url.rstrip('/')}/v1", api_key=args.api_key)
    model = client.models.list().data[0].id
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(args.image)}},
                {"type": "text", "text": args.question},
            ],
        }
    ]
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=args.max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = None
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        usage = chunk.usage or usage
    print()
    if usage is not None:
        print(f"[{model}] prompt {usage.prompt_tokens} tokens, answer {usage.completion_tokens}")


if __name__ == "__main__":
    main()
