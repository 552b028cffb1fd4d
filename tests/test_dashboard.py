"""Dashboard check, end to end: a small sweep + report, `infersweep ui` on the test store, then the MLflow UI
in headless Chromium (Debian's chromium + chromium-driver, driven by Selenium). The URL `ui` prints must
open, in a fresh browser of a 1440x900 window, on the latest experiment's runs table (not MLflow 3.x's GenAI
overview) with the metric columns that matter readable on the first screen; the sweeps, their child runs and
a logged plot must be there too. Screenshots are kept in test-artifacts/ (git-ignored).

Skips locally when Chromium, its driver or Selenium is missing; fails instead under CI (CI=true), whose
.ci/run installs them. Runs under `make test` (marker `browser`, not `slow`): `pytest tests/test_dashboard.py`.
"""
from __future__ import annotations

import os
import queue
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from experiments.config.compose import PROJECT_ROOT
from experiments.tracking.dashboard import METRIC_COLUMNS, UNSTABLE_FLAG, column_id, short_name
from experiments.analysis.report import build
from experiments.run.sweep import run_sweep
from experiments.tracking.server import free_port

# `browser` only (not `slow`): the README's `make test` runs it (CI installs Chromium), and so does a plain
# `pytest tests/test_dashboard.py`; it skips outside CI where Chromium is missing
pytestmark = [pytest.mark.browser]

ARTIFACTS = PROJECT_ROOT / "test-artifacts"
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--no-first-run", "--window-size=1440,900")


def _require_browser() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    missing = [name for name, p in (("chromium", chromium), ("chromedriver (chromium-driver)", driver)) if not p]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium (pip install -e '.[test]')")
    if missing:
        msg = f"dashboard test needs {', '.join(missing)}: apt-get install -y chromium chromium-driver"
        if os.environ.get("CI"):
            pytest.fail(msg + " (CI must install them: see .ci/run)")
        pytest.skip(msg)
    return chromium, driver


@pytest.fixture(scope="module")
def dashboard_sweep(ray_local, tiny_overrides, tracking, tmp_path_factory):
    res = run_sweep(tiny_overrides + ["sweep_name=t-dashboard", "kv_cache=off,contiguous", "attention=eager,sdpa"],
                    echo=lambda *_: None)
    assert not res.failed and res.parent_run_id
    rep = build("t-dashboard", tracking, out_dir=tmp_path_factory.mktemp("dash-report"), progress=False)
    assert rep.logged_to == res.parent_run_id
    return res


@pytest.fixture(scope="module")
def ui(dashboard_sweep, tracking_overrides):
    """`infersweep ui` as a user runs it, after the sweep: yields (server base URL, the URL it printed)."""
    _require_browser()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "experiments.cli", "ui", *tracking_overrides, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=PROJECT_ROOT)
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for ln in proc.stdout:
            lines.put(ln)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen: list[str] = []
    url = None
    try:
        while url is None:
            try:
                line = lines.get(timeout=300)  # a safety net for a hung start, not a speed requirement
            except queue.Empty:
                break
            if line is None:  # `ui` exited
                break
            seen.append(line)
            if line.startswith("MLflow UI: "):
                url = line.split()[2]
        if url is None:
            pytest.fail("`infersweep ui` printed no URL:\n" + "".join(seen))
        yield f"http://127.0.0.1:{port}", url
    finally:
        proc.terminate()  # `ui` stops its server on SIGTERM
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def browser():
    chromium, driver = _require_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        opts.add_argument(flag)
    d = webdriver.Chrome(service=Service(driver), options=opts)
    d.set_page_load_timeout(60)
    yield d
    d.quit()


