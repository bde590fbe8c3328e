"""``python -m edmm``."""

import sys

from edmm.cli import main

sys.exit(main())
