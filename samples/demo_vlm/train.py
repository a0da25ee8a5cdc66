"""Train the demo VLM on synthetic scenes and save it as an HF checkpoint.

    python samples/demo_vlm/train.py --out /tmp/demo --time-budget 390            # from scratch
    python samples/demo_vlm/train.py --init /tmp/demo --out /tmp/demo2 --time-budget 300 \
        --per-sample-loss --type-weights text=4,position=1.5,colour=0.25     # continue
    python samples/demo_vlm/train.py --out /tmp/smoke --steps 20 --batch-size 8 --workers 1

MODEL_CARD.md lists the runs that made the shipped checkpoint. The model is HF transformers'
``Qwen2VLForConditionalGeneration`` (see ``model_files``). Data is generated on the fly by
DataLoader workers (fresh scenes every step, worker ``w`` seeded ``seed * 1000 + w``), one
question per scene; the loss covers the answer tokens and the closing ``<|im_end|>`` only.
Prompts are rendered with the checkpoint's own chat template and tokenizer, exactly as the
engine renders them, with the image part first (15% of the time after the question).

With ``--time-budget`` the learning-rate schedule follows elapsed time and training stops when
the budget is spent; ``training.json`` records the steps taken (``--steps`` runs a fixed
count on a step-based schedule), the rendering fingerprint, the held-out accuracy over time
and, after ``--init``, the earlier run's record. Held-out accuracy is measured teacher-forced:
an answer counts when every answer token is the argmax, which is exactly when greedy decoding
would produce it.

Where mm_serve is not installed (a bare GPU image), put only the package on the path: the
repository root also holds a top-level ``kernels/`` folder, which shadows the ``kernels``
package that transformers probes for on import:
``mkdir -p /tmp/pp && ln -sfn $PWD/mm_serve /tmp/pp/mm_serve && PYTHONPATH=/tmp/pp python ...``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_files import (  # noqa: E402
    MAX_PIXELS,
    build_model,
    build_tokenizer,
    pixel_values,
    save_checkpoint,
)
from scenes import (  # noqa: E402
    HELD_OUT_PHRASINGS,
    IMAGE_SIZE,
    QUESTION_TYPES,
    ask,
    casual,
    generate_scene,
    sample_qa,
    training_corpus,
)

IMAGE_TOKENS = (IMAGE_SIZE // 28) ** 2  # 64 after the 2 x 2 merge
GRID = IMAGE_SIZE // 28
TYPE_WEIGHTS = {"colour": 1, "count": 1, "text": 1, "describe": 1, "size": 0.5, "position": 1}
assert IMAGE_SIZE * IMAGE_SIZE <= MAX_PIXELS


class Batcher:
    """Turns (image, question, answer) samples into padded training tensors."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        self.end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.pad_id = tokenizer.pad_token_id

    def encode(self, question: str, answer: str, image_first: bool) -> tuple[list[int], int]:
        """Prompt (placeholder expanded) + answer + <|im_end|>; returns (ids, prompt length)."""
        parts = [{"type": "image"}, {"type": "text", "text": question}]
        messages = [{"role": "user", "content": parts if image_first else parts[::-1]}]
        prompt = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        ids: list[int] = []
        for token in self.tokenizer(prompt, add_special_tokens=False).input_ids:
            ids.extend([token] * IMAGE_TOKENS if token == self.image_id else [token])
        answer_ids = self.tokenizer(answer, add_special_tokens=False).input_ids
        return ids + answer_ids + [self.end_id], len(ids)

    def mrope_positions(self, ids: list[int]) -> np.ndarray:
        """Qwen2-VL M-RoPE positions ``[3, len(ids)]``: text t=h=w=index; an image's tokens
        (t, h, w) = start + (0, row, col); text after it resumes at start + grid side."""
        pos = np.empty((3, len(ids)), dtype=np.int64)
        rows = np.repeat(np.arange(GRID), GRID)
        cols = np.tile(np.arange(GRID), GRID)
        i, cur = 0, 0
        while i < len(ids):
            if ids[i] == self.image_id:
                pos[0, i : i + IMAGE_TOKENS] = cur
                pos[1, i : i + IMAGE_TOKENS] = cur + rows
                pos[2, i : i + IMAGE_TOKENS] = cur + cols
                i, cur = i + IMAGE_TOKENS, cur + GRID
            else:
                pos[:, i] = cur
                i, cur = i + 1, cur + 1
        return pos

    def collate(self, samples: list[tuple[np.ndarray, str, str, bool]]) -> dict[str, torch.Tensor]:
        encoded = [self.encode(q, a, first) for _, q, a, first in samples]
        length = max(len(ids) for ids, _ in encoded)
        input_ids = torch.full((len(samples), length), self.pad_id, dtype=torch.long)
        labels = torch.full((len(samples), length), -100, dtype=torch.long)
        positions = torch.zeros((3, len(samples), length), dtype=torch.long)
        for row, (ids, prompt_len) in enumerate(encoded):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])
            padded = ids + [self.pad_id] * (length - len(ids))
            positions[:, row] = torch.from_numpy(self.mrope_positions(padded))
        images = torch.from_numpy(np.stack([image for image, *_ in samples]))
        return {"images": images, "input_ids": input_ids, "labels": labels, "positions": positions}


