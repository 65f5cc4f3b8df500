"""JupyterLab configuration of ``make lab`` (``tools/lab.sh`` passes it with ``--config``).

Every notebook is passed through ``nbstripout --keep-id`` before the server writes it (a pre-save hook of the
contents manager): outputs, execution counts and run metadata are dropped, cell ids kept, exactly the form
``make lint`` verifies. The open notebook keeps showing its outputs until it is closed; ``make workbook`` writes
executed copies with their outputs under ``build/workbook``. A notebook that nbstripout cannot read is not
saved: the save fails with nbstripout's message, so no save writes outputs into the folder.

``__init__.py`` (the file that makes ``notebooks/`` the package ``mxlib.notebooks``) is hidden from the file
browser.
"""

import json
import subprocess
import sys
import warnings

from tornado.web import HTTPError

c = get_config()  # noqa: F821 (traitlets defines it when it runs a configuration file)

STRIP_TIMEOUT_S = 60


def strip_outputs_before_save(model, path, contents_manager, **kwargs):
    """Replace ``model["content"]`` (a notebook as a dict) by what ``nbstripout --keep-id`` makes of it.

    Runs nbstripout itself (its command line, in the server's Python) so that the result is the same as
    ``nbstripout --keep-id --verify`` expects. Raises ``tornado.web.HTTPError`` (500) naming the notebook
    when nbstripout fails, which rejects the save."""
    if model.get("type") != "notebook" or model.get("content") is None:
        return
    done = subprocess.run(
        [sys.executable, "-m", "nbstripout", "--keep-id"],
        input=json.dumps(model["content"]),
        capture_output=True,
        text=True,
        timeout=STRIP_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise HTTPError(500, f"{path} not saved: nbstripout --keep-id failed: {done.stderr.strip()}")
    model["content"] = json.loads(done.stdout)


# JupyterLab applies this file to its contents manager twice (as the server's and as the extension's
# configuration); the second assignment of the same hook is no override
warnings.filterwarnings("ignore", message="Overriding existing pre_save_hook", category=UserWarning)
c.ContentsManager.pre_save_hook = strip_outputs_before_save
c.ContentsManager.hide_globs.append("__init__.py")  # added to the default list
