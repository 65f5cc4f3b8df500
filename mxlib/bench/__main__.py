"""``python -m mxlib.bench quant|moe``."""

import sys

from . import main

sys.exit(main())
