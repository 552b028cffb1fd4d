"""Shared fixtures: one embedded Ray and one MLflow store per test session (both are slow to start)."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

TINY = ["model=tiny-llama", "workload.context_len=24", "workload.max_new_tokens=6", "workload.repeats=1",
        "workload.warmup=1", "eval.num_windows=1", "cluster.num_cpus_per_trial=1"]


FAKE_GPUS = 2  # the session's Ray node advertises two GPUs (no CUDA behind them: Ray only hands out device ids)


# --- engines that may be missing (llama.cpp, vLLM) ---------------------------------------------------------
# Outside CI a test of an engine that is not installed skips with the reason; under CI=true it FAILS: a CI run
# on a machine where `make setup-llamacpp` / `make setup-vllm` did not work must not come out green without
# ever running those tests.
def in_ci() -> bool:
    """Whether this is a CI run (`CI=true`, as GitHub Actions, GitLab and .ci/run's callers set it)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def require_engine(name: str, available: bool, reason: str) -> pytest.MarkDecorator:
    """Decorator for tests that need engine `name`: they skip (outside CI) or fail (CI=true) with `reason`
    when `available` is false. The CI check happens when the test runs, not at import."""
    return pytest.mark.needs_engine(name, available=available, reason=reason)


def require_installed(name: str) -> pytest.MarkDecorator:
    """`require_engine` for the registry's engine `name` (engine/engines/): available where its own `missing()`
    finds nothing wrong, the reason in its own words (what to run to install it) otherwise."""
    from engine import engines

    why = engines.get(name).missing()
    return require_engine(name, why is None, why or "")


def engine_missing(name: str, reason: str) -> None:
    """Skip the running test, or fail it under CI=true, because engine `name` is not installed."""
    msg = f"engine {name} is not available: {reason}"
    if in_ci():
        pytest.fail(f"{msg} (CI=true: a skipped engine fails the run)", pytrace=False)
    pytest.skip(msg)


def expand_with_engines_absent(overrides: list[str], **kw):
    """`expand(overrides)` on a machine that may lack the optional engines (llama.cpp, vLLM): (specs, {engine:
    why it is missing}). A sweep that names an absent engine must be refused for that reason alone -- any
    other problem still raises -- and its trials are then expanded as where the engine is installed, so the
    rest of the grid (every other check, the trial count) is validated on any machine."""
    from engine import engines
    from experiments.config.compose import SweepError, expand

    absent = {n: why for n in engines.NAMES if (why := engines.get(n).missing())}
    try:
        return expand(overrides, **kw), {}
    except SweepError as e:
        named = {n: why for n, why in absent.items() if any(p.startswith(f"engine.backend: {why}") for p in e.problems)}
        if not named or any(not p.startswith(tuple(f"engine.backend: {why}" for why in named.values()))
                            for p in e.problems):
            raise
    with pytest.MonkeyPatch.context() as mp:  # validation's install check only: nothing runs on the engine
        for n in named:
            mp.setattr(engines.get(n), "missing", lambda: None)
        return expand(overrides, **kw), named


def need_prepared(name: str) -> None:
    """Skip the running test, or fail it under CI=true, when the shipped model `name` is neither converted nor
    installed (a new machine: `infersweep prepare NAME` installs and converts it; `make test-all` does it)."""
    from engine.models import PREPARED_MODELS, prepared_dir, source_installed

    if (prepared_dir(name) / "infersweep-prepared.json").is_file() or source_installed(name):
        return
    problem = f"{name} is not prepared on this machine: run `infersweep prepare {name}` (installs " \
              f"{', '.join(PREPARED_MODELS[name].pip)})"
    if in_ci():
        pytest.fail(f"{problem} (CI=true: the full tier prepares every model)", pytrace=False)
    pytest.skip(problem)


PREPARE_HINT = "`infersweep prepare"  # every "not prepared yet" problem names its command (models and task data)


def expand_on_a_new_machine(overrides: list[str], **kw):
    """`expand_with_engines_absent` on a machine that may also lack the prepared models and task data (a new
    user's empty INFERSWEEP_CACHE): returns (specs, absent engines, []) where everything is there, else
    (None, {}, problems) when the only problems are "prepare ..." ones -- each must name its command. Any other
    problem still raises."""
    from experiments.config.compose import SweepError

    try:
        specs, absent = expand_with_engines_absent(overrides, **kw)
        return specs, absent, []
    except SweepError as e:
        from engine import engines

        missing = tuple(f"engine.backend: {why}" for n in engines.NAMES if (why := engines.get(n).missing()))
        unprepared = [p for p in e.problems if PREPARE_HINT in p]
        if not unprepared or any(PREPARE_HINT not in p and not p.startswith(missing) for p in e.problems):
            raise
        return None, {}, unprepared


def need_task_data() -> None:
    """Skip the running test, or fail it under CI=true, when the offline task data is not prepared
    (`infersweep prepare --data`; `make test-all` does it)."""
    from engine.tasks import data as task_data

    problem = task_data.data_problems()
    if problem is None:
        return
    if in_ci():
        pytest.fail(f"{problem} (CI=true: tests of task accuracy must not skip)", pytrace=False)
    pytest.skip(problem)


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_engine(name, available, reason): see tests/conftest.py require_engine")


def pytest_runtest_setup(item):
    for mark in item.iter_markers("needs_engine"):
        if not mark.kwargs["available"]:
            engine_missing(mark.args[0], mark.kwargs["reason"])


# --- CI=true: a skip fails the run unless its reason is expected ------------------------------------------
# A skip in CI means something was not tested; it is accepted only for hardware the CI machine cannot have
# (no CUDA GPU, or a GPU where a test checks the CPU path) and for checks that need a quiet machine and found
# it busy (they say so and cannot be forced). Anything else -- a package, a browser, PostgreSQL, a console
# script not installed -- fails the run at the end, listed under "unexpected skips".
EXPECTED_SKIPS = (
    "no CUDA device",  # tests/test_spread.py (gpu marker) on a CPU machine
    "CPU-only check",  # tests/test_engine_hf.py on a GPU machine
    "the machine was loaded during the probe",  # tests/test_costmodel.py: a probe under load is never cached
    "the machine is already loaded by other work",  # tests/test_hardware.py: the quiet half needs a quiet machine
    "other work loaded the machine during the quiet probe",
    "the machine is saturated by other work",  # tests/test_spread.py: no room to see a burner
)
_unexpected_skips: list[str] = []


def skip_reason(report) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


# --- CI's tiers share the work (.ci/run) ---------------------------------------------------------------------
# The newcomer tier (`make test`, empty cache, no optional engine) writes the node ids of the tests it skipped to
# INFERSWEEP_SKIPPED_LOG; the full tier (`make test-all` with both engines and everything prepared) is given that
# file as INFERSWEEP_REST_OF and runs only what the newcomer tier did not: the marked slower tiers (slow, vllm)
# and the fast tests that skipped there. Without the variables every selected test runs.
SKIPPED_LOG_ENV, REST_OF_ENV = "INFERSWEEP_SKIPPED_LOG", "INFERSWEEP_REST_OF"
NOT_IN_THE_FAST_TIER = ("slow", "vllm")  # the markers pyproject's addopts leaves out of `make test`


def rest_of(items, skipped_ids: set[str]) -> tuple[list, list]:
    """(kept, deselected): kept = the items of a marked slower tier or skipped by the earlier run."""
    kept, dropped = [], []
    for item in items:
        slower = any(item.get_closest_marker(m) for m in NOT_IN_THE_FAST_TIER)
        (kept if slower or item.nodeid in skipped_ids else dropped).append(item)
    return kept, dropped


def pytest_collection_modifyitems(config, items):
    path = os.environ.get(REST_OF_ENV)
    if not path:
        return
    with open(path) as f:
        skipped = {line.strip() for line in f if line.strip()}
    kept, dropped = rest_of(items, skipped)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_runtest_logreport(report):
    if report.skipped and (path := os.environ.get(SKIPPED_LOG_ENV)):
        with open(path, "a") as f:
            f.write(report.nodeid + "\n")
    if report.skipped and not hasattr(report, "wasxfail") and in_ci():
        reason = skip_reason(report)
        if not any(expected in reason for expected in EXPECTED_SKIPS):
            _unexpected_skips.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session, exitstatus):
    if _unexpected_skips and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if _unexpected_skips:
        terminalreporter.section("unexpected skips (CI=true: each fails the run)", red=True)
        for line in _unexpected_skips:
            terminalreporter.line(line)
        terminalreporter.line("a skip is expected only for the reasons in tests/conftest.py EXPECTED_SKIPS")


