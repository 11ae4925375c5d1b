"""Per-item metrics and their task-level aggregates, on top of the field's libraries.

Token F1 is InspectAI's SQuAD/DROP-style F1 (max over references), ROUGE-1 is Google's
rouge-score, chrF is sacrebleu's corpus chrF, macro F1 is scikit-learn's. What is written here is
only the answer extraction (GSM8K's last number, MATH's last \\boxed{}) with the usual
normalisation, and the letter of a multiple-choice reply.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class ItemOutcome:
    """One scored row: what the model answered, against what, and its per-item value in [0, 1]."""

    id: str
    prediction: str
    references: tuple[str, ...]
    value: float
    correct: bool | None = None
    """Right/wrong for binary metrics (McNemar); None for graded ones (ROUGE, chrF, F1)."""
    choice_logprobs: tuple[float, ...] | None = None
    """Each option letter's log-prob, when multiple choice was scored by log-likelihood."""


# -- answer extraction ---------------------------------------------------------------------------

_NUMBER = re.compile(r"-?[$€£]?\d[\d,]*(?:\.\d+)?")


def normalize_number(text: str) -> str:
    """'$1,234.50' -> '1234.5', '42.0' -> '42', '-7' -> '-7'; other text stripped of spaces."""
    text = text.strip().rstrip(".").replace(",", "").replace("$", "").replace("€", "").replace("£", "")
    try:
        value = float(text)
    except ValueError:
        return text.strip()
    return str(int(value)) if value.is_integer() else repr(value)


def extract_gsm8k(text: str) -> str:
    """The final answer of a GSM8K-style solution: after '####' when present, else the last number."""
    if "####" in text:
        return normalize_number(text.split("####")[-1].strip().split("\n")[0])
    numbers = _NUMBER.findall(text)
    return normalize_number(numbers[-1]) if numbers else ""


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def normalize_math(answer: str) -> str:
    """The usual MATH string normalisation (Hendrycks et al.): spacing, \\left/\\right, dfrac,
    degree signs, dollars, trailing units of text, leading '0.' and 'x =' removed."""
    s = answer.strip().replace("\n", "").replace("\\!", "")
    s = s.replace("\\\\", "\\").replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "").replace("$", "")
    s = re.sub(r"\\text\{\s*[a-zA-Z ]*\}$", "", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    if re.match(r"^[a-zA-Z]\s*=", s):
        s = s.split("=", 1)[1]
    s = s.replace(" ", "")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return s.rstrip(".")


def extract_boxed(text: str) -> str:
    boxed = last_boxed(text)
    if boxed is None:
        match = re.search(r"(?i)answer is[:\s]*(.+?)(?:\.\s|$)", text)
        boxed = match.group(1) if match else ""
    return normalize_math(boxed)


def extract_letter(text: str, num_choices: int) -> str:
    """The option letter a reply gives: 'B', '(B)', 'B.', 'Answer: B'; '' when there is none."""
    valid = LETTERS[:num_choices]
    stripped = text.strip()
    if stripped[:1] in valid and (len(stripped) == 1 or not stripped[1].isalpha()):
        return stripped[0]
    match = re.search(rf"\b([{valid}])\b", stripped)
    return match.group(1) if match else ""


def extract(kind: str, text: str) -> str:
    if kind == "gsm8k":
        return extract_gsm8k(text)
    if kind == "boxed":
        return extract_boxed(text)
    if kind == "first_line":
        return text.strip().split("\n")[0].strip()
    return text.strip()


# -- per-item metrics ----------------------------------------------------------------------------

def exact_match(prediction: str, references: Sequence[str]) -> float:
    """1 when the stripped prediction equals a stripped reference exactly (GEC, Daisy, WikiQA)."""
    return float(any(prediction.strip() == r.strip() for r in references))


def token_f1(prediction: str, references: Sequence[str]) -> float:
    """SQuAD/DROP token F1 after normalisation, best reference (InspectAI's implementation)."""
    from inspect_ai.scorer._classification import max_f1_score

    return float(max_f1_score(prediction, list(references)))


def rouge1(prediction: str, references: Sequence[str]) -> float:
    """ROUGE-1 F-measure (stemmed), best reference."""
    scorer = _rouge_scorer()
    return max(scorer.score(r, prediction)["rouge1"].fmeasure for r in references)


_ROUGE = None


def _rouge_scorer():
    global _ROUGE
    if _ROUGE is None:
        from rouge_score import rouge_scorer

        _ROUGE = rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)
    return _ROUGE


def sentence_chrf(prediction: str, references: Sequence[str]) -> float:
    import sacrebleu

    return sacrebleu.sentence_chrf(prediction, list(references)).score / 100.0


# -- task aggregates -----------------------------------------------------------------------------

def corpus_chrf(outcomes: Sequence[ItemOutcome]) -> float:
    """sacrebleu's corpus chrF (in [0, 1]); rows may have several references."""
    import sacrebleu

    width = max(len(o.references) for o in outcomes)
    streams = [[o.references[i] if i < len(o.references) else o.references[0] for o in outcomes]
               for i in range(width)]
    return sacrebleu.corpus_chrf([o.prediction for o in outcomes], streams).score / 100.0


def macro_f1(outcomes: Sequence[ItemOutcome]) -> float:
    """Macro-averaged F1 over the reference labels (DaLA); a wrong label counts against both."""
    from sklearn.metrics import f1_score

    labels = sorted({o.references[0] for o in outcomes})
    return float(f1_score([o.references[0] for o in outcomes], [o.prediction for o in outcomes],
                          labels=labels, average="macro", zero_division=0))


def aggregate(metric: str, outcomes: Sequence[ItemOutcome]) -> float:
    """The task's score in [0, 1] from its scored rows."""
    if not outcomes:
        return float("nan")
    if metric == "chrf":
        return corpus_chrf(outcomes)
    if metric == "macro_f1":
        return macro_f1(outcomes)
    return sum(o.value for o in outcomes) / len(outcomes)


def score_item(metric: str, prediction: str, references: Sequence[str]) -> tuple[float, bool | None]:
    """(per-item value, right/wrong for binary metrics) of one generation-format row."""
    if metric in ("accuracy", "exact_match", "macro_f1"):
        value = exact_match(prediction, references)
        return value, value == 1.0
    if metric == "f1":
        return token_f1(prediction, references), None
    if metric == "rouge1":
        return rouge1(prediction, references), None
    if metric == "chrf":
        return sentence_chrf(prediction, references), None
    raise ValueError(f"no per-item scorer for metric {metric}")
