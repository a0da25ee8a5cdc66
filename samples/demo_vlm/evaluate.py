"""Evaluate the demo VLM through mm_serve's engine on held-out scenes; print/save a table.

    python samples/demo_vlm/evaluate.py                        # the shipped checkpoint
    python samples/demo_vlm/evaluate.py --model DIR --per-type 200 --write samples/demo_vlm/EVAL.md

Scenes come from a seed the training never uses (training workers draw from seeds
``seed * 1000 + worker``, its held-out set from 10000 + seed). Each conversation is one user
turn, an image part then the question, answered greedily (temperature 0) by ``mm_serve.LLM``.
An answer is right when it equals the reference (case, surrounding space and a final full
stop aside). Descriptions are also scored by their facts (``scenes.description_facts``): all
facts right, and the share of reference facts stated.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scenes import QUESTION_TYPES, ask, description_facts, generate_scene  # noqa: E402

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model")
EVAL_SEED = 20_251_117


@dataclass
class Case:
    qtype: str
    image: object  # PIL image
    question: str
    answer: str


def make_cases(seed: int, per_type: int, types=QUESTION_TYPES) -> list[Case]:
    """``per_type`` questions of each type, each about its own fresh scene."""
    rng = random.Random(seed)
    cases = []
    for qtype in types:
        made = 0
        while made < per_type:
            scene = generate_scene(rng)
            qa = ask(scene, qtype, rng)
            if qa is not None:
                cases.append(Case(qtype, scene.image, qa.question, qa.answer))
                made += 1
    return cases


def normalize(text: str) -> str:
    return text.strip().lower().rstrip(".").strip()


def is_correct(case: Case, prediction: str) -> bool:
    return normalize(prediction) == normalize(case.answer)


def conversation(case: Case) -> list[dict]:
    content = [{"type": "image", "image": case.image}, {"type": "text", "text": case.question}]
    return [{"role": "user", "content": content}]


def answer_all(llm, cases: list[Case]) -> list[str]:
    """Greedy answers from the engine, in ``cases`` order."""
    from mm_serve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=64)
    outputs = llm.chat([conversation(c) for c in cases], params, use_tqdm=False)
    return [o.outputs[0].text for o in outputs]


def score(cases: list[Case], predictions: list[str]) -> list[dict]:
    """One row per question type: count, exact-match accuracy (and fact scores for describe)."""
    rows = []
    for qtype in dict.fromkeys(c.qtype for c in cases):
        pairs = [(c, p) for c, p in zip(cases, predictions, strict=True) if c.qtype == qtype]
        row = {"type": qtype, "n": len(pairs)}
        row["exact"] = sum(is_correct(c, p) for c, p in pairs) / len(pairs)
        if qtype == "describe":
            facts = [(description_facts(c.answer), description_facts(p)) for c, p in pairs]
            row["all_facts"] = sum(ref == got for ref, got in facts) / len(facts)
            row["fact_recall"] = sum(len(ref & got) for ref, got in facts) / sum(
                len(ref) for ref, _ in facts
            )
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| question type | n | exact match |", "| --- | ---: | ---: |"]
    for row in rows:
        lines.append(f"| {row['type']} | {row['n']} | {100 * row['exact']:.1f}% |")
        if "all_facts" in row:
            lines.append(
                f"| describe: all facts right | {row['n']} | {100 * row['all_facts']:.1f}% |"
            )
            lines.append(f"| describe: facts recalled | | {100 * row['fact_recall']:.1f}% |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--seed", type=int, default=EVAL_SEED)
    parser.add_argument("--per-type", type=int, default=200)
    parser.add_argument("--write", default=None, help="also write the table to this file")
    parser.add_argument("--show-errors", type=int, default=3, help="wrong answers shown per type")
    args = parser.parse_args()

    from mm_serve import LLM

    cases = make_cases(args.seed, args.per_type)
    start = time.perf_counter()
    llm = LLM(args.model)
    loaded = time.perf_counter()
    predictions = answer_all(llm, cases)
    done = time.perf_counter()
    llm.shutdown()
    rows = score(cases, predictions)
    for qtype in QUESTION_TYPES:
        wrong = [
            (c, p)
            for c, p in zip(cases, predictions, strict=True)
            if c.qtype == qtype and not is_correct(c, p)
        ]
        for c, p in wrong[: args.show_errors]:
            print(f"[{qtype}] {c.question!r}: expected {c.answer!r}, got {p!r}")
    summary = (
        f"{len(cases)} questions, seed {args.seed}, greedy, through mm_serve.LLM.chat on "
        f"{platform.machine()} CPU ({os.cpu_count()} cores): load {loaded - start:.1f} s, "
        f"answers {done - loaded:.1f} s"
    )
    text = table(rows)
    print(text)
    print(summary)
    if args.write:
        command = "python samples/demo_vlm/evaluate.py " + " ".join(sys.argv[1:])
        with open(args.write, "w") as f:
            f.write(f"# Demo VLM: held-out accuracy\n\n`{command}`\n\n{text}\n\n{summary}.\n")


if __name__ == "__main__":
    main()
