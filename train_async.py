"""slime-compatible entry point: ``python train_async.py --flags ...`` is ``miles run --fully-async --flags ...``."""

import sys

from miles_host.cli.main import main

if __name__ == "__main__":
    flags = sys.argv[1:]
    sys.exit(main(["run", *([] if "--fully-async" in flags else ["--fully-async"]), *flags]))
