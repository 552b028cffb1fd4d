#!/usr/bin/env bash
# Prove that llama-cpp-python still builds from nothing on this machine without compiling all of it: with an
# empty wheel cache, start `cluster/install_llamacpp.sh`'s own build (same version, same pip command) and stop it
# as soon as CMake has configured the project (the sdist was downloaded, the build backend installed, the
# compilers found, the project generated). CI runs this because the compiled wheel in ~/.cache/infersweep/wheels
# is the one thing a CI machine may keep from an earlier run: a green CI must not hide a build that no longer
# starts. Usage: cluster/check_llamacpp_build.sh PYTHON [SECONDS=600]
set -euo pipefail
PY=${1:?usage: $0 PYTHON [SECONDS]}
LIMIT=${2:-600}
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
log="$tmp/build.log"
pid=
trap '[ -n "$pid" ] && kill -- -"$pid" 2>/dev/null; rm -rf "$tmp"' EXIT
# the real interpreter and script, with an empty wheel cache and verbose pip (CMake's own lines), in a process
# group of its own so that the whole build tree can be stopped
set -m
# PIP_NO_CACHE_DIR: pip keeps the wheel it built in its own cache (~/.cache/pip/wheels) and would hand it back
# instead of building ("Using cached llama_cpp_python-...whl"): the check must see the build a new machine runs.
INFERSWEEP_WHEELS="$tmp/wheels" PIP_VERBOSE=1 PIP_NO_CACHE_DIR=1 "$here/install_llamacpp.sh" "$PY" >"$log" 2>&1 &
pid=$!
set +m
start=$(date +%s)
while kill -0 "$pid" 2>/dev/null; do
    if grep -q -- "-- Build files have been written to" "$log"; then
        echo "llama-cpp-python's build starts from an empty wheel cache: CMake configured it in $(( $(date +%s) - start )) s" \
             "($(grep -m1 -o -- '-- The CXX compiler identification is.*' "$log" | sed 's/^-- //'))"
        exit 0
    fi
    if (( $(date +%s) - start > LIMIT )); then
        echo "error: llama-cpp-python's build did not reach CMake's configure step within $LIMIT s; the end of its log:" >&2
        tail -30 "$log" >&2
        exit 1
    fi
    sleep 2
done
if grep -q "is already installed" "$log"; then
    echo "error: llama-cpp-python is installed in $PY: run this check before installing it" >&2
    exit 1
fi
echo "error: llama-cpp-python's build stopped before CMake configured it; the end of its log:" >&2
tail -30 "$log" >&2
exit 1
