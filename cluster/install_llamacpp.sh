#!/usr/bin/env bash
# Install llama-cpp-python (engine=llamacpp) into the Python given as $1 (default: python3).
# PyPI has no binary wheel of it, so it is compiled once (3-8 min on 2 cores here, longer on a busy or slower
# machine) into a wheel cached in $INFERSWEEP_WHEELS (default ~/.cache/infersweep/wheels); every later setup installs that wheel in seconds.
# The wheel is built with -DGGML_NATIVE=ON: it is tuned to (and only safe on) this machine's CPU, which is why
# the cache lives in the home directory, not in the repository.
#
# Every step goes through "$1" (`$1 -c ...` to check, `$1 -m pip wheel ...` to build, `$1 -m pip install` to
# install), so tests/test_install_llamacpp.py drives the whole script -- empty cache, build, install -- with a
# stand-in interpreter that records those calls, without compiling anything.
set -euo pipefail
VERSION=0.3.36
PY=${1:-python3}
WHEELS=${INFERSWEEP_WHEELS:-$HOME/.cache/infersweep/wheels}

# with its [server] extras: engine=llamacpp-server runs `python -m llama_cpp.server` (uvicorn, fastapi, sse-starlette, ...)
if "$PY" -c "import sys, llama_cpp, uvicorn, fastapi, sse_starlette, starlette_context, pydantic_settings; sys.exit(llama_cpp.__version__ != '$VERSION')" 2>/dev/null; then
    echo "llama-cpp-python $VERSION (with its server) is already installed"
    exit 0
fi
mkdir -p "$WHEELS"
# a glob, not `ls | head`: under `set -o pipefail` an empty cache made `ls` fail and ended the script silently
find_wheel() {
    local w
    for w in "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl; do
        [ -f "$w" ] && { echo "$w"; return 0; }
    done
    return 0
}
wheel=$(find_wheel)
if [ -z "$wheel" ]; then
    # one build at a time per cache: a second setup waits for the first and then finds its wheel
    exec 9>"$WHEELS/.build.lock"
    flock 9
    wheel=$(find_wheel)
    if [ -z "$wheel" ]; then
        echo "no llama-cpp-python $VERSION wheel in $WHEELS: building it from source (minutes: 3-8 on 2 cores)..."
        if ! CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
             CMAKE_ARGS=${CMAKE_ARGS:--DGGML_NATIVE=ON} \
             "$PY" -m pip wheel --no-deps "llama-cpp-python==$VERSION" -w "$WHEELS"; then
            echo "error: building llama-cpp-python $VERSION failed (pip's output is above; the build needs a C/C++" \
                 "compiler and cmake)" >&2
            exit 1
        fi
        wheel=$(find_wheel)
    fi
    flock -u 9
fi
if [ -z "$wheel" ]; then
    echo "error: no llama_cpp_python-$VERSION-*.whl in $WHEELS after the build" >&2
    exit 1
fi
echo "installing $(basename "$wheel")"
"$PY" -m pip install -q "$wheel[server]"
"$PY" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'ready')"
