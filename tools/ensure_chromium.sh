#!/bin/sh
# Make sure a headless Chromium is available for tests/test_render.py (Debian package `chromium`).
# Idempotent and quiet when it is already installed; installs with apt-get otherwise (needs root).
# Prints nothing and exits 0 when chromium is on PATH.
set -e
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_chromium: chromium not found and apt-get is not available; install Chromium by hand" >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
        echo "ensure_chromium: chromium not found; run as root: apt-get install -y chromium" >&2
        exit 1
    fi
fi
echo "ensure_chromium: installing the Debian package chromium" >&2
$SUDO apt-get update -q >/dev/null
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium >/dev/null
command -v chromium >/dev/null 2>&1
