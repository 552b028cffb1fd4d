"""Per-item task results keep their identity from the engine to the store: a trial's outcome carries each
example's `<doc_id>:<document digest>` beside its 0/1, and the logged `task_correct.json` is keyed by it, so that
optimize's paired gate pairs the same documents across trials (fresh or resumed from the store) and notices a
document that changed behind its index instead of pairing by list position."""
from __future__ import annotations

import json

from conftest import TINY
from experiments.config.compose import expand
from experiments.run.sweep import run_specs
from experiments.run.trial import identified_correct
from experiments.tracking.store import CORRECT_ARTIFACT

ITEMS = [{"context": "Q: What do bees make?\nA:", "choices": ["honey", "milk", "silk"], "gold": 0},
         {"context": "The opposite of hot is", "choices": ["cold", "warm"], "gold": 0},
         {"context": "Q: Which is the largest planet?\nA:", "choices": ["Mars", "Jupiter"], "gold": 1}]


def test_a_trials_task_results_are_logged_by_item_identity(tmp_path, tracking_overrides, mlflow_client):
    f = tmp_path / "mine.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in ITEMS))
    specs = expand(TINY + tracking_overrides + ["eval=tasks", "eval.tasks=[mine]", f"eval.task_files=[{f}]",
                                                "sweep_name=task-items"])
    res = run_specs(specs, "test", in_process=True, echo=lambda *_: None)
    (row,) = res.rows
    o = row["outcome"]
    assert row["status"] == "FINISHED", row
    ids = o.items["mine"]
    assert len(ids) == len(o.correct["mine"]) == 3 and len(set(ids)) == 3
    assert [i.split(":")[0] for i in ids] == ["0", "1", "2"] and all(len(i.split(":")[1]) >= 8 for i in ids)
    path = mlflow_client.download_artifacts(row["run_id"], CORRECT_ARTIFACT, str(tmp_path))
    logged = json.loads(open(path).read())
    assert logged == {"mine": dict(zip(ids, o.correct["mine"]))} == identified_correct(o.correct, o.items)


def test_results_without_identities_stay_in_document_order():
    # a run logged before items had identities, or an item count that does not match: position, never a guess
    assert identified_correct({"t": [1.0, 0.0]}, {}) == {"t": [1.0, 0.0]}
    assert identified_correct({"t": [1.0, 0.0]}, {"t": ["0:aa"]}) == {"t": [1.0, 0.0]}
