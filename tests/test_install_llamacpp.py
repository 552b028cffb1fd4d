"""cluster/install_llamacpp.sh (`make setup-llamacpp`) on a machine without the cached wheel.

The script runs every step through the interpreter it is given (`$1 -c` to check, `$1 -m pip wheel` to
build, `$1 -m pip install` to install), so a stand-in interpreter -- a small shell script that records its
calls, has no llama_cpp and "builds" by writing an empty wheel file -- drives the real script end to end
in milliseconds. This is the path that once ended at once with `make: *** Error 2` and no message (an
empty cache made `ls | head` fail under pipefail) while CI stayed green.
"""
from __future__ import annotations

import os
import shutil
import sys
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "cluster" / "install_llamacpp.sh"
VERSION = "0.3.36"
WHEEL = f"llama_cpp_python-{VERSION}-cp311-cp311-linux_x86_64.whl"

# A python stand-in. FAKE_LOG gets one line per call; FAKE_BUILD says what `pip wheel` does: "wheel" writes
# a wheel into the -w folder, "nothing" exits 0 without one, "fail" exits 1 like a failed compile.
# `import llama_cpp` succeeds only after `pip install` ran (the state lives in FAKE_STATE).
FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
case "$1" in
  -c)
    if [ -f "$FAKE_STATE/installed" ]; then echo "llama-cpp-python 0.3.36 ready"; exit 0; fi
    echo "ModuleNotFoundError: No module named 'llama_cpp'" >&2; exit 1 ;;
  -m)
    [ "$2" = pip ] || exit 3
    case "$3" in
      wheel)
        echo "env CMAKE_ARGS=$CMAKE_ARGS CMAKE_BUILD_PARALLEL_LEVEL=$CMAKE_BUILD_PARALLEL_LEVEL" >> "$FAKE_LOG"
        out=""; prev=""
        for a in "$@"; do [ "$prev" = "-w" ] && out="$a"; prev="$a"; done
        case "$FAKE_BUILD" in
          wheel) : > "$out/llama_cpp_python-0.3.36-cp311-cp311-linux_x86_64.whl" ;;
          nothing) ;;
          fail) echo "CMake Error: CMAKE_CXX_COMPILER not set" >&2; exit 1 ;;
        esac ;;
      install) : > "$FAKE_STATE/installed" ;;
      *) exit 4 ;;
    esac ;;
  *) exit 5 ;;
