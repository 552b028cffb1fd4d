"""Sweep expansion and validation: every problem is reported at once, before anything runs."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import expand_on_a_new_machine, expand_with_engines_absent, in_ci
from experiments.config.compose import SweepError, conf_dir, expand


def test_comma_lists_expand_to_the_cartesian_product():
    specs = expand(["model=tiny-llama", "kv_cache=off,contiguous", "attention=eager,sdpa", "workload.context_len=16,32"])
    assert len(specs) == 8
    combos = {(s.config["kv_cache"]["mode"], s.config["attention"]["impl"], s.config["workload"]["context_len"]) for s in specs}
    assert len(combos) == 8
    assert all(set(s.swept) == {"kv_cache", "attention", "workload.context_len"} for s in specs)
    assert len({s.config_hash for s in specs}) == 8


def test_a_trial_carries_its_cluster_section_parsed_once():
    import pickle

    from cluster import ClusterConfig

    (spec,) = expand(["model=tiny-llama", "cluster.num_cpus_per_trial=1", "cluster.warm_workers=false"])
    assert spec.cluster is spec.cluster and spec.cluster == ClusterConfig.from_dict(spec.config["cluster"])
    assert spec.trial.engine.threads == 1 and not spec.cluster.warm_workers
    shipped = pickle.loads(pickle.dumps(spec))  # to a worker: the parsed section travels with the spec
    assert "cluster" in shipped.__dict__ and shipped.cluster == spec.cluster


def test_value_overrides_after_the_cached_compose_follow_hydras_rules():
    """compose_fast applies `key=value`, `+key=value`, `++key=value` to a cached composition with OmegaConf's public
    API: the same config as Hydra's full compose; what it leaves to Hydra (a deletion, a bad key) still composes or
    fails exactly as Hydra does."""
    from experiments.config.compose import Composer

    with Composer() as c:
        for extra in (["seed=3", "workload.context_len=48"], ["quant.skip_modules=[lm_head,x]"], ["++seed=5"],
                      ["model.path=tiny\\://llama"]):
            assert c.compose_fast(["model=tiny-llama"], extra) == c.compose(["model=tiny-llama"] + extra), extra
        for bad in (["+seed=3"], ["nokey=1"]):
            with pytest.raises(Exception) as fast:
                c.compose_fast(["model=tiny-llama"], bad)
            with pytest.raises(Exception) as full:
                c.compose(["model=tiny-llama"] + bad)
            assert str(fast.value) == str(full.value)


def test_experiment_file_params_expand_and_command_line_wins():
    import torch

    from engine.measure.hardware import preferred_dtype

    # quickstart sweeps model.dtype=auto,float32: where this CPU computes bf16 fast, auto is bfloat16 and the
    # two are twins; elsewhere auto is float32 and they fold into one trial (docs/configuration.md)
    twins = 1 if preferred_dtype(torch.device("cpu")) == "float32" else 2
    specs = expand(["experiment=quickstart"])
    assert len(specs) == 8 * twins and {s.config["sweep_name"] for s in specs} == {"quickstart"}
    assert {s.config["workload"]["context_len"] for s in specs} == {128, 512}
    # a fixed override pins an axis of the experiment; a list replaces it
    pinned = expand(["experiment=quickstart", "workload.context_len=64"])
    assert len(pinned) == 4 * twins and {s.config["workload"]["context_len"] for s in pinned} == {64}
    replaced = expand(["experiment=quickstart", "attention=sdpa", "workload.context_len=64,96,128"])
    assert len(replaced) == 6 * twins and {s.config["workload"]["context_len"] for s in replaced} == {64, 96, 128}


def test_all_problems_reported_together_with_keys():
    bad = [
        "kv_cache=bogus",  # unknown group option
        "workload.foo=1",  # unknown key
        "workload.context_len=abc",  # wrong type
        "attention=flash",  # flash on a CPU-only trial
        "workload.batch_size=0",  # impossible value
        "model.path=/does/not/exist",  # missing model
    ]
    with pytest.raises(SweepError) as ei:
        expand(bad)
    problems = ei.value.problems
    text = "\n".join(problems)
    assert len(problems) == 6, text
    assert "kv_cache: unknown option; available: contiguous, off, paged" in text
    assert "workload.foo: unknown key" in text and "context_len" in text
    assert "workload.context_len" in text and "Integer" in text
    assert "flash needs a CUDA GPU" in text
    assert "workload.batch_size: must be >= 1, got 0" in text
    assert "model.path" in text and "does not exist" in text


def test_context_beyond_model_maximum_is_rejected_per_trial():
    with pytest.raises(SweepError) as ei:
        expand(["workload.context_len=128,8190", "kv_cache=off,contiguous"])
    (msg,) = ei.value.problems
    assert "exceeds the model's maximum of 8192" in msg and "in 2 of 4 trials" in msg


def test_appended_unknown_key_is_rejected():
    with pytest.raises(SweepError) as ei:
        expand(["model=tiny-llama", "+workload.typo_key=3"])
    assert ei.value.problems == ["workload.typo_key: unknown key (not in the trial schema)"]


def test_paged_cache_needs_native_backend():
    with pytest.raises(SweepError) as ei:
        expand(["model=tiny-llama", "kv_cache=paged", "engine=hf"])
    assert "engine=hf cannot honour kv_cache.mode=paged: transformers' DynamicCache is contiguous; paged is engine=native's" in ei.value.problems[0]


def test_duplicate_trials_are_rejected():
    with pytest.raises(SweepError) as ei:
        expand(["model=tiny-llama", "attention=sdpa,sdpa"])
    assert "same configuration" in ei.value.problems[0]


@pytest.mark.parametrize("path", sorted((conf_dir() / "experiment").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_experiment_expands_and_validates(path: Path):
    """Every trial of every shipped experiment is valid; one that names an engine not installed here
    (llama.cpp, vLLM) is refused for that alone, and the rest of its grid is still checked."""
    overrides = [f"experiment={path.stem}"]
    if re.search(r"^optimize:", path.read_text(), re.M):  # an `infersweep optimize` experiment: validated as it runs
        return _validates_as_optimize(overrides)
    if path.stem == "engines":  # every variant, not only the experiment's default list
        variants = sorted(p.stem for p in (conf_dir() / "engine_variant").glob("*.yaml"))
        overrides.append("engine_variant=" + ",".join(variants))
    specs, _, unprepared = expand_on_a_new_machine(overrides)
    if specs is None:  # a new machine: the experiment needs `infersweep prepare ...` first, and says which
        assert all(re.search(r"`infersweep prepare[^`]*`", p) for p in unprepared), unprepared
        if in_ci():  # the full tier prepares every model and the task data: nothing may be missing there
            pytest.fail(f"experiment={path.stem} is not ready under CI=true: {unprepared}")
        return
    assert specs and all(s.config["sweep_name"] for s in specs)


def _validates_as_optimize(overrides: list[str]) -> None:
    """An optimize experiment's space is no grid: `infersweep optimize` validates the baseline and every value of
    every axis on it, a value's problem that names another axis being an interaction judged at its step (optimize-
    cpu's engine=native-cpp needs the KV cache the baseline has off). So: what `infersweep optimize` checks before
    its first trial passes, or (a new machine) only "`infersweep prepare ...`" problems stand in its way."""
    from engine import engines
    from experiments.optimize.run import OptimizeError, prepare

    try:
        with pytest.MonkeyPatch.context() as mp:  # an engine not installed here (llama.cpp, vLLM) is checked all the same
            for e in engines.all_engines():
                if e.missing() and not in_ci():
                    mp.setattr(e, "missing", lambda: None)
            space, _, _ = prepare(overrides)
    except OptimizeError as e:
        unprepared = [p for p in e.problems if "`infersweep prepare" in p]
        assert unprepared and len(unprepared) == len(e.problems), e.problems
        if in_ci():
            pytest.fail(f"{overrides} is not ready under CI=true: {unprepared}")
        return
    assert len(space.axes) >= 2 and space.config["sweep_name"]


def test_an_absent_engine_hides_no_other_problem():
    """The helper above lets only the 'not installed' refusal through: a real problem of a trial on an absent
    engine still fails, and the refusal itself names the engine and how to install it."""
    from engine.engines import get

    with pytest.raises(SweepError) as ei:
        expand_with_engines_absent(["model=tiny-llama", "engine=llamacpp,vllm", "kv_cache.block_size=32"])
    assert any(p.startswith("kv_cache.block_size: engine=vllm keeps vLLM CPU's own block size") for p in ei.value.problems)
    specs, absent = expand_with_engines_absent(["model=tiny-llama", "engine=llamacpp,vllm", "attention=sdpa",
                                                "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1"])
    assert len(specs) == 2 and absent == {n: get(n).missing() for n in ("llamacpp", "vllm") if get(n).missing()}
    assert all("make setup-" in why for why in absent.values())


def test_quant_kernel_on_an_engine_with_its_own_kernels_folds_to_one_hash():
    """llama.cpp and vLLM run their own kernels: quant.kernel (engine/quant.py's torch matmuls) changes nothing there,
    so every value validates and folds to the default -- one trial, the default's config hash -- where the torch
    engines keep one trial per kernel."""
    from engine.engines.hf import TORCH_KERNELS

    kernels = "quant.kernel=" + ",".join(TORCH_KERNELS)
    base = ["model=tiny-llama", "attention=sdpa", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1"]
    for engine in ("llamacpp", "vllm"):
        specs, _ = expand_with_engines_absent(base + [f"engine={engine}", kernels])
        (spec,) = specs  # the six identical trials are one
        assert spec.config["quant"]["kernel"] == "dequant", engine
        (alone,), _ = expand_with_engines_absent(base + [f"engine={engine}"])
        assert alone.config_hash == spec.config_hash  # the default's own hash: nothing recorded so far moves
    specs = expand(base + ["engine=hf", "quant=int8-weight", "quant.kernel=dequant,gemv"])
    assert len({s.config_hash for s in specs}) == 2
