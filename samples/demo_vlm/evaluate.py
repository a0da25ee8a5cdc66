"""Evaluate the demo VLM through mm_serve's engine on held-out scenes; print/save tables.

    python samples/demo_vlm/evaluate.py                        # the shipped checkpoint
    python samples/demo_vlm/evaluate.py --model DIR --write samples/demo_vlm/EVAL.md

Scenes come from a seed the training never uses (training workers draw from seeds
``seed * 1000 + worker``, its held-out set from 10000 + seed). Each type is asked
``--per-type`` times in its trained phrasings (``scenes.PHRASINGS``, drawn at random) and
``--per-phrasing`` times in each of its held-out phrasings (``scenes.HELD_OUT_PHRASINGS``,
never trained on). Each conversation is one user turn, an image part then the question,
answered greedily (temperature 0) by ``mm_serve.LLM``. An answer is right when it equals the
reference (case, surrounding space and a final full stop aside). Descriptions are also
scored by their facts (``scenes.description_facts``): all facts right, and the share of
reference facts stated.
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
from scenes import (  # noqa: E402
    HELD_OUT_PHRASINGS,
    QUESTION_TYPES,
    ask,
    description_facts,
    generate_scene,
    phrase,
)

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model")
EVAL_SEED = 20_251_117


@dataclass
class Case:
    qtype: str
    image: object  # PIL image
    question: str
    answer: str
    held_out: str | None = None  # the held-out phrasing (template) asked, if any


def make_cases(seed: int, per_type: int, types=QUESTION_TYPES, per_phrasing: int = 0) -> list[Case]:
    """Per type: ``per_type`` questions in trained phrasings, then ``per_phrasing`` in each
    held-out phrasing; each question about its own fresh scene."""
    rng = random.Random(seed)
    cases = []
    for qtype in types:
        plan = [(None, per_type)] + [(p, per_phrasing) for p in HELD_OUT_PHRASINGS[qtype]]
        for template, wanted in plan:
            made = 0
            while made < wanted:
                scene = generate_scene(rng)
                qa = ask(scene, qtype, rng, (template,) if template else None)
                if qa is not None:
                    cases.append(Case(qtype, scene.image, qa.question, qa.answer, template))
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


def score(cases: list[Case], predictions: list[str]) -> dict:
    """Exact-match accuracy (and, for describe, fact scores) of ``cases``, keyed by
    ``(type, "trained" | "held-out")`` and by held-out phrasing: {key: {"n", "exact", ...}}."""
    groups: dict = {}
    for case, prediction in zip(cases, predictions, strict=True):
        kind = "held-out" if case.held_out else "trained"
        for key in ((case.qtype, kind), case.held_out):
            if key:
                groups.setdefault(key, []).append((case, prediction))
    rows = {}
    for key, pairs in groups.items():
        row = {"n": len(pairs), "exact": sum(is_correct(c, p) for c, p in pairs) / len(pairs)}
        if pairs[0][0].qtype == "describe":
            facts = [(description_facts(c.answer), description_facts(p)) for c, p in pairs]
            row["all_facts"] = sum(ref == got for ref, got in facts) / len(facts)
            row["fact_recall"] = sum(len(ref & got) for ref, got in facts) / sum(
                len(ref) for ref, _ in facts
            )
        rows[key] = row
    return rows


def _cell(row: dict | None, field: str = "exact") -> str:
    return "" if row is None else f"{100 * row[field]:.1f}%"


def tables(rows: dict) -> str:
    """Markdown: accuracy per type (trained vs held-out phrasings), then per held-out
    phrasing (shown filled in for a star, or stars for count)."""
    lines = [
        "| question type | trained phrasings | held-out phrasings |",
        "| --- | ---: | ---: |",
    ]
    for qtype in QUESTION_TYPES:
        trained, held = rows.get((qtype, "trained")), rows.get((qtype, "held-out"))
        n = f" (n = {trained['n'] if trained else 0} / {held['n'] if held else 0})"
        lines.append(f"| {qtype}{n} | {_cell(trained)} | {_cell(held)} |")
        if qtype == "describe" and trained:
            for field, label in (
                ("all_facts", "all facts right"),
                ("fact_recall", "facts recalled"),
            ):
                lines.append(
                    f"| describe: {label} | {_cell(trained, field)} | {_cell(held, field)} |"
                )
    lines += [
        "",
        "| question type | held-out phrasing | n | exact match |",
        "| --- | --- | ---: | ---: |",
    ]
    for qtype in QUESTION_TYPES:
        for template in HELD_OUT_PHRASINGS[qtype]:
            if template in rows:
                example = phrase(template, "star", 1, random.Random(0), spelling="colour")
                row = rows[template]
                lines.append(f"| {qtype} | {example} | {row['n']} | {_cell(row)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--seed", type=int, default=EVAL_SEED)
    parser.add_argument("--per-type", type=int, default=100, help="in trained phrasings")
    parser.add_argument("--per-phrasing", type=int, default=50, help="per held-out phrasing")
    parser.add_argument("--write", default=None, help="also write the tables to this file")
    parser.add_argument("--show-errors", type=int, default=3, help="wrong answers shown per type")
    args = parser.parse_args()

    from mm_serve import LLM

    cases = make_cases(args.seed, args.per_type, per_phrasing=args.per_phrasing)
    start = time.perf_counter()
    llm = LLM(args.model)
    loaded = time.perf_counter()
    predictions = answer_all(llm, cases)
    done = time.perf_counter()
    llm.shutdown()
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
    text = tables(score(cases, predictions))
    print(text)
    print(summary)
    if args.write:
        command = ".venv/bin/python samples/demo_vlm/evaluate.py " + " ".join(sys.argv[1:])
        with open(args.write, "w") as f:
            f.write(f"# Demo VLM: held-out accuracy\n\n`{command}`\n\n{text}\n\n{summary}.\n")


if __name__ == "__main__":
    main()
