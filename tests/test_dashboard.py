"""Dashboard check, end to end: `mlflow server` on the test store, a small sweep + report, then the MLflow UI
in headless Chromium (Debian's chromium + chromium-driver, driven by Selenium) must show the experiment,
its child runs and a logged plot. Screenshots are kept in test-artifacts/ (git-ignored).

Skips locally when Chromium, its driver or Selenium is missing; fails instead under CI (CI=true), whose
.ci/run installs them.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from experiments.cli import server_command
from experiments.compose import PROJECT_ROOT
from experiments.report import build
from experiments.sweep import run_sweep

pytestmark = [pytest.mark.slow, pytest.mark.browser]

ARTIFACTS = PROJECT_ROOT / "test-artifacts"
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--no-first-run", "--window-size=1600,1000")


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tracking, tmp_path_factory):
    _require_browser()
    port = _free_port()
    log = open(tmp_path_factory.mktemp("server") / "mlflow-server.log", "w")
    proc = subprocess.Popen(server_command(tracking, port), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"mlflow server did not answer /health (see {log.name})")
        time.sleep(0.5)
    yield base
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture(scope="module")
def dashboard_sweep(ray_local, tiny_overrides, tracking, tmp_path_factory):
    res = run_sweep(tiny_overrides + ["sweep_name=t-dashboard", "kv_cache=off,contiguous", "attention=eager,sdpa"],
                    echo=lambda *_: None)
    assert not res.failed and res.parent_run_id
    rep = build("t-dashboard", tracking, out_dir=tmp_path_factory.mktemp("dash-report"), progress=False)
    assert rep.logged_to == res.parent_run_id
    return res


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


def test_mlflow_ui_shows_experiment_child_runs_and_a_logged_plot(mlflow_server, dashboard_sweep, mlflow_client, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    d = browser
    res = dashboard_sweep
    exp_id = mlflow_client.get_experiment_by_name("t-dashboard").experiment_id
    parent = res.parent_run_id
    children = sorted(mlflow_client.get_run(r["run_id"]).info.run_name for r in res.rows)
    wait = WebDriverWait(d, 90, poll_frequency=0.5)

    def body() -> str:
        return d.find_element(By.TAG_NAME, "body").text

    # 1. the experiment's runs table: the experiment and the sweep's parent run (a React SPA: wait for it)
    d.get(f"{mlflow_server}/#/experiments/{exp_id}/runs")
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
    d.get(f"{mlflow_server}/#/experiments/{exp_id}/runs/{parent}/artifacts/report/pareto.png")
    try:
        wait.until(lambda _: "report/pareto.png" in body() and "regime_chain.png" in body())
        loaded = lambda _: any(  # noqa: E731
            d.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img) > 200
            for img in d.find_elements(By.TAG_NAME, "img"))
        wait.until(loaded)
    finally:
        shot = _shot(d, "mlflow-report-plot")
    assert shot.stat().st_size > 10_000
