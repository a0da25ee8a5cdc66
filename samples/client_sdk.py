"""Ask a question about an image through mm_serve's own SDK, streaming the answer.

    .venv/bin/python samples/client_sdk.py [IMAGE] [QUESTION] [--base-url URL] [--api-key KEY]

Defaults: matplotlib's photo of Grace Hopper, "What is in this picture?", a server at
http://127.0.0.1:8000 (start one with ``make serve``). ``images=`` takes paths, bytes, PIL
images or URLs; the SDK encodes them.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from mm_serve.client import APIError, Client


def default_image() -> str:
    import matplotlib

    return str(Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("image", nargs="?", default=default_image())
    parser.add_argument("question", nargs="?", default="What is in this picture?")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=os.environ.get("MM_SERVE_API_KEY"))
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    with Client(args.base_url, api_key=args.api_key) as client:
        start = time.perf_counter()
        first_token_s = None
        try:
            stream = client.chat(
                text=args.question,
                images=[args.image],
                stream=True,
                max_tokens=args.max_tokens,
                stream_options={"include_usage": True},
            )
        except APIError as e:  # e.g. 400 for an unreadable image, 401 for a wrong key
            message = f"The server refused the request ({e.status_code}): {e.message}"
            raise SystemExit(message) from e
        usage = None
        with stream:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    first_token_s = first_token_s or time.perf_counter() - start
                    print(chunk.choices[0].delta.content, end="", flush=True)
                usage = chunk.usage or usage
        print()
        total_s = time.perf_counter() - start
        if usage is not None:
            print(
                f"[{client.default_model()}] prompt {usage.prompt_tokens} tokens, answer "
                f"{usage.completion_tokens} tokens; TTFT {(first_token_s or total_s):.3f} s, "
                f"total {total_s:.3f} s"
            )


if __name__ == "__main__":
    main()
