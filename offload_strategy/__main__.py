"""``python -m offload_strategy``: the ``offload-strategy`` command."""

import sys

from .cli import main

sys.exit(main())
