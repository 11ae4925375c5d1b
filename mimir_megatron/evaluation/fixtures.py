"""Small made-up files in each benchmark's original column layout, for tests and dry runs.

Never copies of the real benchmarks: every row is generated here from templates and a seed. The
files land where ``configs/eval/*.yaml`` expect the real data under ``--data-dir`` (one folder per
benchmark), in the three supported formats (JSONL, Parquet, datasets save_to_disk).

    mimir eval-fixtures --output data/eval-fixtures
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

Row = dict[str, Any]
WORDS = "river stone cloud bread light winter garden candle harbour ship north apple".split()
DANISH = "flod sten sky brød lys vinter have lys havn skib nord æble".split()


def _boolq(r: random.Random, i: int) -> Row:
    a, b = r.randint(2, 9), r.randint(2, 9)
    return {"question": f"is {a} plus {b} equal to {a + b if i % 2 == 0 else a + b + 1}",
            "answer": i % 2 == 0, "passage": f"The sum of {a} and {b} is {a + b}."}


def _winogrande(r: random.Random, i: int) -> Row:
    x, y = r.sample(WORDS, 2)
    return {"sentence": f"The {x} was heavier than the {y} because the _ was made of stone.",
            "option1": x, "option2": y, "answer": str(1 + i % 2)}


def _hellaswag(r: random.Random, i: int, words: list[str] = WORDS) -> Row:
    chosen = r.sample(words, 4)
    return {"ind": i, "activity_label": "Counting", "ctx_a": f"A person counts {chosen[0]}s.",
            "ctx_b": "then they", "ctx": f"A person counts {chosen[0]}s. then they",
            "endings": [f"count the {w}s again." for w in chosen], "source_id": f"fixture~{i}",
            "split": "val", "split_type": "indomain", "label": str(i % 4)}


def _mmlu(r: random.Random, i: int) -> Row:
    a, b = r.randint(10, 50), r.randint(10, 50)
    answer = i % 4
    options = [str(a + b + d - answer) for d in range(4)]
    return {"question": f"What is {a} + {b}?", "subject": "elementary_mathematics",
            "choices": options, "answer": answer}


def _arc(r: random.Random, i: int) -> Row:
    a = r.randint(2, 9)
    labels = ["A", "B", "C", "D"] if i % 3 else ["1", "2", "3", "4"]
    key = i % 4
    return {"id": f"Fixture_{i}", "question": f"How many legs do {a} birds have in total?",
            "choices": {"text": [str(2 * a + d - key) for d in range(4)], "label": labels},
            "answerKey": labels[key]}


def _drop(r: random.Random, i: int) -> Row:
    x = r.choice(WORDS)
    n = r.randint(3, 30)
    return {"section_id": f"fixture_{i}", "query_id": f"q{i}",
            "passage": f"In the {x} census there were {n} houses.",
            "question": f"How many houses were in the {x} census?",
            "answers_spans": {"spans": [str(n)], "types": ["number"]}}


def _govreport(r: random.Random, i: int) -> Row:
    words = r.sample(WORDS, 5)
    return {"report": " ".join(f"The {w} report section discusses the {w}." for w in words),
            "summary": "The report discusses " + ", ".join(words) + "."}


def _gsm8k(r: random.Random, i: int) -> Row:
    a, b = r.randint(2, 40), r.randint(2, 40)
    return {"question": f"Ann has {a} apples and buys {b} more. How many apples does she have?",
            "answer": f"She has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}"}


def _math(r: random.Random, i: int) -> Row:
    a, b = r.randint(2, 9), r.randint(2, 9)
    return {"problem": f"Compute $\\frac{{{a}}}{{{b}}} + \\frac{{{b}}}{{{b}}}$.", "level": "Level 1",
            "type": "Prealgebra",
            "solution": f"Adding gives $\\boxed{{\\frac{{{a + b}}}{{{b}}}}}$."}


def _humaneval(r: random.Random, i: int) -> Row:
    k = r.randint(2, 9)
    name = f"add_{k}"
    return {"task_id": f"Fixture/{i}",
            "prompt": f"def {name}(x: int) -> int:\n    \"\"\"Return x plus {k}.\"\"\"\n",
            "canonical_solution": f"    return x + {k}\n",
            "test": (f"def check(candidate):\n    assert candidate(1) == {1 + k}\n"
                     f"    assert candidate(-{k}) == 0\n"),
            "entry_point": name}


def _angry_tweets(r: random.Random, i: int) -> Row:
    label = ("positiv", "neutral", "negativ")[i % 3]
    text = {"positiv": "Sikke en dejlig dag i {w}!", "neutral": "Jeg er ved {w}.",
            "negativ": "Hvor er {w} dog elendig."}[label].format(w=r.choice(DANISH))
    return {"text": text, "label": label}


def _dala(r: random.Random, i: int) -> Row:
    w = r.choice(DANISH)
    return ({"text": f"Jeg så en {w} i går.", "label": "correct"} if i % 2 == 0
            else {"text": f"Jeg en så {w} går i.", "label": "incorrect"})


def _gec(r: random.Random, i: int) -> Row:
    w = r.choice(DANISH)
    return {"text": f"jeg så en {w} i gaar", "target_text": f"Jeg så en {w} i går."}


def _piqa_da(r: random.Random, i: int) -> Row:
    w = r.choice(DANISH)
    good, bad = f"Brug en klud til {w}en.", f"Brug en sten til {w}en."
    return {"prompt": f"Hvordan gør man {w}en ren?", "solution0": good if i % 2 == 0 else bad,
            "solution1": bad if i % 2 == 0 else good, "label": i % 2}


def _qa_da(r: random.Random, i: int) -> Row:
    a, b = r.randint(2, 20), r.randint(2, 20)
    return {"question": f"Hvad er {a} plus {b}?", "answer": str(a + b)}


def _wmt(r: random.Random, i: int) -> Row:
    j = r.randrange(len(WORDS))
    return {"translation": {"en": f"The {WORDS[j]} is old.", "da": f"{DANISH[j].capitalize()} er gammel."}}


def _news(r: random.Random, i: int) -> Row:
    words = r.sample(DANISH, 4)
    return {"text": " ".join(f"I dag skrev avisen om {w}." for w in words),
            "summary": "Avisen skrev om " + ", ".join(words) + "."}


def _ifeval(r: random.Random, i: int) -> Row:
    blank = {"num_words": None, "relation": None, "keywords": None, "end_phrase": None}
    w = r.choice(DANISH)
    kinds = [
        (["punctuation:no_comma"], [dict(blank)]),
        (["keywords:existence"], [{**blank, "keywords": [w]}]),
        (["length_constraints:number_words"], [{**blank, "num_words": 5, "relation": "less than"}]),
        (["startend:end_checker", "change_case:english_lowercase"],
         [{**blank, "end_phrase": "tak."}, dict(blank)]),
    ]
    ids, kwargs = kinds[i % len(kinds)]
    return {"key": 1000 + i, "prompt": f"Skriv en kort sætning om {w}.", "instruction_id_list": ids,
            "kwargs": kwargs}


BENCHMARKS: dict[str, tuple[Callable[[random.Random, int], Row], dict[str, str]]] = {
    # name: (row maker, {split: file name}); '.parquet' / '/' (save_to_disk) / '.jsonl'
    "boolq": (_boolq, {"validation": "validation.jsonl", "train": "train.jsonl"}),
    "winogrande": (_winogrande, {"validation": "validation.jsonl", "train": "train.jsonl"}),
    "hellaswag": (_hellaswag, {"validation": "validation.jsonl", "train": "train.jsonl"}),
    "mmlu": (_mmlu, {"test": "test.parquet", "dev": "dev.parquet"}),
    "arc_challenge": (_arc, {"test": "dataset/", "train": "dataset/"}),
    "drop": (_drop, {"validation": "validation.jsonl", "train": "train.jsonl"}),
    "govreport": (_govreport, {"test": "test.jsonl"}),
    "gsm8k": (_gsm8k, {"test": "test.jsonl", "train": "train.jsonl"}),
    "math": (_math, {"test": "test.jsonl", "train": "train.jsonl"}),
    "humaneval": (_humaneval, {"test": "test.jsonl"}),
    "angry_tweets": (_angry_tweets, {"test": "test.jsonl"}),
    "dala": (_dala, {"test": "test.jsonl"}),
    "gec": (_gec, {"test": "test.jsonl"}),
    "piqa_da": (_piqa_da, {"test": "test.jsonl"}),
    "daisy": (_qa_da, {"test": "test.jsonl"}),
    "wikiqa_da": (_qa_da, {"test": "test.jsonl"}),
    "wmt": (_wmt, {"test": "test.jsonl"}),
    "nordjylland_news": (_news, {"test": "test.jsonl"}),
    "ifeval_da": (_ifeval, {"test": "test.jsonl"}),
    "hellaswag_da": (lambda r, i: _hellaswag(r, i, DANISH), {"test": "test.jsonl"}),
}


def _write(path: Path, rows: list[Row]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def write_fixtures(output: str | Path, rows_per_split: int = 8, seed: int = 0) -> Path:
    """Write every benchmark's fixture files under ``output``; returns ``output``."""
    output = Path(output)
    for index, (name, (make, splits)) in enumerate(BENCHMARKS.items()):
        saved: dict[str, list[Row]] = {}
        for split_index, (split, file_name) in enumerate(splits.items()):
            rng = random.Random(seed * 10_000 + index * 100 + split_index)
            rows = [make(rng, i) for i in range(rows_per_split)]
            if file_name.endswith("/"):
                saved[split] = rows
            else:
                _write(output / name / file_name, rows)
        if saved:
            import datasets

            datasets.disable_progress_bars()
            datasets.DatasetDict({s: datasets.Dataset.from_list(r) for s, r in saved.items()}).save_to_disk(
                str(output / name / next(iter(splits.values()))))
    return output
