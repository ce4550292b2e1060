"""Task data and rewards for examples/grpo.py.

A task is a stream of problems, each a prompt and its exact answer: a JSONL file of {"prompt": ..., "answer": ...}
records (GSM8K's format after its answers are cut to the final number), or the built-in arithmetic generator, which
needs no download. Prompts go through the model's chat template. A completion earns `correct` (its last number is
the answer) plus `FORMAT_WEIGHT` times `formatted` (the share of its characters that are digits, signs and spaces:
an answer that is a number and nothing else scores 1), a signal even a randomly initialised model can climb.
`--reward module:function` replaces both with a function of (completion text, problem) -> float.

The stream's position (how many problems were drawn) is part of a checkpoint: a resumed run draws what the killed
one would have drawn next.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import random
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

FORMAT_WEIGHT = 0.5
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


class Problems:
    """The problems of a run in order: the JSONL file's records shuffled afresh each pass (seeded), or arithmetic
    generated from the seed and the problem's number. `position` counts the problems drawn."""

    def __init__(self, dataset: str | None, seed: int) -> None:
        self.records = read_jsonl(dataset) if dataset else None
        self.seed, self.position = seed, 0

    def take(self, k: int) -> list[Problem]:
        out = [self._problem(self.position + i) for i in range(k)]
        self.position += k
        return out

    def longest_prompt(self, tokenizer, sample: int = 256) -> int:
        """Tokens of the longest prompt: the dataset's, or of the first `sample` generated problems (whose numbers
        have at most two digits, so no later one is longer)."""
        seen = self.records if self.records is not None else [self._problem(i) for i in range(sample)]
        return max(len(encode(tokenizer, p)) for p in seen)

    def _problem(self, i: int) -> Problem:
        if self.records is None:
            rng = random.Random(self.seed * 1_000_003 + i)
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            return Problem(f"What is {a} + {b}? Answer with the number only.", str(a + b))
        n = len(self.records)
        order = list(range(n))
        random.Random(self.seed * 1_000_003 + i // n).shuffle(order)  # a fresh order each pass
        return self.records[order[i % n]]


def read_jsonl(path: str | Path) -> list[Problem]:
    """The {"prompt": str, "answer": str or number} records of a JSONL file; a bad line is named with the fix."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"--dataset {path}: no such file; give a JSONL file of {{\"prompt\": ..., \"answer\": ...}} "
                         "records")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"--dataset {path}, line {n}: not JSON ({exc}); each line is one record") from exc
        if not (isinstance(rec, dict) and isinstance(rec.get("prompt"), str)
                and isinstance(rec.get("answer"), str | int | float) and not isinstance(rec.get("answer"), bool)):
            raise SystemExit(f"--dataset {path}, line {n}: a record needs a string \"prompt\" and an \"answer\" "
                             f"(string or number), got {line[:120]!r}")
        out.append(Problem(rec["prompt"], str(rec["answer"]).strip()))
    if not out:
        raise SystemExit(f"--dataset {path}: no records")
    return out


def encode(tokenizer, problem: Problem) -> list[int]:
    """The prompt's token ids: through the chat template when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": problem.prompt}],
                                            add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer(problem.prompt)["input_ids"]


def correct(text: str, problem: Problem) -> float:
    """1 when the completion's last number is the answer (commas ignored), else 0."""
    numbers = _NUMBER.findall(text.replace(",", ""))
    return float(bool(numbers) and _same_number(numbers[-1], problem.answer.replace(",", "")))


def formatted(text: str) -> float:
    """The share of the completion's characters that an answer of a number alone is made of."""
    return sum(c.isdigit() or c in "-. " for c in text) / max(len(text), 1)


def scored(fn: Callable[[str, Problem], float], text: str, problem: Problem) -> float:
    """`fn`'s reward for one completion, checked: a finite number, or an error naming --reward."""
    name = getattr(fn, "__name__", repr(fn))
    try:
        raw = fn(text, problem)
    except Exception as exc:
        raise SystemExit(f"the reward function {name!r} failed on a completion ({type(exc).__name__}: {exc}); it "
                         "takes (completion text, problem with .prompt and .answer)") from exc
    try:
        value = None if isinstance(raw, str) else float(raw)
    except (TypeError, ValueError):
        value = None
    if value is None or not math.isfinite(value):
        raise SystemExit(f"the reward function {name!r} returned {raw!r}; return a finite number")
    return value


def reward(text: str, problem: Problem) -> float:
    return correct(text, problem) + FORMAT_WEIGHT * formatted(text)


def load_reward(spec: str | None) -> Callable[[str, Problem], float]:
    """`module:function` (importable from the working directory or the path), or the built-in reward."""
    if spec is None:
        return reward
    module, _, name = spec.partition(":")
    if not module or not name:
        raise SystemExit(f"--reward {spec!r}: give module:function, e.g. my_rewards:score")
    if "" not in sys.path and os.getcwd() not in sys.path:  # the working directory, as `python -m` would have it
        sys.path.append(os.getcwd())
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"--reward {spec!r}: {exc}") from exc
    if not callable(fn):
        raise SystemExit(f"--reward {spec!r} is not a function of (completion text, problem) -> float")
    return fn


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b
