"""The workbook's notebooks, as the package ``mxlib.notebooks``.

pyproject.toml maps this folder onto ``mxlib.notebooks`` and ships its ``*.ipynb`` as package data, so an
installed mxlib finds them with ``importlib.resources.files("mxlib.notebooks")`` and ``python -m mxlib.workbook``
runs them from there. In a checkout they are the files of this folder; an editable install maps the package
onto it.
"""
