"""``python -m edmm.server [options]``: the same as ``edmm serve [options]``."""

import sys

from edmm.server.cli import main

sys.exit(main())