esac
"""

pytestmark = pytest.mark.skipif(shutil.which("flock") is None, reason="the installer needs flock (util-linux)")


AMD_FLAGS = "fpu sse4_2 avx avx2 fma f16c bmi2 avx512f avx512_vnni avx512_bf16"  # an AMD EPYC seen here: no AMX
AMX_FLAGS = AMD_FLAGS + " avx512vbmi avx_vnni amx_bf16 amx_tile amx_int8"  # the Sapphire Rapids VM


def run_installer(tmp_path: Path, build: str, wheels: Path | None = None,
                  cpu: str = AMD_FLAGS) -> tuple[subprocess.CompletedProcess, list[str]]:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    log = tmp_path / "calls.log"
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {cpu}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CMAKE_ARGS", "CMAKE_BUILD_PARALLEL_LEVEL")}
    env.update(INFERSWEEP_WHEELS=str(wheels or tmp_path / "wheels"), FAKE_LOG=str(log), FAKE_STATE=str(state),
               FAKE_BUILD=build, INFERSWEEP_CPUINFO=str(cpuinfo))
    p = subprocess.run(["bash", str(SCRIPT), str(fake)], env=env, capture_output=True, text=True, timeout=60)
    return p, (log.read_text().splitlines() if log.exists() else [])


def test_empty_cache_builds_the_wheel_then_installs_it(tmp_path):
    wheels = tmp_path / "wheels"  # does not exist yet: a fresh machine
    p, calls = run_installer(tmp_path, "wheel", wheels)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"no llama-cpp-python {VERSION} wheel in {wheels}: building it from source" in p.stdout
    pip = [c for c in calls if c.startswith("-m pip")]
    assert pip == [f"-m pip wheel --no-deps --no-cache-dir llama-cpp-python=={VERSION} -w {wheels}",
                   f"-m pip install -q {wheels / WHEEL}[server]"]
    nproc = subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout.strip()
    assert f"env CMAKE_ARGS=-DGGML_NATIVE=ON CMAKE_BUILD_PARALLEL_LEVEL={nproc}" in calls  # tuned to this CPU
    assert f"installing {WHEEL}" in p.stdout and p.stdout.rstrip().endswith(f"llama-cpp-python {VERSION} ready")
    # the building message comes before the install, the readiness check is the last call
    assert p.stdout.index("building it from source") < p.stdout.index("installing")
    assert calls[-1].startswith("-c import llama_cpp")


def test_cached_wheel_is_installed_without_a_build(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / WHEEL).write_bytes(b"")
    (wheels / f"llama_cpp_python-0.3.1-cp311-cp311-linux_x86_64.whl").write_bytes(b"")  # another version: ignored
    p, calls = run_installer(tmp_path, "fail", wheels)  # a build would fail: it must not run
    assert p.returncode == 0, p.stdout + p.stderr
    assert "building" not in p.stdout
    assert [c for c in calls if c.startswith("-m pip")] == [f"-m pip install -q {wheels / WHEEL}[server]"]


AMX_OFF = ("-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_SSE42=ON -DGGML_AVX=ON "
           "-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON "
           "-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON")


def test_a_cpu_with_amx_builds_its_isa_by_name_without_ggmls_amx_kernels(tmp_path):
    """ggml's AMX matmuls died with SIGILL on a Sapphire Rapids VM: there every extension the CPU has is named
    and AMX is left out; the flags are kept beside the wheel."""
    wheels = tmp_path / "wheels"
    p, calls = run_installer(tmp_path, "wheel", wheels, cpu=AMX_FLAGS)
    assert p.returncode == 0, p.stdout + p.stderr
    assert any(c.startswith(f"env CMAKE_ARGS={AMX_OFF} ") for c in calls), calls
    assert (wheels / f"llama_cpp_python-{VERSION}.cmake-args").read_text().strip() == AMX_OFF


def test_a_cached_wheel_built_with_other_flags_is_rebuilt(tmp_path):
    """The AMX machine's cache held a native wheel (it crashed): it is rebuilt with this machine's flags; a wheel
    whose flags match is kept."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / WHEEL).write_bytes(b"old")  # no flags file: built with -DGGML_NATIVE=ON, as before
    p, calls = run_installer(tmp_path, "wheel", wheels, cpu=AMX_FLAGS)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "was built with '-DGGML_NATIVE=ON', this machine needs" in p.stdout and "rebuilding" in p.stdout
    assert (wheels / WHEEL).read_bytes() == b""  # the fake build's wheel, not the old one
    p, calls = run_installer(tmp_path, "fail", wheels, cpu=AMX_FLAGS)  # the flags match now: no build
    assert p.returncode == 0 and "building" not in p.stdout


def test_build_without_a_wheel_fails_with_a_message(tmp_path):
    wheels = tmp_path / "wheels"
    p, calls = run_installer(tmp_path, "nothing", wheels)
    assert p.returncode == 1
    assert f"error: no llama_cpp_python-{VERSION}-*.whl in {wheels} after the build" in p.stderr
    assert not any(c.startswith("-m pip install") for c in calls)


def test_failed_build_says_so_and_installs_nothing(tmp_path):
    p, calls = run_installer(tmp_path, "fail")
    assert p.returncode == 1
    assert "CMake Error" in p.stderr  # pip's own output stays visible
    assert f"error: building llama-cpp-python {VERSION} failed" in p.stderr and "compiler and cmake" in p.stderr
    assert not any(c.startswith("-m pip install") for c in calls)


def test_already_installed_does_nothing(tmp_path):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "installed").write_bytes(b"")
    p, calls = run_installer(tmp_path, "fail")
    assert p.returncode == 0 and f"llama-cpp-python {VERSION} (with its server) is already installed" in p.stdout
    assert len(calls) == 1 and calls[0].startswith("-c ") and not (tmp_path / "wheels").exists()


# --- CI=true: a missing engine fails, it does not skip --------------------------------------------------
ENGINE_TESTS = '''
from conftest import require_engine


@require_engine("ghost", False, "ghost is not installed (make setup-ghost)")
def test_needs_ghost():
    pass


@require_engine("here", True, "never shown")
def test_needs_an_installed_engine():
    pass
'''


