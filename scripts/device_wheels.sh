#!/usr/bin/env bash
# Download the pure-Python wheels the GPU machine lacks into .whl/ (git-ignored; a device call
# names it in `carry`, and scripts/device_install.sh installs what it finds there).
#   bash scripts/device_wheels.sh                  # megatron-core, flash-linear-attention (+ fla-core)
#   bash scripts/device_wheels.sh --transformers   # also this checkout's transformers and the hub it needs
# Versions are this machine's (.venv), so GPU tests compare against the same transformers as CPU
# tests: the device's own transformers 5.17 hard-codes gpt-oss's SwiGLU limit, crashes on gemma3n
# ids beyond its per-layer vocabulary and names DSA layers otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
packages=("megatron-core==$(version megatron-core)" "flash-linear-attention==0.6.0" "fla-core==0.6.0")
if [ "${1:-}" = "--transformers" ]; then
  packages+=("transformers==$(version transformers)" "huggingface-hub==$(version huggingface-hub)"
             "kernels==$(version kernels)" "tomlkit" "httpx2" "httpcore2" "truststore")
fi
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
mkdir -p .whl
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl "${packages[@]}" 2>&1 | grep -v "^WARNING: Location" || true
ls -la .whl
