"""Python SDK of the mm_serve API server: sync and async clients, streaming, images from a
path, bytes, a PIL image or a URL, typed responses and typed errors.

```python
from mm_serve.client import Client

with Client("http://127.0.0.1:8000") as client:
    reply = client.chat(text="What is in this picture?", images=["photo.jpg"], max_tokens=64)
    print(reply.choices[0].message.content)
    for chunk in client.chat(text="Describe it.", images=["photo.jpg"], stream=True):
        print(chunk.choices[0].delta.content or "", end="")
```
"""

from mm_serve.client._async import AsyncClient, AsyncStream
from mm_serve.client._sync import Client, Stream
from mm_serve.client.errors import (
    APIConnectionError,
    APIError,
    APIResponseValidationError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    InternalServerError,
    MMServeError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    RequestTooLargeError,
    ServiceUnavailableError,
    UnprocessableEntityError,
)
from mm_serve.client.images import image_part, image_to_url, user_message
from mm_serve.client.types import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatMessage,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Completion,
    CompletionChoice,
    Delta,
    Model,
    TokenLogprob,
    TopLogprob,
    Usage,
)

__all__ = [
    "Client",
    "AsyncClient",
    "Stream",
    "AsyncStream",
    "image_part",
    "image_to_url",
    "user_message",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatMessage",
    "Choice",
    "ChoiceLogprobs",
    "ChunkChoice",
    "Completion",
    "CompletionChoice",
    "Delta",
    "Model",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "MMServeError",
    "APIError",
    "APIConnectionError",
    "APITimeoutError",
    "APIResponseValidationError",
    "BadRequestError",
    "AuthenticationError",
    "PermissionDeniedError",
    "NotFoundError",
    "RequestTooLargeError",
    "UnprocessableEntityError",
    "RateLimitError",
    "InternalServerError",
    "ServiceUnavailableError",
]