def _run_engine_tests(tmp_path: Path, ci: str | None, source: str = ENGINE_TESTS) -> subprocess.CompletedProcess:
    """The repository's conftest with `source` (two engine-marked tests), in a pytest of their own."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_engines.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rsf", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_missing_engine_skips_outside_ci_and_fails_under_ci(tmp_path):
    p = _run_engine_tests(tmp_path, None)
    assert p.returncode == 0, p.stdout
    assert "1 passed, 1 skipped" in p.stdout
    assert "engine ghost is not available: ghost is not installed (make setup-ghost)" in p.stdout
    p = _run_engine_tests(tmp_path, "true")
    assert p.returncode == 1, p.stdout
    # failed in its set-up (pytest counts it as an error): before any fixture could load the missing engine
    assert "1 passed, 1 error in" in p.stdout and "SKIPPED" not in p.stdout
    assert "engine ghost is not available: ghost is not installed (make setup-ghost) (CI=true" in p.stdout


SKIPPING_TESTS = '''
import pytest


def test_gpu_only():
    pytest.skip("no CUDA device")


@pytest.mark.skipif(True, reason="selenium is not installed")
def test_needs_a_package():
    pass


@pytest.mark.xfail(reason="a known bug", strict=False)
def test_known_bug():
    assert False


def test_runs():
    pass
'''


def test_under_ci_a_skip_fails_the_run_unless_its_reason_is_expected(tmp_path):
    p = _run_engine_tests(tmp_path, None, SKIPPING_TESTS)
    assert p.returncode == 0 and "1 passed, 2 skipped, 1 xfailed" in p.stdout, p.stdout
    assert "unexpected skips" not in p.stdout
    p = _run_engine_tests(tmp_path, "true", SKIPPING_TESTS)
    assert p.returncode == 1 and "1 passed, 2 skipped, 1 xfailed" in p.stdout, p.stdout
    section = p.stdout[p.stdout.index("unexpected skips (CI=true: each fails the run)"):]
    assert "test_engines.py::test_needs_a_package: selenium is not installed" in section
    assert "test_gpu_only" not in section and "test_known_bug" not in section  # expected reason; an xfail is no skip


def test_ci_flag_is_read_when_the_test_runs(monkeypatch):
    from conftest import engine_missing, in_ci

    for value, expected in (("true", True), ("TRUE", True), ("1", True), ("false", False), ("", False)):
        monkeypatch.setenv("CI", value)
        assert in_ci() is expected, value
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="engine vllm is not available: no venv"):
        engine_missing("vllm", "no venv")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="engine vllm is not available: no venv"):
        engine_missing("vllm", "no venv")


def test_ci_script_fails_on_an_engine_install_failure_only_under_ci(tmp_path):
    """.ci/run's `setup_engine`, with a `make` that fails: a warning by hand, the end of the run in CI."""
    text = (ROOT / ".ci" / "run").read_text()
    fn = text[text.index("setup_engine() {"):]
    fn = fn[: fn.index("\n}\n") + 3]
    script = "set -euo pipefail\nmake() { echo \"make $*\"; return 2; }\n" + fn + "setup_engine setup-llamacpp\necho after\n"
    for ci, rc in ((None, 0), ("false", 0), ("true", 1)):
        env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": ci} if ci is not None else {})
        p = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)
        assert p.returncode == rc, (ci, p.stdout, p.stderr)
        if rc:
            assert "error: make setup-llamacpp failed; under CI=true a missing engine fails the run" in p.stderr
            assert "after" not in p.stdout
        else:
            assert "warning: make setup-llamacpp failed; its tests will skip" in p.stdout and "after" in p.stdout


