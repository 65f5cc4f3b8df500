"""``python -m mxlib.cli``: the ``mxlib`` command (``mxlib.cli.main``)."""

import sys

from . import main

sys.exit(main())
