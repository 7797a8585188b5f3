#!/usr/bin/env bash
# Create .venv and install miles-host, every plugin in plugins/ and the test tools.
# Idempotent: a stamp keyed on the packaging files skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=".venv/.miles-setup-$(cat pyproject.toml plugins/*/pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  python -m pip install -q --disable-pip-version-check --upgrade pip setuptools wheel
  if ! python -c "import torch, sys; sys.exit(0 if tuple(map(int, torch.__version__.split('+')[0].split('.')[:2])) >= (2, 11) else 1)" 2>/dev/null; then
    # Pin torch first: an unpinned torch pulls a multi-GB CUDA build. 2.13.0 is a CPU build here.
    python -m pip install -q --disable-pip-version-check "torch==2.13.0"
  fi
  editable=(-e ".[test,plot,math]")
  for plugin in plugins/*/; do
    editable+=(-e "$plugin")
  done
  python -m pip install -q --disable-pip-version-check "${editable[@]}"
  rm -f .venv/.miles-setup-*
  touch "$stamp"
fi
# Chromium for the dashboard's browser test (tests/dashboard/test_dashboard_browser.py drives it
# through playwright's Python package; playwright's own browser downloads are never used).
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; } \
    || echo "setup.sh: could not install chromium; the dashboard's browser test will be skipped" >&2
fi
