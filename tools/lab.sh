#!/bin/sh
# JupyterLab on a folder of notebooks, the way `make lab` starts it (tests/test_lab.py starts this script too):
#
#   sh tools/lab.sh PYTHON FOLDER        make lab: .venv/bin/python notebooks
#
# - headless: no browser is opened; JupyterLab prints the URL with its token (http://IP:PORT/lab?token=...);
# - on LAB_IP (default 127.0.0.1; 0.0.0.0 to be reached from outside a container) and LAB_PORT (default 8888);
#   a port in use is an error, no other port is tried;
# - as root too: --allow-root is added when the user id is 0, and only then;
# - notebooks are saved without outputs: tools/jupyter_lab_config.py passes each notebook through
#   `nbstripout --keep-id` before it is written, so a save leaves a tracked notebook as `make lint` wants it.
# Needs jupyterlab (the workbook extra) and nbstripout (the lint extra) in PYTHON's environment.
set -eu
if [ $# -ne 2 ]; then
    echo "usage: sh tools/lab.sh PYTHON FOLDER (e.g. .venv/bin/python notebooks)" >&2
    exit 2
fi
python=$1
root=$2
if [ ! -d "$root" ]; then
    echo "tools/lab.sh: FOLDER: expected a folder of notebooks, got '$root' (not a folder)" >&2
    exit 2
fi
if ! "$python" -c "import jupyterlab, nbstripout" 2>/dev/null; then
    echo "tools/lab.sh: PYTHON: expected a Python with jupyterlab and nbstripout, got '$python'" \
        "(pip install -e '.[workbook,lint]'; make lab installs them)" >&2
    exit 2
fi
set -- --no-browser \
    --ip="${LAB_IP:-127.0.0.1}" \
    --port="${LAB_PORT:-8888}" \
    --ServerApp.port_retries=0 \
    --ServerApp.root_dir="$root" \
    --config="$(cd "$(dirname "$0")" && pwd)/jupyter_lab_config.py"
if [ "$(id -u)" -eq 0 ]; then
    set -- "$@" --allow-root
fi
echo "tools/lab.sh: JupyterLab on $root at http://${LAB_IP:-127.0.0.1}:${LAB_PORT:-8888}/lab (the URL with the token follows)" >&2
exec "$python" -m jupyterlab "$@"
