"""``python -m edmm``."""

import sys

from edmm.cli import main

if __name__ == "__main__":  # spawned tensor-parallel ranks import this module too
    sys.exit(main())
