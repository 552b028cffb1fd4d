#!/usr/bin/env bash
# Install llama-cpp-python (engine=llamacpp) into the Python given as $1 (default: python3).
# PyPI has no binary wheel of it, so it is compiled once (3-8 min on 2 cores here, longer on a busy or slower
# machine) into a wheel cached in $INFERSWEEP_WHEELS (default ~/.cache/infersweep/wheels); every later setup installs that wheel in seconds.
# The wheel is built for this machine's CPU (-DGGML_NATIVE=ON, or its ISA extensions named where it has AMX: below),
# so it is only safe here, which is why the cache lives in the home directory, not in the repository.
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

# The build's flags. -DGGML_NATIVE=ON tunes it to this CPU -- except where the CPU advertises AMX: ggml's AMX
# kernels (its Q8_0 / Q4_0 matmuls) died with SIGILL at `tilezero` on a Sapphire Rapids VM where the tile
# instructions themselves run (checked in C, with and without the arch_prctl permission): engine=llamacpp's Q8_0
# crashed on its first prompt. There the build names every ISA extension the CPU has, AMX left out. CMAKE_ARGS
# set by the caller wins; INFERSWEEP_CPUINFO stands in for /proc/cpuinfo (tests).
default_cmake_args() {
    local flags pair args
    flags=" $(grep -m1 '^flags' "${INFERSWEEP_CPUINFO:-/proc/cpuinfo}" 2>/dev/null | cut -d: -f2) "
    case "$flags" in
        *" amx_tile "*|*" amx_int8 "*|*" amx_bf16 "*) ;;
        *) echo "-DGGML_NATIVE=ON"; return 0 ;;
    esac
    args="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    for pair in sse4_2:SSE42 avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx512f:AVX512 avx512vbmi:AVX512_VBMI \
                avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI; do
        case "$flags" in *" ${pair%%:*} "*) args="$args -DGGML_${pair#*:}=ON" ;; esac
    done
    echo "$args"
}
ARGS=${CMAKE_ARGS:-$(default_cmake_args)}
# the flags a cached wheel was built with sit beside it; a wheel built with others is rebuilt (a wheel from before
# this file was kept was built with -DGGML_NATIVE=ON)
STAMP="$WHEELS/llama_cpp_python-$VERSION.cmake-args"
# a glob, not `ls | head`: under `set -o pipefail` an empty cache made `ls` fail and ended the script silently
find_wheel() {
    local w
    for w in "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl; do
        [ -f "$w" ] && { echo "$w"; return 0; }
    done
    return 0
}
built_with() { cat "$STAMP" 2>/dev/null || echo "-DGGML_NATIVE=ON"; }
wheel=$(find_wheel)
if [ -n "$wheel" ] && [ "$(built_with)" != "$ARGS" ]; then
    echo "the cached $(basename "$wheel") was built with '$(built_with)', this machine needs '$ARGS': rebuilding"
    rm -f "$wheel"
    wheel=""
fi
if [ -z "$wheel" ]; then
    # one build at a time per cache: a second setup waits for the first and then finds its wheel
    exec 9>"$WHEELS/.build.lock"
    flock 9
    wheel=$(find_wheel)
    if [ -z "$wheel" ]; then
        echo "no llama-cpp-python $VERSION wheel in $WHEELS: building it from source (minutes: 3-8 on 2 cores)..."
        # --no-cache-dir: pip's own cache keys a built wheel by the source, not by CMAKE_ARGS
        if ! CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
             CMAKE_ARGS=$ARGS \
             "$PY" -m pip wheel --no-deps --no-cache-dir "llama-cpp-python==$VERSION" -w "$WHEELS"; then
            echo "error: building llama-cpp-python $VERSION failed (pip's output is above; the build needs a C/C++" \
                 "compiler and cmake)" >&2
            exit 1
        fi
        wheel=$(find_wheel)
        [ -n "$wheel" ] && echo "$ARGS" > "$STAMP"
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
