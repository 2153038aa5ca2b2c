"""``python -m coalescence.cli``: the command line, as ``python -m coalescence``."""

import sys

from . import main

sys.exit(main())
