#!/usr/bin/env bash
# Install miles-host and every plugin on the offline GPU machine: no network,
# no build isolation, no dependency resolution; wheels carried in .whl/ are installed too.
set -euo pipefail
cd "$(dirname "$0")/.."
editable=(-e .)
for plugin in plugins/*/; do editable+=(-e "$plugin"); done
python3 -m pip install -q --no-deps --no-build-isolation "${editable[@]}" 2>&1 | tail -3
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -3
fi
python3 -c "import torch, miles_host; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
