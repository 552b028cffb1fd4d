#!/usr/bin/env bash
# Install llama-cpp-python (engine=llamacpp) into the Python given as $1 (default: python3).
# PyPI has no binary wheel of it, so it is compiled once (10-20 min on 2 cores) into a wheel cached in
# $INFERSWEEP_WHEELS (default ~/.cache/infersweep/wheels); every later setup installs that wheel in seconds.
# The wheel is built with -DGGML_NATIVE=ON: it is tuned to (and only safe on) this machine's CPU, which is why
# the cache lives in the home directory, not in the repository.
set -euo pipefail
VERSION=0.3.36
PY=${1:-python3}
WHEELS=${INFERSWEEP_WHEELS:-$HOME/.cache/infersweep/wheels}

if "$PY" -c "import sys, llama_cpp; sys.exit(llama_cpp.__version__ != '$VERSION')" 2>/dev/null; then
    echo "llama-cpp-python $VERSION is already installed"
    exit 0
fi
mkdir -p "$WHEELS"
find_wheel() { ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -n 1; }
wheel=$(find_wheel)
if [ -z "$wheel" ]; then
    # one build at a time per cache: a second setup waits for the first and then finds its wheel
    exec 9>"$WHEELS/.build.lock"
    flock 9
    wheel=$(find_wheel)
    if [ -z "$wheel" ]; then
        echo "building llama-cpp-python $VERSION from source into $WHEELS (10-20 min on 2 cores)..."
        CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
        CMAKE_ARGS=${CMAKE_ARGS:--DGGML_NATIVE=ON} \
            "$PY" -m pip wheel --no-deps "llama-cpp-python==$VERSION" -w "$WHEELS"
        wheel=$(find_wheel)
    fi
    flock -u 9
fi
[ -n "$wheel" ] || { echo "no llama-cpp-python $VERSION wheel in $WHEELS after the build" >&2; exit 1; }
echo "installing $(basename "$wheel")"
"$PY" -m pip install -q "$wheel"
"$PY" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'ready')"
