"""The models a server answers for (vLLM's ``serving_models``): the base model under its served
names, and LoRA adapters by name: those of ``--lora-modules``, checked at start-up, and, while
``MM_SERVE_ALLOW_RUNTIME_LORA_UPDATING`` (or vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) is
``1`` or ``true``, those of ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

Each adapter gets the next ``lora_int_id`` (1, 2, ...), never reused: the engine's adapter
cache, its GPU slots and the prefix cache key on the id, so what an unloaded adapter left there
is never taken for a later one's (it ages out of the engine's LRU). An unloaded adapter's
requests in flight run to their end. Runtime loading needs a single API-server process
(``cli.server_config_from`` refuses it with several: each would hold its own list).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from mm_serve.entrypoints.openai.errors import APIError, bad_request
from mm_serve.entrypoints.openai.protocol import ModelCard
from mm_serve.entrypoints.openai.serving_common import ModelInfo
from mm_serve.frontend.async_llm import AsyncLLM
from mm_serve.lora.request import LoRAAdapterError, LoRARequest

logger = logging.getLogger(__name__)

# Either one set to 1 or true adds the runtime load / unload routes (vLLM's is read too).
RUNTIME_LORA_ENV = ("MM_SERVE_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_lora_updating() -> bool:
    """Whether one of ``RUNTIME_LORA_ENV`` is ``1`` or ``true`` (any case)."""
    return any(os.environ.get(n, "").strip().lower() in ("1", "true") for n in RUNTIME_LORA_ENV)


@dataclass(frozen=True)
class LoRAModulePath:
    """An adapter of ``--lora-modules``: served as ``name``, read from the ``peft`` folder
    ``path``; ``base_model_name`` is its ``parent`` in ``/v1/models`` (None: the served
    model's first name)."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoRAModulePath:
        """``name=path`` or vLLM's JSON ``{"name": ..., "path": ..., "base_model_name": ...}``
        (``base_model_name`` optional).

        Raises:
            ValueError: neither form, or an empty name or path.
        """
        if text.lstrip().startswith("{"):
            try:
                fields = json.loads(text)
                module = cls(**fields)
            except (json.JSONDecodeError, TypeError) as e:
                raise ValueError(
                    f'expected {{"name": ..., "path": ..., "base_model_name": ...}}: {e}'
                ) from None
        else:
            name, _, path = text.partition("=")
            module = cls(name.strip(), path.strip())
        if not isinstance(module.name, str) or not isinstance(module.path, str):
            raise ValueError(f"a LoRA module's name and path are strings: {text!r}")
        if not module.name or not module.path:
            raise ValueError(f"expected name=path, not {text!r}")
        return module


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter``'s body (vLLM's)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter``'s body (vLLM's; ``lora_int_id`` is accepted and not
    needed: the name says which)."""

    lora_name: str
    lora_int_id: int | None = None


class ServingModels:
    """The base model and the adapters of ``info`` (its ``loras``, which the request handlers
    read): lists them as model cards, adds and removes adapters."""

    def __init__(self, llm: AsyncLLM, info: ModelInfo) -> None:
        self.llm, self.info = llm, info
        self._ids = itertools.count(1)

    def add_static(self, modules: Iterable[LoRAModulePath]) -> None:
        """Serve ``--lora-modules``, each checked now (it blocks: for start-up).

        Raises:
            LoRAAdapterError: an adapter that cannot be served, LoRA off, or a name taken;
                the message names the module.
        """
        for module in modules:
            try:
                lora = self._new_request(module.name, module.path, module.base_model_name)
                self.llm.input_processor.check_lora_request(lora)
            except LoRAAdapterError as e:
                raise LoRAAdapterError(f"--lora-modules {module.name}: {e}") from None
            self.info.loras[module.name] = lora
            logger.info("Serving LoRA adapter %r (id %d)", lora.lora_name, lora.lora_int_id)

    async def load(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter at ``path`` as ``name``, checked first (``check_lora_request``,
        in a thread) so that nothing is added when it cannot be served.

        Raises:
            APIError: (400) an empty name or path, a name already served, or the
                ``LoRAAdapterError`` of an adapter that cannot be served.
        """
        if not name or not path:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.")
        lora = None
        try:
            lora = self._new_request(name, path)
            await asyncio.to_thread(self.llm.input_processor.check_lora_request, lora)
            self._check_name_free(name)  # another load may have taken it meanwhile
        except LoRAAdapterError as e:
            if lora is not None:
                self._forget(lora)  # its id is new: nothing else is forgotten
            raise bad_request(str(e)) from None
        self.info.loras[name] = lora
        logger.info("Loaded LoRA adapter %r (id %d) from %s", name, lora.lora_int_id, path)
        return lora

    def unload(self, name: str) -> None:
        """Stop serving the adapter ``name``; its requests in flight finish.

        Raises:
            APIError: (404) no adapter of that name.
        """
        lora = self.info.loras.pop(name, None)
        if lora is None:
            raise APIError(404, f"The lora adapter {name!r} cannot be found.", param="lora_name")
        self._forget(lora)
        logger.info("Unloaded LoRA adapter %r (id %d)", name, lora.lora_int_id)

    def cards(self) -> list[ModelCard]:
        """Cards of the base model's names, then of each adapter."""
        return [self.card(name) for name in (*self.info.names, *self.info.loras)]

    def card(self, name: str) -> ModelCard:
        """The card of a served name: an adapter's has its folder as ``root`` and its base
        model as ``parent`` (vLLM's).

        Raises:
            APIError: (404) a name not served.
        """
        self.info.name_for(name)
        max_model_len = self.llm.max_model_len
        lora = self.info.loras.get(name)
        if lora is None:
            return ModelCard(id=name, root=self.info.root, max_model_len=max_model_len)
        parent = lora.base_model_name or self.info.names[0]
        return ModelCard(id=name, root=lora.lora_path, parent=parent, max_model_len=max_model_len)

    def _new_request(self, name: str, path: str, base: str | None = None) -> LoRARequest:
        """A LoRARequest of the next id, for a name not served yet (LoRAAdapterError else)."""
        self._check_name_free(name)
        return LoRARequest(name, next(self._ids), path, base_model_name=base)

    def _check_name_free(self, name: str) -> None:
        if name in self.info.names:
            raise LoRAAdapterError(f"{name!r} is the base model's name; name the adapter else.")
        if name in self.info.loras:
            raise LoRAAdapterError(f"The lora adapter {name!r} has already been loaded.")

    def _forget(self, lora: LoRARequest) -> None:
        registry = self.llm.input_processor.lora
        if registry is not None:
            registry.forget(lora.lora_int_id)


def add_lora_routes(app: FastAPI, models: ServingModels) -> None:
    """``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's; the caller adds
    them only when ``runtime_lora_updating()``). Success is a 200 with a line of text."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        await models.load(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        models.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
