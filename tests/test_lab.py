"""``make lab``: ``tools/lab.sh`` (the script the Makefile runs) starts JupyterLab headless, as root too,
on the chosen address; it answers ``/lab`` and serves the notebooks through the contents API with its
token; a save writes the notebook without outputs; SIGTERM stops it cleanly.

The server runs on a copy of ``notebooks/`` in a temporary folder (the test saves a notebook there),
with Jupyter's runtime, data, configuration and workspace folders there too, on a free port of
127.0.0.1. The oracle of the save: a notebook given outputs, execution counts and run metadata is
written back as the tracked notebook, byte for byte (the tracked notebooks are stored stripped, as
``make lint`` verifies).
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("jupyterlab")
pytest.importorskip("nbstripout")

pytestmark = pytest.mark.notebook

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = "02_microscaling_formats.ipynb"
START_TIMEOUT_S = 240  # a cold JupyterLab start takes 5 to 30 s on a loaded 2-core machine
REFUSED_RETRY_S = 20  # how long a running server may refuse connections before the test fails
STOP_TIMEOUT_S = 60
URL = re.compile(r"(http://127\.0\.0\.1:(\d+)/lab)\?token=([0-9a-f]+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    def __init__(self, tmp: Path):
        self.root = tmp / "notebooks"
        shutil.copytree(ROOT / "notebooks", self.root, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        self.runtime = tmp / "runtime"
        self.port = _free_port()
        env = dict(
            os.environ,
            LAB_IP="127.0.0.1",
            LAB_PORT=str(self.port),
            JUPYTER_RUNTIME_DIR=str(self.runtime),
            JUPYTER_DATA_DIR=str(tmp / "data"),
            JUPYTER_CONFIG_DIR=str(tmp / "config"),
            JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
            JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
        )
        self.proc = subprocess.Popen(
            ["sh", "tools/lab.sh", sys.executable, str(self.root)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.url, self.token = self._wait_for_url()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def output(self) -> str:
        return "".join(self.lines)

    def _wait_for_url(self):
        end = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < end:
            m = URL.search(self.output())
            if m:
                return m.group(1), m.group(3)
            if self.proc.poll() is not None:
                time.sleep(0.5)  # the rest of its output
                pytest.fail(f"tools/lab.sh exited with {self.proc.returncode} before serving:\n{self.output()}")
            time.sleep(0.2)
        pytest.fail(f"no URL with a token within {START_TIMEOUT_S} s:\n{self.output()}")

    def request(self, path: str, method: str = "GET", body=None, token: bool = True):
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"token {self.token}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method, headers=headers)
        end = time.monotonic() + REFUSED_RETRY_S
        while True:
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as err:
                return err.code, err.read().decode()
            except urllib.error.URLError as err:
                # refused: say whether the server is gone (and what it printed) rather than only that it refused;
                # a server still running gets a few seconds (a machine under load schedules it late)
                if self.proc.poll() is not None:
                    pytest.fail(f"the server exited with {self.proc.returncode} before {path}:\n{self.output()}")
                if not isinstance(err.reason, ConnectionRefusedError) or time.monotonic() > end:
                    raise AssertionError(f"{path}: {err.reason}; the server printed:\n{self.output()}") from err
                time.sleep(0.5)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT_S)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    server = Lab(tmp_path_factory.mktemp("lab"))
    try:
        yield server
    finally:
        server.stop()


def test_it_runs_headless_on_the_chosen_address_as_this_user(lab):
    argv = Path(f"/proc/{lab.proc.pid}/cmdline").read_bytes().split(b"\0")  # sh exec'd into the server
    assert b"--no-browser" in argv, argv
    assert f"--port={lab.port}".encode() in argv and b"--ip=127.0.0.1" in argv, argv
    assert (b"--allow-root" in argv) == (os.getuid() == 0), (os.getuid(), argv)
    assert lab.url == f"http://127.0.0.1:{lab.port}/lab"  # printed with its token


def test_lab_page_answers(lab):
    status, page = lab.request("/lab")
    assert status == 200, (status, page[:500])
    assert "<title>JupyterLab</title>" in page, page[:500]


def test_contents_need_the_token_and_serve_the_notebooks(lab):
    assert lab.request("/api/contents", token=False)[0] == 403
    status, body = lab.request("/api/contents")
    assert status == 200, body
    listed = sorted(item["name"] for item in json.loads(body)["content"])
    assert listed == sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb")), listed  # __init__.py hidden
    status, body = lab.request(f"/api/contents/{NOTEBOOK}?content=1&type=notebook")
    assert status == 200, body
    served = json.loads(body)["content"]
    tracked = json.loads((ROOT / "notebooks" / NOTEBOOK).read_text())
    assert [c["source"] for c in served["cells"]] == ["".join(c["source"]) for c in tracked["cells"]]
    assert [c["id"] for c in served["cells"]] == [c["id"] for c in tracked["cells"]]


def test_a_save_writes_the_notebook_without_outputs(lab):
    tracked = (ROOT / "notebooks" / NOTEBOOK).read_text()
    nb = json.loads(tracked)
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    for i, cell in enumerate(code, start=1):
        cell["execution_count"] = i
        cell["outputs"] = [
            {"output_type": "stream", "name": "stdout", "text": f"cell {i}\n"},
            {"output_type": "execute_result", "execution_count": i, "data": {"text/plain": "1"}, "metadata": {}},
        ]
        cell["metadata"]["execution"] = {"iopub.execute_input": "2000-01-01T00:00:00.000000Z"}
        cell["metadata"]["scrolled"] = True
    nb["metadata"]["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    status, body = lab.request(
        "/api/contents/saved.ipynb", "PUT", {"type": "notebook", "format": "json", "content": nb}
    )
    assert status in (200, 201), body
    saved = (lab.root / "saved.ipynb").read_text()
    assert saved == tracked  # stripped back to the stored form, cell ids kept


def test_sigterm_stops_it_cleanly(lab):
    assert list(lab.runtime.glob("jpserver-*.json")), "no server file while it runs"
    lab.proc.send_signal(signal.SIGTERM)
    rc = lab.proc.wait(STOP_TIMEOUT_S)
    time.sleep(0.5)  # the reader thread's last lines
    assert rc == 0, (rc, lab.output()[-3000:])
    assert list(lab.runtime.glob("jpserver-*.json")) == [], "the server left its server file: not a clean stop"
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", lab.port), timeout=5):
        pass