@pytest.fixture(scope="session")
def ray_local():
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, num_gpus=FAKE_GPUS, include_dashboard=False, log_to_driver=False,
                 logging_level="WARNING")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tracking_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("mlflow")


@pytest.fixture(scope="session")
def tracking_overrides(tracking_dir):
    return [f"tracking.uri=sqlite:///{tracking_dir}/mlflow.db", f"tracking.artifact_root={tracking_dir}/artifacts"]


@pytest.fixture(scope="session")
def tracking(tracking_dir):
    return {"uri": f"sqlite:///{tracking_dir}/mlflow.db", "artifact_root": f"{tracking_dir}/artifacts", "ui_port": 5000}


@pytest.fixture(scope="session")
def mlflow_client(tracking):
    from mlflow.tracking import MlflowClient

    from experiments.tracking.store import resolve_uri

    return MlflowClient(tracking_uri=resolve_uri(tracking["uri"]))


@pytest.fixture(scope="session")
def tiny_overrides(tracking_overrides):
    return TINY + tracking_overrides


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """One `mlflow server` (127.0.0.1, --workers 1, own SQLite store) for the session; yields its URL."""
    from experiments.tracking.server import MlflowServer

    d = tmp_path_factory.mktemp("mlflow-server")
    tracking = {"uri": f"sqlite:///{d}/mlflow.db", "artifact_root": f"{d}/artifacts", "host": "127.0.0.1", "workers": 1}
    with MlflowServer(tracking, log_path=d / "server.log") as server:
        yield server.url
