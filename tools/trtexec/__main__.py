"""``python -m tools.trtexec``: see cli.py."""

import sys

from .cli import main

sys.exit(main())
