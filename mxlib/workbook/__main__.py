"""``python -m mxlib.workbook``: run the workbook's notebooks (``mxlib.workbook.runner``).

Without the ``workbook`` extra it stops with one line naming the extra (exit code 1).
"""

import sys

try:
    from .runner import main
except ModuleNotFoundError as err:
    sys.exit(f"python -m mxlib.workbook: error: {err}")

if __name__ == "__main__":
    sys.exit(main())
