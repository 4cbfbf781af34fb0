"""``python -m tools.bench``: see cli.py."""

import sys

from .cli import main

sys.exit(main())
