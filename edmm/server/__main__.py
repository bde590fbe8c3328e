"""``python -m edmm.server [options]``: the same as ``edmm serve [options]``."""

import sys

from edmm.server.cli import main

if __name__ == "__main__":  # spawned tensor-parallel ranks import this module too
    sys.exit(main())
