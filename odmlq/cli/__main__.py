"""``python -m odmlq.cli``: the `odmlq` command."""

import sys

from odmlq.cli._main import main

sys.exit(main())
