"""``python -m evenkv``: see ``evenkv.cli``."""

import sys

from .cli import main

sys.exit(main())
