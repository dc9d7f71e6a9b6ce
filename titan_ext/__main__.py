"""``python -m titan_ext``: the ``titan-ext`` command line (:mod:`titan_ext.cli`)."""

import sys

from titan_ext.cli import main

if __name__ == "__main__":
    sys.exit(main())