class SceneStream(torch.utils.data.IterableDataset):
    """Endless batches of fresh scenes; worker ``w`` draws from ``Random(seed * 1000 + w)``."""

    def __init__(self, batcher: Batcher, batch_size: int, seed: int, weights: dict) -> None:
        self.batcher, self.batch_size, self.seed = batcher, batch_size, seed
        self.weights = weights

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        rng = random.Random(self.seed * 1000 + (info.id if info else 0))
        while True:
            samples = []
            for _ in range(self.batch_size):
                scene = generate_scene(rng)
                qa = sample_qa(scene, rng, self.weights)
                question = casual(qa.question, rng)
                samples.append((np.asarray(scene.image), question, qa.answer, rng.random() > 0.15))
            yield self.batcher.collate(samples)


def held_out(batcher: Batcher, per_type: int, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """Held-out scenes (image first): ``per_type`` of each type asked in trained phrasings
    (key: the type), and ``per_type // 2`` in each held-out phrasing (key: "type/template")."""
    rng = random.Random(seed)
    plan = [(qtype, None, per_type) for qtype in QUESTION_TYPES]
    plan += [(t, p, per_type // 2) for t in QUESTION_TYPES for p in HELD_OUT_PHRASINGS[t]]
    batches = {}
    for qtype, template, wanted in plan:
        samples = []
        while len(samples) < wanted:
            scene = generate_scene(rng)
            qa = ask(scene, qtype, rng, (template,) if template else None)
            if qa is not None:
                samples.append((np.asarray(scene.image), qa.question, qa.answer, True))
        batches[f"{qtype}/{template}" if template else qtype] = batcher.collate(samples)
    return batches


def forward_loss(
    model, batch, device, autocast: bool, per_sample: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy over answer tokens, and per-row "all answer tokens right"."""
    images = batch["images"].to(device, non_blocking=True)
    input_ids = batch["input_ids"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    grid = torch.tensor([[1, IMAGE_SIZE // 14, IMAGE_SIZE // 14]] * len(images), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        hidden = model.model(
            input_ids=input_ids,
            pixel_values=pixel_values(images),
            image_grid_thw=grid,
            position_ids=batch["positions"].to(device, non_blocking=True),
        ).last_hidden_state
        target = labels[:, 1:]
        mask = target != -100
        logits = model.lm_head(hidden[:, :-1][mask]).float()
    if per_sample:  # every answer weighs the same, however many tokens it has
        ce = F.cross_entropy(logits, target[mask], reduction="none")
        lengths = mask.sum(1, keepdim=True).expand_as(target)[mask]
        loss = (ce / lengths).sum() / len(target)
    else:  # every answer token weighs the same
        loss = F.cross_entropy(logits, target[mask])
    wrong = torch.zeros_like(target)
    wrong[mask] = (logits.argmax(-1) != target[mask]).long()
    return loss, wrong.sum(1) == 0


@torch.no_grad()
def evaluate(model, batches, device, autocast: bool) -> dict[str, float]:
    model.eval()
    result = {
        t: forward_loss(model, b, device, autocast)[1].float().mean().item()
        for t, b in batches.items()
    }
    model.train()
    return result


def patch_vision_attention(model, device) -> bool:
    """Swap HF's per-image loop in the vision attention (one SDPA call per image) for one
    batched SDPA call; valid because every training image has the same size. Checked on a
    small batch against the original; left unpatched (and False returned) on a mismatch."""
    from transformers.models.qwen2_vl import modeling_qwen2_vl as m

    original = m.VisionAttention.forward

    def batched(
        self, hidden_states, cu_seqlens, rotary_pos_emb=None, position_embeddings=None, **kw
    ):
        n, b = hidden_states.shape[0], cu_seqlens.numel() - 1
        qkv = self.qkv(hidden_states).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3)
        q, k, v = qkv.unbind(0)
        q, k = m.apply_rotary_pos_emb_vision(q, k, *position_embeddings)
        q, k, v = (t.reshape(b, n // b, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.scaling)
        return self.proj(out.transpose(1, 2).reshape(n, -1))

    images = torch.randint(0, 256, (3, IMAGE_SIZE, IMAGE_SIZE, 3), dtype=torch.uint8, device=device)
    grid = torch.tensor([[1, IMAGE_SIZE // 14, IMAGE_SIZE // 14]] * 3, device=device)

    def vision() -> torch.Tensor:
        out = model.model.visual(pixel_values(images), grid_thw=grid)
        return getattr(out, "pooler_output", out)  # a plain tensor in older transformers

    with torch.no_grad():
        try:
            reference = vision()
            m.VisionAttention.forward = batched
            ok = torch.allclose(vision(), reference, atol=1e-4, rtol=1e-3)
        except Exception as error:  # noqa: BLE001 - any failure: keep HF's own code
            print(f"batched vision attention failed ({error!r}); using HF's loop")
            ok = False
    if not ok:
        m.VisionAttention.forward = original
    return ok


def load_checkpoint(path: str):
    """(tokenizer, float32 model, its training.json or None) of a checkpoint folder."""
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    card_path = os.path.join(path, "training.json")
    card = None
    if os.path.exists(card_path):
        with open(card_path) as f:
            card = json.load(f)
    model = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    return AutoTokenizer.from_pretrained(path), model, card


def render_fingerprint() -> dict[str, str]:
    """Pillow/FreeType versions and a hash of one fixed scene: equal hashes mean two machines
    draw the scenes (the sign's text included) pixel for pixel alike."""
    import PIL
    from PIL import ImageFont, features

    if not isinstance(ImageFont.load_default(size=24), ImageFont.FreeTypeFont):
        raise RuntimeError("Pillow without FreeType: the sign's text would not be drawn alike.")
    image = generate_scene(random.Random(0)).image
    return {
        "pillow": PIL.__version__,
        "freetype": str(features.version("freetype2")),
        "scene_sha256": hashlib.sha256(image.tobytes()).hexdigest()[:16],
    }


def parse_weights(text: str) -> dict[str, float]:
    """ "text=2,size=0.5" -> {"text": 2.0, "size": 0.5}."""
    pairs = [item.split("=") for item in text.split(",") if item]
    unknown = {name for name, _ in pairs} - set(QUESTION_TYPES)
    if unknown:
        raise ValueError(f"Unknown question types {sorted(unknown)}; use {QUESTION_TYPES}.")
    return {name: float(value) for name, value in pairs}


def lr_at(progress: float, step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="checkpoint folder to write")
    parser.add_argument("--steps", type=int, default=None, help="fixed number of steps")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds of training")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--workers", type=int, default=min(12, (os.cpu_count() or 2) - 1))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-per-type", type=int, default=256)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--init", default=None, help="start from this checkpoint folder")
    parser.add_argument("--type-weights", default="", help='e.g. "text=2,size=0.5"')
    parser.add_argument(
        "--per-sample-loss", action="store_true", help="weigh answers, not answer tokens, alike"
    )
    args = parser.parse_args()
    if (args.steps is None) == (args.time_budget is None):
        parser.error("give exactly one of --steps and --time-budget")

    started = time.time()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    autocast = device.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = True
    if args.init:
        tokenizer, model, init_card = load_checkpoint(args.init)
    else:
        tokenizer, init_card = build_tokenizer(training_corpus()), None
        model = build_model(tokenizer, args.seed)
    batcher = Batcher(tokenizer)
    model = model.to(device).train()
    params = sum(p.numel() for p in model.parameters())
    print(f"device {device}, {params / 1e6:.2f}M parameters, vocab {len(tokenizer)}")
    fingerprint = render_fingerprint()
    print(f"rendering: {fingerprint}")
    print(f"batched vision attention: {patch_vision_attention(model, device)}")
    evals = held_out(batcher, args.eval_per_type, seed=10_000 + args.seed)

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0},
        ],
        lr=args.lr,
        betas=(0.9, 0.98),
    )
    weights = {**TYPE_WEIGHTS, **parse_weights(args.type_weights)}
    stream = SceneStream(batcher, args.batch_size, args.seed, weights)
    loader = torch.utils.data.DataLoader(
        stream,
        batch_size=None,
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        prefetch_factor=4 if args.workers else None,
        persistent_workers=bool(args.workers),
    )
    history = []
    train_start = time.time()
    step = 0
    for step, batch in enumerate(loader):
        elapsed = time.time() - train_start
        progress = step / args.steps if args.steps else elapsed / args.time_budget
        if progress >= 1.0:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(progress, step, args)
        loss, _ = forward_loss(model, batch, device, autocast, args.per_sample_loss)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0:
            print(
                f"step {step:5d}  {elapsed:6.1f}s  loss {loss.item():.4f}  "
                f"lr {optimizer.param_groups[0]['lr']:.2e}",
                flush=True,
            )
        if step and step % args.eval_every == 0:
            accuracy = evaluate(model, evals, device, autocast)
            history.append(
                {"step": step, "seconds": round(elapsed, 1), "loss": loss.item(), **accuracy}
            )
            print(
                "  held-out exact match:",
                json.dumps({k: round(v, 3) for k, v in accuracy.items()}),
                flush=True,
            )
    train_seconds = time.time() - train_start
    accuracy = evaluate(model, evals, device, autocast)
    print("final held-out exact match (teacher-forced):", json.dumps(accuracy))
    card = {
        "steps": step,
        "batch_size": args.batch_size,
        "samples_seen": step * args.batch_size,
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.time() - started, 1),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "rendering": fingerprint,
        "args": vars(args),
        "held_out_teacher_forced": accuracy,
        "history": history,
        "init": init_card,  # the run this one started from, if any
    }
    save_checkpoint(model.cpu(), tokenizer, args.out, card)
    print(f"saved to {args.out} after {step} steps, {train_seconds:.0f}s of training")


if __name__ == "__main__":
    main()
