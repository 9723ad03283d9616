"""``python -m autotune`` whose searches choose from their trials' own runs, measuring no contender again (what
:func:`tests.support.choice.no_remeasurement` does in process), for tests of a search in a process of its own whose
subject is something else (workers sharing a study, resume after a kill). Run as
``python tests/support/search_without_remeasurement.py search ...``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import autotune._search.choose  # noqa: E402
from autotune._cli.main import main  # noqa: E402
from tests.support.choice import NO_REMEASUREMENT  # noqa: E402

if __name__ == "__main__":
    for name, value in NO_REMEASUREMENT.items():
        setattr(autotune._search.choose, name, value)
    sys.exit(main())
