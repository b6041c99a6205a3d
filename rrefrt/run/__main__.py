"""``python -m rrefrt.run ...``: the same as the ``rrefrt-run`` console script."""

import sys

from rrefrt.run.cli import main

if __name__ == "__main__":
    sys.exit(main())
