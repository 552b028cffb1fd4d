"""Model facts read once (engine/model_facts.py), and what they let validation refuse before launch:
a directory that is no checkpoint, a config.json that is not an object or has wrongly typed fields."""
from __future__ import annotations

import json

import pytest

from engine.config import ModelConfig, TinyModelConfig
from engine.model_facts import ModelFactsError, inspect
from experiments.cli import main
from experiments.config.compose import SweepError, expand

TINY = ["workload.context_len=24", "workload.max_new_tokens=6", "workload.repeats=1", "workload.warmup=0",
        "eval.num_windows=1"]


def test_tiny_facts_follow_its_settings():
    t = TinyModelConfig(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, max_position_embeddings=512)
    f = inspect(ModelConfig(name="t", path="tiny://llama", tiny=t))
    assert (f.model_type, f.num_layers, f.head_dim, f.max_positions) == ("llama", 3, 16, 512)
    assert f.kv_bytes_per_token(2.0) == 2 * 3 * 2 * 16 * 2.0  # K and V, layers, KV heads, head_dim, bytes


def test_facts_of_a_checkpoint_directory_are_cached_and_follow_edits(tmp_path):
    from engine.models import tiny_checkpoint

    cfg = json.loads((tiny_checkpoint(TinyModelConfig()) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = ModelConfig(name="c", path=str(tmp_path))
    assert inspect(spec) is inspect(spec)  # read once
    cfg["max_position_embeddings"] = 77
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    import os

    os.utime(tmp_path / "config.json", (1, 1))  # a different mtime even on a coarse clock
    assert inspect(spec).max_positions == 77


BROKEN = {
    "not-an-object": ("[1, 2, 3]", "must hold a JSON object, not list"),
    "typed-wrong": ('{"model_type": "llama", "num_hidden_layers": [30]}', "num_hidden_layers=[30]"),
    "not-json": ("{not json", "is not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_config_json_is_a_model_path_error(tmp_path, case):
    text, message = BROKEN[case]
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ModelFactsError, match=message.replace("[", r"\[").replace("]", r"\]")):
        inspect(ModelConfig(name="b", path=str(tmp_path)))


@pytest.mark.parametrize("extra", [[], ["engine=llamacpp"], ["speculative=self-draft"], ["quant=int8-weight",
                                                                                         "quant.keep_last_layers=1"],
                                   ["engine=native"]])
@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_checkpoints_are_refused_before_launch_on_every_path(tmp_path, case, extra):
    """Before: AttributeError/TypeError tracebacks on engine=llamacpp, self-draft and keep_last_layers, and a
    FAILED trial ("argument after ** must be a mapping") on native/hf."""
    (tmp_path / "config.json").write_text(BROKEN[case][0])
    with pytest.raises(SweepError) as ei:
        expand(TINY + [f"model.path={tmp_path}", "model.name=b", *extra])
    assert any(p.startswith("model.path:") and BROKEN[case][1] in p for p in ei.value.problems), ei.value.problems


def test_a_directory_that_is_no_checkpoint_is_refused_before_launch(tracking_overrides, capsys):
    """`model.path=/etc` used to pass validation and fail as a trial ~30 s later in the tokenizer."""
    rc = main(["sweep", *TINY, *tracking_overrides, "model.path=/etc", "model.name=etc", "sweep_name=t-etc"])
    err = capsys.readouterr().err
    assert rc == 2 and "model.path" in err and "'/etc' is not a model checkpoint: it has no config.json" in err


def test_a_serving_workload_is_not_checked_against_the_static_lengths():
    """workload.context_len + max_new_tokens are the static batch's; a serving workload has its own lengths."""
    base = ["model=tiny-llama", "model.tiny.max_position_embeddings=64", "workload=serving-mixed", "engine=native",
            "kv_cache=paged", "batching=continuous", "workload.input_len.dist=fixed", "workload.input_len.value=16",
            "workload.output_len.dist=fixed", "workload.output_len.value=8", "workload.prefix_len=0",
            "workload.context_len=128", "eval.enabled=false"]
    assert len(expand(base)) == 1  # context_len 128 > 64 positions, but serving never uses it
    with pytest.raises(SweepError) as ei:
        expand(base[:-1] + ["workload.input_len.value=60", "eval.enabled=false"])
    assert any(p.startswith("workload.input_len: the longest request") for p in ei.value.problems)