def test_ci_runs_the_readme_test_command_without_the_engines_before_installing_them():
    """.ci/run proves the newcomer's path (`make test` on an empty INFERSWEEP_CACHE with llama.cpp and vLLM absent,
    CI unset so their tests skip), then that llama-cpp-python's build still starts without the kept wheel, before it
    installs the engines and runs every tier under the caller's CI=true in a second empty cache."""
    text = (ROOT / ".ci" / "run").read_text()
    lines = [ln.strip() for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    # a command continued over several lines is one command
    joined, buf = [], ""
    for ln in lines:
        buf = f"{buf} {ln.rstrip(chr(92)).strip()}".strip()
        if not ln.endswith("\\"):
            joined.append(buf)
            buf = ""
    lines = joined
    order = [next(i for i, ln in enumerate(lines) if ln.startswith(cmd)) for cmd in
             ("make setup", "env -u CI INFERSWEEP_CACHE=", "cluster/check_llamacpp_build.sh",
              "setup_engine setup-llamacpp", "setup_engine setup-vllm", 'INFERSWEEP_CACHE="$FULL_CACHE"')]
    assert order == sorted(order)
    fast = lines[order[1]]
    assert "make test " in fast and "INFERSWEEP_VLLM_PYTHON=/nonexistent" in fast
    assert "uninstall -q -y llama-cpp-python" in lines[order[1] - 1]
    # both caches are new and distinct folders (mktemp), never the machine's ~/.cache/infersweep
    assert 'INFERSWEEP_CACHE="$NEWCOMER_CACHE"' in fast
    assert any(ln.startswith("NEWCOMER_CACHE=$(mktemp -d") for ln in lines)
    assert any(ln.startswith("FULL_CACHE=$(mktemp -d") for ln in lines)
    # the full tier runs only what the newcomer tier did not (tests/test_ci_tiers.py): the skips it logged
    assert 'INFERSWEEP_SKIPPED_LOG="$SKIPPED"' in fast and 'INFERSWEEP_REST_OF="$SKIPPED"' in lines[order[-1]]


# --- cluster/check_llamacpp_build.sh: the build still starts from an empty wheel cache ---------------------
CHECK = ROOT / "cluster" / "check_llamacpp_build.sh"
# FAKE_BUILD for the check: "configures" prints CMake's line and then keeps "compiling" (a sleep the check must
# stop, with its whole process group), "stops" fails before CMake configured anything, "hangs" never configures.
FAKE_BUILD_FOR_CHECK = r"""#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
case "$1" in
  -c) echo "ModuleNotFoundError: No module named 'llama_cpp'" >&2; exit 1 ;;
  -m)
    [ "$3" = wheel ] || exit 4
    echo "env PIP_VERBOSE=$PIP_VERBOSE PIP_NO_CACHE_DIR=$PIP_NO_CACHE_DIR" >> "$FAKE_LOG"
    case "$FAKE_BUILD" in
      configures)
        echo "-- The CXX compiler identification is GNU 12.2.0"
        echo "-- Build files have been written to: /tmp/build"
        sleep 60 & echo $! > "$FAKE_STATE/compiler.pid"; wait ;;
      stops) echo "ERROR: Could not find a version that satisfies the requirement llama-cpp-python" >&2; exit 1 ;;
      hangs) sleep 60 ;;
    esac ;;
esac
"""


def run_check(tmp_path: Path, build: str, limit: int = 30) -> tuple[subprocess.CompletedProcess, Path]:
    fake = tmp_path / "python"
    fake.write_text(FAKE_BUILD_FOR_CHECK)
    fake.chmod(0o755)
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    env = dict(os.environ, FAKE_LOG=str(tmp_path / "calls.log"), FAKE_STATE=str(state), FAKE_BUILD=build)
    p = subprocess.run(["bash", str(CHECK), str(fake), str(limit)], env=env, capture_output=True, text=True, timeout=90)
    return p, state


def test_build_check_passes_once_cmake_configured_and_stops_the_build(tmp_path):
    p, state = run_check(tmp_path, "configures")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "build starts from an empty wheel cache: CMake configured it in" in p.stdout
    assert "(The CXX compiler identification is GNU 12.2.0)" in p.stdout
    calls = (tmp_path / "calls.log").read_text()
    assert "-m pip wheel --no-deps --no-cache-dir llama-cpp-python==" in calls and "env PIP_VERBOSE=1 PIP_NO_CACHE_DIR=1" in calls  # pip's own wheel cache must not stand in for the build
    # the "compiler" the build started is gone with the build: nothing keeps compiling after the check
    pid = int((state / "compiler.pid").read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists()


@pytest.mark.parametrize("build,why", [("stops", "stopped before CMake configured it"),
                                       ("hangs", "did not reach CMake's configure step within 3 s")])
def test_build_check_fails_with_the_build_log_when_cmake_never_configures(tmp_path, build, why):
    p, _ = run_check(tmp_path, build, limit=3)
    assert p.returncode == 1 and why in p.stderr, p.stdout + p.stderr
    if build == "stops":
        assert "Could not find a version that satisfies the requirement" in p.stderr  # the log's end is shown
