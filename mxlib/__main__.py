"""``python -m mxlib``: the ``mxlib`` command (``mxlib.cli.main``)."""

import sys

from .cli import main

sys.exit(main())
