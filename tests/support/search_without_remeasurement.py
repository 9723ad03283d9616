"""``python -m autotune`` whose searches choose from their trials' own runs, measuring no contender again (what
:func:`tests.support.choice.no_remeasurement` does in process), for tests of a search in a process of its own whose
subject is something else (workers sharing a study, resume after a kill). Run as
``python tests/support/search_without_remeasurement.py search ...``."""

import sys

import autotune._search.choose
from autotune._cli.main import main

if __name__ == "__main__":
    autotune._search.choose.MAX_RIVALS = 0
    autotune._search.choose.EDGE_SHARE = 0.0
    sys.exit(main())
