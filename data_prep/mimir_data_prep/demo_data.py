"""The demo instruction set: small, bilingual (English/Danish), learnable by a tiny model on a CPU.

Six groups (arithmetic, algorithmic, text tasks x en/da), each written as its own JSONL file so
that the demo mixture can show categories, languages and repetition. Answers have strict formats
so that exact match is a meaningful score. The held-out split shares no prompt with the train
split. Everything is a pure function of the seed. `mimir data demo` builds it
(:mod:`.demo_build`).

    mimir data demo --output data/demo
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from mimir_megatron.data.provenance import Provenance

from .text_tasks import TASK_FAMILIES, make_sample, split_units

DEMO_DIR = Path(__file__).parent / "demo"
TEXT_FILES = {"en": DEMO_DIR / "text_en.txt", "da": DEMO_DIR / "text_da.txt"}
GROUPS = ("arith", "algo", "text")
LANGS = ("en", "da")

_WORDS = {
    "en": "apple river stone cloud bread light winter garden candle harbour ship north".split(),
    "da": "æble flod sten sky brød lys vinter have stearinlys havn skib nord".split(),
}


@dataclass(frozen=True)
class DemoSample:
    prompt: str
    completion: str
    task: str
    lang: str
    group: str


def _arith(rng: random.Random, lang: str) -> tuple[str, str, str]:
    kind = rng.choice(("add", "sub", "mul"))
    answer_word = "Answer" if lang == "en" else "Svar"
    if kind == "add":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        q = {"en": f"What is {a} + {b}?", "da": f"Hvad er {a} + {b}?"}[lang]
        return (
            kind,
            q + {"en": " Reply as 'Answer: N'.", "da": " Svar som 'Svar: N'."}[lang],
            (f"{answer_word}: {a + b}"),
        )
    if kind == "sub":
        a = rng.randint(0, 99)
        b = rng.randint(0, a)
        q = {"en": f"What is {a} - {b}?", "da": f"Hvad er {a} - {b}?"}[lang]
        return (
            kind,
            q + {"en": " Reply as 'Answer: N'.", "da": " Svar som 'Svar: N'."}[lang],
            (f"{answer_word}: {a - b}"),
        )
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    q = {
        "en": f"Multiply {a} by {b}. Give only the number.",
        "da": f"Gang {a} med {b}. Giv kun tallet.",
    }
    return kind, q[lang], str(a * b)


def _algo(rng: random.Random, lang: str) -> tuple[str, str, str]:
    kind = rng.choice(("sort", "copy", "reverse"))
    if kind == "sort":
        nums = [rng.randint(0, 99) for _ in range(rng.randint(3, 6))]
        q = {"en": "Sort in ascending order: ", "da": "Sortér i stigende rækkefølge: "}[lang]
        return kind, q + ", ".join(map(str, nums)), ", ".join(map(str, sorted(nums)))
    words = rng.sample(_WORDS[lang], rng.randint(1, 3))
    if kind == "copy":
        q = {"en": "Copy exactly: ", "da": "Kopiér præcist: "}[lang]
        return kind, q + " ".join(words), " ".join(words)
    word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 7)))
    q = {"en": "Write backwards: ", "da": "Skriv baglæns: "}[lang]
    return kind, q + word, word[::-1]


def _passages(lang: str) -> list[str]:
    """Every run of 1-2 consecutive sentences of a paragraph, as verbatim slices of the text."""
    passages = []
    for paragraph in TEXT_FILES[lang].read_text(encoding="utf-8").split("\n\n"):
        units = split_units(paragraph.strip())
        for size in (1, 2):
            for i in range(len(units) - size + 1):
                passages.append(" ".join(units[i : i + size]))
    return passages


def _text(rng: random.Random, lang: str, passages: list[str]) -> tuple[str, str, str]:
    task = rng.choice(sorted(TASK_FAMILIES))
    choices = [p for p in passages if task != "reorder" or len(split_units(p)) > 1]
    sample = make_sample(task, rng.choice(choices), lang, rng.randrange(2**31))
    return task, sample.prompt, sample.completion


def generate(
    seed: int = 0, train_per_group: int = 3000, eval_per_group: int = 100
) -> tuple[dict[str, list[DemoSample]], dict[str, list[DemoSample]]]:
    """(train, held-out) lists of DemoSample, keyed by group name ``<group>-<lang>``."""
    train: dict[str, list[DemoSample]] = {}
    held_out: dict[str, list[DemoSample]] = {}
    for gi, group in enumerate(GROUPS):
        for li, lang in enumerate(LANGS):
            rng = random.Random(seed * 1000 + gi * 10 + li)
            passages = _passages(lang) if group == "text" else []

            def draw() -> DemoSample:
                if group == "arith":
                    task, prompt, completion = _arith(rng, lang)
                elif group == "algo":
                    task, prompt, completion = _algo(rng, lang)
                else:
                    task, prompt, completion = _text(rng, lang, passages)
                return DemoSample(prompt, completion, task, lang, group)

            name = f"{group}-{lang}"
            train[name] = [draw() for _ in range(train_per_group)]
            seen = {s.prompt for s in train[name]}
            held_out[name] = []
            attempts = 0
            while len(held_out[name]) < eval_per_group and attempts < 100 * eval_per_group:
                attempts += 1
                sample = draw()
                if sample.prompt not in seen:
                    seen.add(sample.prompt)
                    held_out[name].append(sample)
    return train, held_out


_GENERATOR = "mimir_data_prep.demo_data (seeded, rule-based)"
_GENERATOR_LICENSE = "Apache-2.0"
"""The generator is this project's code; what it writes is under the project's licence."""
_GROUP_NAMES = {"arith": "arithmetic", "algo": "algorithmic tasks", "text": "text tasks"}


def text_provenance(lang: str) -> Provenance:
    """The bundled text a language's text tasks are cut from: this project's own writing, under
    its licence."""
    return Provenance(
        id=f"mimir-demo-text-{lang}", source=f"mimir-megatron bundled demo text ({lang})",
        location=None, license="Apache-2.0", basis="open-licence", form="reformatted",
        audit_group="C", languages=(lang,),
        notes=f"mimir_data_prep/demo/{TEXT_FILES[lang].name}, written for this project",
    )


def demo_provenance(name: str) -> Provenance:
    """The declared provenance of demo dataset ``name`` (``<group>-<lang>`` or ``eval``):
    arithmetic and algorithmic tasks are generated by rule; text tasks are derived from the
    bundled text (answers are verbatim passages of it)."""
    if name == "eval":
        return Provenance(
            id="demo-eval", source="mimir data demo: held-out split", license="Apache-2.0",
            basis="synthetic", form="derived-task", audit_group="D", languages=LANGS,
            derived_from=tuple(text_provenance(lang).as_parent() for lang in LANGS), generator=_GENERATOR,
            generator_license=_GENERATOR_LICENSE,
        )
    group, lang = name.split("-")
    derived = (text_provenance(lang).as_parent(),) if group == "text" else ()
    return Provenance(
        id=f"demo-{name}", source=f"mimir data demo: {_GROUP_NAMES[group]} ({lang})", license="Apache-2.0",
        basis="open-licence" if derived else "synthetic", form="derived-task",
        audit_group="C" if derived else "D", languages=(lang,), derived_from=derived, generator=_GENERATOR,
        generator_license=None if derived else _GENERATOR_LICENSE,
    )


def write_jsonl(path: Path, samples: list[DemoSample]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps(asdict(s), ensure_ascii=False) + "\n")


def write_demo(
    output: Path, seed: int = 0, train_per_group: int = 3000, eval_per_group: int = 100
) -> tuple[list[Path], Path]:
    """Write ``raw/<group>-<lang>.jsonl`` (train) and ``raw/eval.jsonl`` (held-out, all groups).

    Returns the list of train JSONL paths and the held-out path.
    """
    train, held_out = generate(seed, train_per_group, eval_per_group)
    train_paths = []
    for name, samples in train.items():
        path = output / "raw" / f"{name}.jsonl"
        write_jsonl(path, samples)
        train_paths.append(path)
    eval_path = output / "raw" / "eval.jsonl"
    write_jsonl(eval_path, [s for samples in held_out.values() for s in samples])
    return train_paths, eval_path
