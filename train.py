"""slime-compatible entry point: ``python train.py --flags ...`` is ``miles run --flags ...``."""

import sys

from miles_host.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
