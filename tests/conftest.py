"""Shared fixtures: tiny random-weight checkpoints built offline, and HF reference runs."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from tests.fixtures.checkpoints import build_tiny_checkpoint
from tests.fixtures.server import (
    VLM_MAX_MODEL_LEN,
    VLM_NUM_KV_BLOCKS,
    VLM_SERVED_NAME,
    openai_of,
    serve_checked,
)
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

# One intra-op CPU thread per test process and per server, engine core and worker it starts
# (they inherit the variable), unless OMP_NUM_THREADS says otherwise: the tiny test models
# gain nothing from a second thread, and with several pytest-xdist workers on two cores (``make
# test``) the threads of each would spin-wait for cores the other holds.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Each pytest-xdist worker gets its own temp folder (inherited by the processes its tests
# start): a test that checks its engine left no ipc folder must not see another worker's.
if _worker := os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["TMPDIR"] = tempfile.mkdtemp(prefix=f"pytest-{_worker}-")
    tempfile.tempdir = None  # re-read TMPDIR
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("llama"), family="llama", seed=0)


@pytest.fixture(scope="session")
def qwen2_path(tmp_path_factory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("qwen2"), family="qwen2", seed=1)


@pytest.fixture(scope="session")
def vlm_path(tmp_path_factory) -> str:
    """A tiny Qwen2-VL (the API tests' server; a module may define its own)."""
    return build_tiny_vlm_checkpoint(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl", seed=5)


@pytest.fixture(scope="session")
def vlm_llm(vlm_path):
    """The offline engine on ``vlm_path``, sized as the API tests' servers (the reference of
    what they serve). Shared by the session: tests only compare outputs with it."""
    from mm_serve import LLM

    llm = LLM(vlm_path, max_model_len=VLM_MAX_MODEL_LEN, num_kv_blocks=VLM_NUM_KV_BLOCKS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def vlm_server(vlm_path):
    """``mm-serve serve`` on ``vlm_path`` as ``VLM_SERVED_NAME``, sized as ``vlm_llm``, shared
    by the API test modules that need no other flag and no fresh server state; at the end of
    the session it must exit with 0 and leave no process."""
    args = ["--max-model-len", str(VLM_MAX_MODEL_LEN), "--num-kv-blocks", str(VLM_NUM_KV_BLOCKS)]
    yield from serve_checked(vlm_path, [*args, "--served-model-name", VLM_SERVED_NAME])


@pytest.fixture(scope="session")
def vlm_openai(vlm_server):
    """An official ``openai.OpenAI`` client of ``vlm_server``."""
    return openai_of(vlm_server)


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def model_path(request, llama_path, qwen2_path) -> str:
    return {"llama": llama_path, "qwen2": qwen2_path}[request.param]


class HFReference:
    """HF transformers on the same folder: greedy ``generate`` and prompt log-probs."""

    def __init__(self, path: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        self._cache: dict = {}

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int, **kwargs):
        """Returns (generated token ids, per-step log-softmax [steps, vocab])."""
        key = (tuple(prompt_ids), max_new_tokens, tuple(sorted(kwargs.items())))
        if key not in self._cache:
            out = self.model.generate(
                torch.tensor([prompt_ids]),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                **kwargs,
            )
            tokens = out.sequences[0, len(prompt_ids) :].tolist()
            logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
            self._cache[key] = (tokens, logprobs)
        return self._cache[key]

    @torch.inference_mode()
    def prompt_logprobs(self, prompt_ids: list[int]) -> torch.Tensor:
        """[len(prompt) - 1, vocab]: row p is the distribution of prompt token p + 1."""
        logits = self.model(torch.tensor([prompt_ids])).logits[0, :-1]
        return torch.log_softmax(logits.float(), dim=-1)


@pytest.fixture(scope="session")
def hf_reference():
    references: dict[str, HFReference] = {}

    def get(path: str) -> HFReference:
        if path not in references:
            references[path] = HFReference(path)
        return references[path]

    return get