def _shot(d, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    d.save_screenshot(str(path))
    return path


def _trial_metrics(client, res) -> dict[str, dict[str, float]]:
    return {r["run_id"]: client.get_run(r["run_id"]).data.metrics for r in res.rows}


# what a reader scans on the first screen, without scrolling or widening a column
FIRST_SCREEN = ("tok per s", "TPOT ms", "TTFT ms", UNSTABLE_FLAG, "PPL", "mem MB")
MAX_CELL_CHARS = 6  # 4 significant digits and a point: `0.9083`, `1040`, `130.7`


def test_printed_url_opens_the_runs_table_readable_on_the_first_screen(ui, dashboard_sweep, mlflow_client, browser):
    """A fresh browser (no local storage: MLflow 3.x would default to its GenAI pages, and opens its Assistant
    panel on a local server's first load) opens the URL that `infersweep ui` printed, in a 1440x900 window:
    the trial runs of the latest sweep's experiment, fastest first, and on the first screen, without clicking,
    scrolling or widening anything, the columns tok per s, TPOT, TTFT, the unstable flag, perplexity and memory
    in MB, each cell a short rounded value that fits its column."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    d = browser
    _, url = ui
    exp_id = mlflow_client.get_experiment_by_name("t-dashboard").experiment_id
    assert f"/#/experiments/{exp_id}/runs?" in url  # t-dashboard holds the latest sweep
    trials = _trial_metrics(mlflow_client, dashboard_sweep)
    logged = set().union(*(m.keys() for m in trials.values()))
    assert set(FIRST_SCREEN) | {"output_tok_s", "ttft_ms_p50", "tpot_ms_p50", "ppl", "peak_mem_bytes"} <= logged
    expected = [column_id(m) for m in METRIC_COLUMNS if m in logged]

    def headers() -> list:
        cells = d.find_elements(By.CSS_SELECTOR, "[role='columnheader'][col-id^='metrics.']")
        return sorted((c for c in cells if c.text), key=lambda c: c.location["x"])

    def rows() -> dict[str, int]:
        return {r.get_attribute("row-id"): int(r.get_attribute("row-index"))
                for r in d.find_elements(By.CSS_SELECTOR, "[role='row'][row-id]")}

    def cell(rid: str, col: str):
        return d.find_element(By.CSS_SELECTOR, f"[role='row'][row-id='{rid}'] [col-id='{col}']")

    # a trial labelled unstable (here by hand, as the pipeline writes it: the tag with the reason, the 0/1 flag)
    slowest = min(trials, key=lambda rid: trials[rid]["output_tok_s"])
    mlflow_client.set_tag(slowest, "unstable", "output_tok_s CV 14.2% > 10%")
    mlflow_client.log_metric(slowest, UNSTABLE_FLAG, 1.0)
    trials[slowest][UNSTABLE_FLAG] = 1.0
    d.get(url)
    try:
        WebDriverWait(d, 90, poll_frequency=0.5).until(lambda _: len(headers()) == len(expected) and set(rows()) == set(trials))
        WebDriverWait(d, 30, poll_frequency=0.5).until(lambda _: cell(slowest, column_id(UNSTABLE_FLAG)).text == "1")
    finally:
        shot = _shot(d, "mlflow-printed-url")
    assert d.execute_script("return window.innerWidth") == 1440
    # it stayed on the runs table of the classic (model training) view: no GenAI overview or evaluations
    assert f"/#/experiments/{exp_id}/runs?" in d.current_url and "workflowType=machine_learning" in d.current_url
    text = d.find_element(By.TAG_NAME, "body").text
    assert "Overview" not in text and "Evaluation" not in text and "t-dashboard" in text
    # `ui`'s front gave this fresh browser MLflow's own defaults: the Assistant panel closed (its button only)
    assert "Ask a question" not in text and "MLflow Assistant" not in text
    # the metric columns, left to right in the chosen order, the first-screen ones in view (not scrolled away,
    # not under the Assistant panel), their names in full
    hs = headers()
    assert [h.get_attribute("col-id") for h in hs] == expected
    on_screen = "const r = arguments[0].getBoundingClientRect();" \
                "const e = document.elementFromPoint(r.left + r.width / 2, r.top + r.height / 2);" \
                "return r.right <= window.innerWidth && r.bottom <= window.innerHeight && e !== null && arguments[0].contains(e);"
    # the full extent of the cell's text (an ellipsis clips the text, not its layout box) lies inside the cell
    fits = "const c = arguments[0], r = c.getBoundingClientRect(), w = document.createTreeWalker(c, NodeFilter.SHOW_TEXT);" \
           "let n, any = false; while ((n = w.nextNode())) { if (!n.textContent.trim()) continue; any = true;" \
           "const g = document.createRange(); g.selectNodeContents(n); const t = g.getBoundingClientRect();" \
           "if (t.left < r.left - 0.5 || t.right > r.right + 0.5) return false; } return any;"
    for h in hs:
        if h.get_attribute("col-id") in {column_id(m) for m in FIRST_SCREEN}:
            assert d.execute_script(on_screen, h), f"column {h.get_attribute('col-id')} is not in view"
            assert h.text.strip() in FIRST_SCREEN
            assert d.execute_script(fits, h), f"header {h.text!r} is cut"
    # one row per trial (the sweep's parent run, without metrics, is filtered out), fastest first; every cell
    # short, whole (not cut by its column) and the logged display value
    order = sorted(rows().items(), key=lambda kv: kv[1])
    tok_s = [trials[rid]["output_tok_s"] for rid, _ in order]
    assert tok_s == sorted(tok_s, reverse=True)
    for rid, _ in order:
        for m in FIRST_SCREEN:
            c = cell(rid, column_id(m))
            assert d.execute_script(on_screen, c), f"{m} of {rid} is not in view"
            assert len(c.text) <= MAX_CELL_CHARS and "…" not in c.text, f"{m}: {c.text!r} is not short"
            assert d.execute_script(fits, c), f"{m}: {c.text!r} is cut"
            assert float(c.text) == trials[rid][m]
        assert float(cell(rid, column_id("tok per s")).text) == pytest.approx(trials[rid]["output_tok_s"], rel=1e-3)
        assert float(cell(rid, column_id("mem MB")).text) == round(trials[rid]["peak_mem_bytes"] / 1e6)
        # the flag is the tag's (a loaded machine may flag more trials than the one labelled here)
        assert cell(rid, column_id(UNSTABLE_FLAG)).text == ("1" if mlflow_client.get_run(rid).data.tags.get("unstable") else "0")
    # each row is named by what tells it apart (the sweep's varying axes, short), whole, on the first screen
    for rid, _ in order:
        want = short_name(dashboard_sweep_swept(mlflow_client, rid))
        name = cell(rid, "attributes.`Run Name`")  # the run's colour swatch, then its name
        assert name.text.splitlines()[-1] == want, name.text
        assert d.execute_script(on_screen, name) and d.execute_script(fits, name), f"run name {want!r} is cut"
    assert shot.stat().st_size > 10_000


def dashboard_sweep_swept(client, rid: str) -> dict[str, str]:
    """The trial's varying axes, from its `swept` tag (`kv_cache=off attention=eager`)."""
    return dict(kv.split("=", 1) for kv in client.get_run(rid).data.tags["swept"].split())


def test_a_trial_page_lists_the_rounded_headline_metrics_first(ui, dashboard_sweep, mlflow_client, browser):
    """A trial's own page, opened as a click opens it (Overview > Metrics, which MLflow lists in logged order): the
    rounded headline copies come first, in the runs table's order, before the hundred full-precision metrics; the
    page is in the Model training mode with the Assistant panel closed."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    d = browser
    base, _ = ui
    rid = dashboard_sweep.rows[0]["run_id"]
    run = mlflow_client.get_run(rid)
    shown = [m for m in METRIC_COLUMNS if m in run.data.metrics]
    d.get(base + "/")  # a fresh browser's first visit: the UI's shell, from `ui`'s front
    d.get(f"{base}/#/experiments/{run.info.experiment_id}/runs/{rid}")  # as a click opens it: no workflowType

    def listed() -> list[str]:
        lines = d.find_element(By.TAG_NAME, "body").text.splitlines()
        start = next((i for i, ln in enumerate(lines) if ln.startswith("Metrics (")), None)
        if start is None or "Value" not in lines[start:]:
            return []
        first = lines.index("Value", start) + 1
        return lines[first:first + 2 * len(shown):2]  # metric, value, metric, value, ...

    try:
        WebDriverWait(d, 90, poll_frequency=0.5).until(lambda _: len(listed()) == len(shown))
    finally:
        _shot(d, "mlflow-trial-page")
    assert listed() == shown
    # in the Model training mode (the GenAI side bar lists Evaluation, Judges, Prompts), the Assistant closed
    text = d.find_element(By.TAG_NAME, "body").text
    assert "Evaluation" not in text and "Judges" not in text and "Ask a question" not in text


def test_mlflow_ui_shows_experiment_child_runs_and_a_logged_plot(ui, dashboard_sweep, mlflow_client, browser):
    """Without the saved view (the UI's "Default view"), sweeps are parent runs with their trials beneath."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    d = browser
    base, _ = ui
    res = dashboard_sweep
    exp_id = mlflow_client.get_experiment_by_name("t-dashboard").experiment_id
    parent = res.parent_run_id
    children = sorted(mlflow_client.get_run(r["run_id"]).info.run_name for r in res.rows)
    wait = WebDriverWait(d, 90, poll_frequency=0.5)

    def body() -> str:
        return d.find_element(By.TAG_NAME, "body").text

    # 1. the experiment's runs table: the experiment and the sweep's parent run (a React SPA: wait for it)
    d.get(f"{base}/#/experiments/{exp_id}/runs?workflowType=machine_learning")
    try:
        wait.until(lambda _: f"sweep-{res.sweep_id}" in body())
        assert "t-dashboard" in body()
        # 2. expand the parent run: its trial runs appear beneath it
        expander = d.find_element(By.CSS_SELECTOR, f"[role='row'][row-id='{parent}'] button")
        expander.click()
        wait.until(lambda _: all(name in body() for name in children))
    finally:
        _shot(d, "mlflow-runs")
    # 3. the parent run's artifacts: the report folder and a plot rendered as an image
    d.get(f"{base}/#/experiments/{exp_id}/runs/{parent}/artifacts/report/pareto.png")
    try:
        wait.until(lambda _: "report/pareto.png" in body() and "regime_chain.png" in body())
        loaded = lambda _: any(  # noqa: E731
            d.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img) > 200
            for img in d.find_elements(By.TAG_NAME, "img"))
        wait.until(loaded)
    finally:
        shot = _shot(d, "mlflow-report-plot")
    assert shot.stat().st_size > 10_000


@pytest.fixture(scope="module")
def needle_sweep(tiny_overrides, tmp_path_factory):
    """A needle-task sweep on the tiny model (the fake task data of tests/test_tasks.py), two context lengths."""
    from test_tasks import _fake_data

    cache = tmp_path_factory.mktemp("needle-cache")
    _fake_data(cache)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("INFERSWEEP_CACHE", str(cache))
        res = run_sweep(tiny_overrides + ["sweep_name=t-dashboard-needle", "seed=925", "eval=tasks",
                                          "eval.tasks=[niah_single]", "eval.limit=1", "eval.depths=[0.2,0.8]",
                                          "workload.context_len=700,800"], in_process=True, echo=lambda *_: None)
    assert not res.failed
    return res


def test_saved_view_of_a_task_sweep_shows_the_gate_and_task_score_and_the_needle_plot(ui, needle_sweep, mlflow_client,
                                                                                      browser):
    """The runs table of a sweep with eval.tasks opens with the gate and the task's score columns on screen,
    and a trial's needle_<task>.png renders on its artifacts page."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from experiments.tracking.dashboard import runs_url

    d = browser
    base, _ = ui
    exp_id = mlflow_client.get_experiment_by_name("t-dashboard-needle").experiment_id
    wanted = [column_id("task_gate"), column_id("acc niah_single")]
    wait = WebDriverWait(d, 90, poll_frequency=0.5)

    def headers() -> list[str]:
        cells = d.find_elements(By.CSS_SELECTOR, "[role='columnheader'][col-id^='metrics.']")
        return [c.get_attribute("col-id") for c in sorted((c for c in cells if c.text), key=lambda c: c.location["x"])]

    d.get(runs_url(base, exp_id))
    try:
        wait.until(lambda _: all(w in headers() for w in wanted))
    finally:
        _shot(d, "mlflow-task-columns")
    hs = headers()
    assert hs.index(wanted[0]) + 1 == hs.index(wanted[1])  # the gate, then the task's score
    shown = [c.text for c in d.find_elements(By.CSS_SELECTOR, f"[role='row'][row-id] [col-id='{wanted[1]}']")]
    assert len(shown) == len(needle_sweep.rows) and all(0 < len(t) <= MAX_CELL_CHARS for t in shown), shown  # rounded
    rid = needle_sweep.rows[0]["run_id"]
    d.get(f"{base}/#/experiments/{exp_id}/runs/{rid}/artifacts/needle_niah_single.png")
    try:
        wait.until(lambda _: any(
            d.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img) > 200
            for img in d.find_elements(By.TAG_NAME, "img")))
    finally:
        _shot(d, "mlflow-needle-plot")
