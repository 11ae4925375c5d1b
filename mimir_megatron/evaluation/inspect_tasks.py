"""Suite tasks as InspectAI tasks: samples from our items, greedy generation (or letter
log-likelihoods through /v1/score), and one scorer that records each item's value and outcome."""

from __future__ import annotations

from typing import Any

from inspect_ai import Task
from inspect_ai.dataset import MemoryDataset, Sample
from inspect_ai.model import (
    ChatMessageAssistant,
    ChatMessageUser,
    GenerateConfig,
    ModelOutput,
)
from inspect_ai.scorer import Score, Target, mean, scorer
from inspect_ai.solver import Generate, TaskState, generate, solver

from .code_exec import passes, program_from_reply
from .ifeval import follows
from .metrics import LETTERS, extract, extract_letter, score_item
from .prompts import Item
from .scoring_client import ScoreClient
from .suite import TaskSpec

SCORER_NAME = "mimir_item"


def _messages(item: Item) -> list:
    kinds = {"user": ChatMessageUser, "assistant": ChatMessageAssistant}
    return [kinds[m["role"]](content=m["content"]) for m in item.messages]


def _sample(item: Item) -> Sample:
    return Sample(input=_messages(item), target=item.references, id=item.id,
                  metadata={"num_choices": item.num_choices, "messages": item.messages, **item.extra})


@solver
def loglik_choice(client: ScoreClient, schedule: dict[str, int] | None):
    """Pick the option letter with the highest log-prob as the continuation of the prompt."""

    async def solve(state: TaskState, generate: Generate) -> TaskState:  # noqa: ARG001
        letters = list(LETTERS[: state.metadata["num_choices"]])
        logprobs = await client.logprobs(state.metadata["messages"], letters, schedule)
        best = max(range(len(letters)), key=logprobs.__getitem__)
        state.output = ModelOutput.from_content(model=str(state.model), content=letters[best])
        state.messages.append(state.output.message)
        state.metadata["choice_logprobs"] = logprobs
        return state

    return solve


@scorer(metrics=[mean()], name=SCORER_NAME)
def item_scorer(spec: TaskSpec, allow_code_execution: bool = False):
    """Per-item value in [0, 1] plus, in metadata, the binary outcome and the references."""

    async def score(state: TaskState, target: Target) -> Score:
        reply = state.output.completion or ""
        refs = list(target.target)
        correct: bool | None
        if spec.format == "multiple_choice":
            prediction = extract_letter(reply, state.metadata["num_choices"])
            correct = prediction == refs[0]
            value = float(correct)
        elif spec.format == "generate":
            prediction = extract(spec.answer_extract, reply)
            value, correct = score_item(spec.metric, prediction, refs)
        elif spec.format == "ifeval":
            prediction = reply
            verdicts = follows(reply, state.metadata["instructions"], state.metadata["kwargs"])
            correct = all(verdicts)
            value = float(correct)
        else:  # humaneval
            import anyio

            prediction = program_from_reply(reply, state.metadata["code_prompt"])
            correct = allow_code_execution and await anyio.to_thread.run_sync(
                passes, prediction, state.metadata["test"], state.metadata["entry_point"])
            value = float(correct)
        return Score(value=value, answer=prediction,
                     metadata={"correct": correct, "references": refs,
                               "choice_logprobs": state.metadata.get("choice_logprobs")})

    return score


def build_task(spec: TaskSpec, items: list[Item], *, scoring: str, schedule: dict[str, int] | None,
               score_client: ScoreClient | None, allow_code_execution: bool) -> Task:
    if spec.format == "multiple_choice" and scoring == "loglik":
        if score_client is None:
            raise ValueError("log-likelihood scoring needs a score client")
        chosen = loglik_choice(score_client, schedule)
    else:
        chosen = generate()
    config: dict[str, Any] = {"temperature": 0.0, "max_tokens": spec.generation_tokens}
    if schedule:
        config["extra_body"] = dict(schedule)
    return Task(dataset=MemoryDataset([_sample(i) for i in items], name=spec.name, shuffled=False),
                solver=chosen, scorer=item_scorer(spec, allow_code_execution),
                config=GenerateConfig(**config), name=spec.name)
