"""Synthetic scenes for the demo VLM: coloured shapes and a sign with a word, plus questions.

A scene is a 224 x 224 image on a 3 x 3 grid of cells. A *sign* (a white rectangle with one
printed word) spans two neighbouring cells of one row; up to 7 shapes fill other cells, at
most one per cell. Shapes come in *groups*: every kind present (circle, square, triangle,
star) appears in one colour and one size, 1-5 times, so "What colour is the triangle?" has a
single answer. Everything is drawn with PIL from a seeded ``random.Random``: the same seed
gives the same scenes, questions and answers (the text uses PIL's bundled default font, so
no font file is needed).

Question types (``QUESTION_TYPES``): colour, count (0 for a kind that is absent), text (the
sign's word), describe (``describe`` gives the canonical sentence), size and position (the
cell of a kind shown once: "top left", "center", ...). Each type is asked in 8-16 phrasings
(``PHRASINGS``, e.g. "What's in this image?", "What is in the picture?", "What do you see?"
for describe); two more per type (``HELD_OUT_PHRASINGS``) are kept out of training to
measure how far the model generalises to wordings it never saw.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from PIL import Image, ImageDraw, ImageFont

IMAGE_SIZE = 224
GRID = 3
CELL = IMAGE_SIZE / GRID
MAX_SHAPES = GRID * GRID - 2  # the sign takes two cells

SHAPES = ("circle", "square", "triangle", "star")
PLURALS = {"circle": "circles", "square": "squares", "triangle": "triangles", "star": "stars"}
COLOURS = {
    "red": (214, 39, 40),
    "green": (44, 160, 44),
    "blue": (31, 90, 220),
    "yellow": (240, 200, 20),
    "purple": (140, 60, 180),
    "orange": (250, 130, 15),
}
SIZES = ("small", "large")
POSITIONS = (
    ("top left", "top", "top right"),
    ("left", "center", "right"),
    ("bottom left", "bottom", "bottom right"),
)
# Short everyday words for the sign (none is a colour, shape, size or number word).
WORDS = (
    "apple", "bird", "bread", "cake", "cat", "chair", "cloud", "dog", "door", "duck",
    "fish", "frog", "hat", "honey", "house", "key", "kite", "lamp", "lemon", "milk",
    "moon", "music", "ocean", "piano", "pizza", "rain", "river", "robot", "rose", "ship",
    "snow", "sun", "tiger", "train", "tree", "wolf",
)  # fmt: skip
QUESTION_TYPES = ("colour", "count", "text", "describe", "size", "position")
# How each question type is asked in training (templates, filled in by ``phrase``).
PHRASINGS = {
    "colour": (
        "What {colour} {is} {the}?",
        "Which {colour} {is} {the}?",
        "What is the {colour} of {the}?",
        "Tell me the {colour} of {the}.",
        "{colour} of {the}?",
        "What {colour} {is} {the} in the image?",
        "In which {colour} {is} {the} drawn?",
        "Name the {colour} of {the}.",
    ),
    "count": (
        "How many {shapes} are there?",
        "How many {shapes} are in the image?",
        "How many {shapes} are in the picture?",
        "How many {shapes} can you see?",
        "How many {shapes} do you see?",
        "Count the {shapes}.",
        "What is the number of {shapes}?",
        "How many {shapes} does the image show?",
        "Number of {shapes}?",
        "How many {shapes} are in this photo?",
        "Can you tell me how many {shapes} there are?",
        "Count the {shapes} in the image.",
        "How many {shapes} does this photo have?",
    ),
    "text": (
        "What is written on the sign?",
        "What does the sign say?",
        "Read the sign.",
        "What's written on the sign?",
        "What word is on the sign?",
        "What does the sign read?",
        "Which word does the sign show?",
        "What text is on the sign?",
        "Tell me what the sign says.",
    ),
    "describe": (
        "Describe the image.",
        "What is in the image?",
        "Describe this.",
        "What's in this image?",
        "What is in the picture?",
        "What do you see?",
        "Describe this photo.",
        "What does the image show?",
        "Can you describe this picture?",
        "Tell me what you see.",
        "What's in the photo?",
        "Tell me about this image.",
        "What does this picture contain?",
        "What is shown here?",
        "Summarize the image.",
        "Please describe the photo.",
    ),
    "size": (
        "{is} {the} small or large?",
        "{is} {the} large or small?",
        "{is} {the} big or small?",
        "{is} {the} small or big?",
        "What size {is} {the}?",
        "How big {is} {the}?",
        "How large {is} {the}?",
        "What is the size of {the}?",
        "Tell me the size of {the}.",
    ),
    "position": (  # asked only of a kind shown once
        "Where is {the}?",
        "Where's {the}?",
        "Where is {the} located?",
        "Where in the image is {the}?",
        "In which part of the image is {the}?",
        "What is the position of {the}?",
        "Where can you find {the}?",
        "Where is {the} in the picture?",
        "Where does {the} appear?",
        "Tell me where {the} is.",
        "Which cell is {the} in?",
        "Where is {the} in this photo?",
        "Where can {the} be seen?",
        "Locate {the}.",
    ),
}
# Never trained on: evaluate.py reports them one by one, to show how far phrasing generalises.
HELD_OUT_PHRASINGS = {
    "colour": ("What {colour} {does} {the} have?", "Can you tell me the {colour} of {the}?"),
    "count": ("How many {shapes} are shown?", "Can you count the {shapes} in this photo?"),
    "text": ("What's on the sign?", "Can you read the word on the sign?"),
    "describe": ("What can you see in this image?", "Give me a description of the picture."),
    "size": ("Which size {is} {the}?", "Would you say {the} {is} small or large?"),
    "position": ("Where is {the} placed?", "Which part of the picture is {the} in?"),
}


@dataclass
class Group:
    """All shapes of one kind in a scene: same colour and size, one per grid cell."""

    shape: str
    colour: str
    size: str
    cells: list[tuple[int, int]] = field(default_factory=list)  # (row, col)

    @property
    def count(self) -> int:
        return len(self.cells)


@dataclass
class Scene:
    image: Image.Image
    groups: list[Group]  # in ``SHAPES`` order
    word: str

    def group(self, shape: str) -> Group | None:
        return next((g for g in self.groups if g.shape == shape), None)


@dataclass
class QA:
    qtype: str
    question: str
    answer: str


def generate_scene(rng: random.Random) -> Scene:
    """Draw one random scene (layout, colours, word) from ``rng``."""
    num_kinds = rng.choice((1, 1, 2, 2, 2, 3, 3))
    while True:
        counts = [rng.randint(1, 5) for _ in range(num_kinds)]
        if sum(counts) <= MAX_SHAPES:
            break
    kinds = sorted(rng.sample(SHAPES, num_kinds), key=SHAPES.index)
    sign_row, sign_col = rng.randrange(GRID), rng.randrange(GRID - 1)
    free = [
        (r, c)
        for r in range(GRID)
        for c in range(GRID)
        if not (r == sign_row and c in (sign_col, sign_col + 1))
    ]
    rng.shuffle(free)
    groups = []
    for kind, count in zip(kinds, counts, strict=True):
        cells = sorted(free[:count])
        free = free[count:]
        groups.append(Group(kind, rng.choice(list(COLOURS)), rng.choice(SIZES), cells))
    word = rng.choice(WORDS)
    image = _draw(rng, groups, word, sign_row, sign_col)
    return Scene(image, groups, word)


def _draw(rng: random.Random, groups: list[Group], word: str, sign_row: int, sign_col: int):
    grey = rng.randint(200, 240)
    tint = [max(0, min(255, grey + rng.randint(-12, 12))) for _ in range(3)]
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), tuple(tint))
    draw = ImageDraw.Draw(image)
    for group in groups:
        for row, col in group.cells:
            radius = rng.uniform(22, 28) if group.size == "large" else rng.uniform(10, 14)
            slack = CELL / 2 - radius - 2
            cx = (col + 0.5) * CELL + rng.uniform(-slack, slack)
            cy = (row + 0.5) * CELL + rng.uniform(-slack, slack)
            _draw_shape(draw, group.shape, cx, cy, radius, COLOURS[group.colour])
    _draw_sign(rng, draw, word, sign_row, sign_col)
    return image


def _draw_shape(draw, shape: str, cx: float, cy: float, r: float, fill) -> None:
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        s = r * 0.85
        draw.rectangle((cx - s, cy - s, cx + s, cy + s), fill=fill)
    elif shape == "triangle":
        draw.polygon(
            [(cx, cy - r), (cx + r * 0.95, cy + r * 0.8), (cx - r * 0.95, cy + r * 0.8)], fill=fill
        )
    else:  # a five-pointed star
        draw.polygon(_star_points(cx, cy, r * 1.1), fill=fill)


def _star_points(cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    import math

    points = []
    for i in range(10):
        radius = r if i % 2 == 0 else r * 0.45
        angle = -math.pi / 2 + i * math.pi / 5
        points.append((cx + radius * math.cos(angle), cy + radius * math.sin(angle)))
    return points


def _draw_sign(rng: random.Random, draw, word: str, row: int, col: int) -> None:
    cx, cy = (col + 1) * CELL + rng.uniform(-2, 2), (row + 0.5) * CELL + rng.uniform(-6, 6)
    width, height = rng.uniform(134, 144), rng.uniform(52, 60)
    box = (cx - width / 2, cy - height / 2, cx + width / 2, cy + height / 2)
    draw.rectangle(box, fill=(255, 255, 255), outline=(40, 40, 40), width=2)
    # Letters this large are learned in ~1000 steps; at 24-30 px the model never learned to
    # read them in 12000 (MODEL_CARD.md).
    size = rng.randint(36, 44)
    font = ImageFont.load_default(size=size)
    while font.getlength(word) > width - 12:
        size -= 2
        font = ImageFont.load_default(size=size)
    ink = rng.choice(((0, 0, 0), (30, 30, 90), (90, 20, 20)))
    draw.text((cx, cy), word, fill=ink, font=font, anchor="mm")


def describe(scene: Scene) -> str:
    """The canonical description: groups in ``SHAPES`` order, then the sign, e.g.
    "The image shows 2 large red circles, 1 small blue star and a sign that says apple." """
    parts = [f"{g.count} {g.size} {g.colour} {_noun(g.shape, g.count)}" for g in scene.groups]
    parts.append(f"a sign that says {scene.word}")
    return "The image shows " + ", ".join(parts[:-1]) + " and " + parts[-1] + "."


_FACT = re.compile(r"(\d+) (small|large) (\w+) (\w+)")
_WORD = re.compile(r"a sign that says (\w+)")


def description_facts(text: str) -> set[tuple[str, ...]]:
    """The facts a description states: one ``(shape, count, size, colour)`` per group and
    ``("sign", word)``; scoring compares these sets (order and wording aside)."""
    singular = {v: k for k, v in PLURALS.items()}
    facts = {
        (singular.get(noun, noun), count, size, colour)
        for count, size, colour, noun in _FACT.findall(text)
    }
    facts.update(("sign", word) for word in _WORD.findall(text))
    return facts


def _noun(shape: str, count: int) -> str:
    return shape if count == 1 else PLURALS[shape]


def ask(
    scene: Scene, qtype: str, rng: random.Random, phrasings: tuple[str, ...] | None = None
) -> QA | None:
    """One question of ``qtype`` about ``scene`` with its answer, or None when the type does
    not apply (position: only for a kind shown once). The question is one of ``phrasings``
    (default: the type's trained ones, ``PHRASINGS[qtype]``), filled in by ``phrase``."""
    if qtype not in PHRASINGS:
        raise ValueError(f"Unknown question type {qtype!r}; choose from {QUESTION_TYPES}.")
    template = rng.choice(phrasings or PHRASINGS[qtype])
    groups = scene.groups
    if qtype == "count":
        shape = rng.choice(SHAPES) if rng.random() < 0.3 else rng.choice(groups).shape
        g = scene.group(shape)
        return QA(qtype, phrase(template, shape, 2, rng), str(g.count if g else 0))
    if qtype in ("text", "describe"):
        answer = scene.word if qtype == "text" else describe(scene)
        return QA(qtype, phrase(template, "", 1, rng), answer)
    if qtype == "position":
        singles = [g for g in groups if g.count == 1]
        if not singles:
            return None
        g = rng.choice(singles)
        (row, col) = g.cells[0]
        return QA(qtype, phrase(template, g.shape, 1, rng), POSITIONS[row][col])
    g = rng.choice(groups)
    answer = g.colour if qtype == "colour" else g.size
    return QA(qtype, phrase(template, g.shape, g.count, rng), answer)


def phrase(
    template: str, shape: str, count: int, rng: random.Random, spelling: str | None = None
) -> str:
    """Fill a ``PHRASINGS`` template: "{the}" is "the star" or "the stars" (by ``count``),
    "{shapes}" the plural, "{is}"/"{does}" agree with it, "{colour}" is ``spelling`` or, when
    None, "colour" or "color" at random; the first letter is capitalised."""
    plural = count != 1
    text = template.format(
        the=f"the {PLURALS[shape] if plural else shape}",
        shapes=PLURALS.get(shape, ""),
        colour=spelling or rng.choice(("colour", "color")),
        **{"is": "are" if plural else "is", "does": "do" if plural else "does"},
    )
    return text[0].upper() + text[1:]


CASUAL_OPENINGS = ("Please tell me: ", "Hi! ", "Quick question: ", "Question: ")


def casual(question: str, rng: random.Random) -> str:
    """``question`` as people also type it: 10% of the time after an opening such as "Hi! ",
    15% all lower case, 15% without its final punctuation (training only; evaluation asks
    the phrasings as written)."""
    if rng.random() < 0.1:
        question = rng.choice(CASUAL_OPENINGS) + question
    if rng.random() < 0.15:
        question = question.lower()
    if rng.random() < 0.15:
        question = question.rstrip("?.")
    return question


def sample_qa(scene: Scene, rng: random.Random, weights: dict[str, float] | None = None) -> QA:
    """A random applicable question about ``scene`` (types drawn by ``weights``)."""
    weights = weights or dict.fromkeys(QUESTION_TYPES, 1.0)
    types, w = zip(*weights.items(), strict=True)
    while True:
        qa = ask(scene, rng.choices(types, w)[0], rng)
        if qa is not None:
            return qa


def training_corpus() -> list[str]:
    """Questions in every trained phrasing and every answer word, for training a tokenizer
    (the shipped one was trained on the three phrasings per type of the first run)."""
    rng = random.Random(0)
    texts = [" ".join(WORDS), " ".join(COLOURS), " ".join(PLURALS.values()), " ".join(SHAPES)]
    texts += [" ".join(row) for row in POSITIONS]
    for _ in range(300):
        scene = generate_scene(rng)
        for qtype in QUESTION_TYPES:
            qa = ask(scene, qtype, rng)
            texts += [qa.question, qa.answer] if qa else []
    return texts
