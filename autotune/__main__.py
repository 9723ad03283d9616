"""``python -m autotune``: the same command line as the ``autotune`` script."""

import sys

from autotune._cli.main import main

if __name__ == "__main__":
    sys.exit(main())
