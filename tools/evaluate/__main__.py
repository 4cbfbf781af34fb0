"""``python -m tools.evaluate``: see cli.py."""

import sys

from .cli import main

sys.exit(main())
