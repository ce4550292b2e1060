"""`python -m swaprl COMMAND ...`: the same as the `swaprl` command (see swaprl.cli)."""

import sys

from .cli import main

sys.exit(main())
