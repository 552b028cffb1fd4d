#!/usr/bin/env bash
# Start an MLflow server on the project's local store, bound to 127.0.0.1 (override with HOST/PORT).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$here/artifacts"
exec mlflow server --backend-store-uri "sqlite:///$here/mlflow.db" --default-artifact-root "file://$here/artifacts" \
  --host "${HOST:-127.0.0.1}" --port "${PORT:-5000}" --workers "${WORKERS:-1}"
