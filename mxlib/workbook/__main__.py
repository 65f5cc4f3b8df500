"""``python -m mxlib.workbook``: run the workbook's notebooks (``mxlib.workbook.runner``)."""

import sys

from .runner import main

sys.exit(main())
