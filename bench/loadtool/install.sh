#!/usr/bin/env bash
# Install the field's load tool, kubernetes-sigs inference-perf, into a throwaway virtual
# environment under the tool cache (bench/README.md, "Router under inference-perf").
# inference-perf needs Python >= 3.12 (its package metadata); PYTHON picks the interpreter.
# Prints the path of the environment's inference-perf executable.
set -euo pipefail
VERSION="${INFERENCE_PERF_VERSION:-0.7.0}"
# The first Python >= 3.12 found: PYTHON, then python3.12 and python3.13 on the PATH, then
# pyenv's installed versions.
find_python() {
  local candidate
  for candidate in "${PYTHON:-}" python3.12 python3.13 \
      "$HOME"/.pyenv/versions/3.12*/bin/python "$HOME"/.pyenv/versions/3.13*/bin/python; do
    [[ -n "$candidate" ]] || continue
    if "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  echo "install.sh: inference-perf needs Python >= 3.12; none found (set PYTHON)" >&2
  return 1
}
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/sessionfleet/loadtool"
ENV="$CACHE/inference-perf-$VERSION"
# The marker is written last, so an install cut short is started again, not used.
if [[ ! -f "$ENV/.installed" ]]; then
  PYTHON="$(find_python)"
  mkdir -p "$CACHE"
  rm -rf "$ENV"
  "$PYTHON" -m venv "$ENV"
  "$ENV/bin/pip" install --quiet --disable-pip-version-check "inference-perf==$VERSION" >&2
  touch "$ENV/.installed"
fi
echo "$ENV/bin/inference-perf"
