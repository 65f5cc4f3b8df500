#!/usr/bin/env bash
# mxlib installed the way a practitioner installs it: a fresh venv, the CPU torch of the Makefile, `pip install .`
# (the wheel, no extras), torchao beside it, then the workbook extra for a notebook run from outside the checkout.
# Not part of `make test`: it takes minutes and reads the package index.
#
#   bash tools/check_install.sh [WORKDIR]       WORKDIR (default: a new temporary folder) holds the venv and the run
#
# Checks, each timed:
#   - the lean install (torch, then `pip install .`) holds no jupyter*, papermill, nbval, nbconvert, ipykernel,
#     ipywidgets or pytest;
#   - `mxlib --help` (the console script) answers, its second call in under HELP_LIMIT_S seconds (default 1);
#   - `python -m mxlib.workbook` without the workbook extra stops with one line naming it;
#   - `pip install torchao` beside it leaves torch as it was, `pip check` passes, and one process imports both and
#     quantizes a tensor with mxlib;
#   - with `pip install '.[workbook]'`, `python -m mxlib.workbook --only 02 --out DIR`, run in WORKDIR (outside the
#     checkout), writes DIR/02_microscaling_formats.ipynb with every code cell run, and writes nothing into
#     site-packages.
# Prints the times and package counts, and exits 1 when any check failed (each failure is named).
# Environment: PYTHON (default python3), TORCH_SPEC (default torch==2.13.0, as the Makefile), HELP_LIMIT_S.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
HELP_LIMIT_S=${HELP_LIMIT_S:-1}
WORK=${1:-$(mktemp -d /tmp/mxlib-install-XXXXXX)}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
case "$WORK/" in
"$ROOT"/*)
    echo "check_install.sh: WORKDIR: expected a folder outside the checkout $ROOT, got $WORK" >&2
    exit 2
    ;;
esac
VENV=$WORK/venv
PY=$VENV/bin/python
LOG=$WORK/log
mkdir -p "$LOG"
failures=()
summary=()

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
fail() {
    failures+=("$1")
    echo "FAILED: $1" >&2
}
# step NAME COMMAND...: run COMMAND (output in $LOG/NAME.log), record its time; a failure is recorded and named
step() {
    local name=$1
    shift
    local t0
    t0=$(now)
    echo "== $name" >&2
    if "$@" >"$LOG/$name.log" 2>&1; then
        summary+=("$(printf '%-28s %8s s' "$name" "$(since "$t0")")")
        return 0
    fi
    summary+=("$(printf '%-28s %8s s  FAILED (%s)' "$name" "$(since "$t0")" "$LOG/$name.log")")
    fail "$name (see $LOG/$name.log)"
    tail -20 "$LOG/$name.log" >&2
    return 1
}
packages() { "$PY" -m pip list --format=freeze 2>/dev/null | grep -vc '^pip=='; }
# the installed distributions that belong in an extra, never in the lean install
extra_only() {
    "$PY" -m pip list --format=freeze 2>/dev/null | cut -d= -f1 | tr 'A-Z_' 'a-z-' |
        grep -E '^(jupyter.*|papermill|nbval|nbconvert|ipykernel|ipywidgets|pytest.*)$'
}

cd "$WORK" || exit 2
step venv "$PYTHON" -m venv "$VENV" || { echo "no venv, nothing else to check" >&2; exit 1; }
step pip-upgrade "$PY" -m pip install -q --upgrade pip
step torch "$PY" -m pip install -q "$TORCH_SPEC"
torch_version=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null)
step mxlib-wheel "$PY" -m pip install -q "$ROOT"
lean_count=$(packages)
lean_size=$(du -sm "$VENV" | cut -f1)
lean_extra=$(extra_only)
[ -z "$lean_extra" ] || fail "the lean install holds $(echo "$lean_extra" | tr '\n' ' ')"

# twice: the first call also writes the bytecode caches; the limit holds for the second
for call in first second; do
    t0=$(now)
    if "$VENV/bin/mxlib" --help >"$LOG/mxlib-help-$call.log" 2>&1; then
        help_s=$(since "$t0")
        summary+=("$(printf '%-28s %8s s' "mxlib --help ($call)" "$help_s")")
    else
        fail "mxlib --help (see $LOG/mxlib-help-$call.log)"
        help_s=
        break
    fi
done
if [ -n "$help_s" ]; then
    awk -v s="$help_s" -v lim="$HELP_LIMIT_S" 'BEGIN { exit !(s < lim) }' ||
        fail "mxlib --help took $help_s s on its second call (limit $HELP_LIMIT_S s)"
fi

if "$PY" -m mxlib.workbook --only 02 --out "$WORK/none" >"$LOG/workbook-lean.log" 2>&1; then
    fail "python -m mxlib.workbook ran without the workbook extra"
elif ! grep -q "mxlib\[workbook\]" "$LOG/workbook-lean.log" || [ "$(wc -l <"$LOG/workbook-lean.log")" -ne 1 ]; then
    fail "python -m mxlib.workbook without the extra: expected one line naming mxlib[workbook] ($LOG/workbook-lean.log)"
fi

if step torchao "$PY" -m pip install -q torchao; then
    after=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null)
    [ "$after" = "$torch_version" ] || fail "pip install torchao changed torch from $torch_version to $after"
    step pip-check "$PY" -m pip check
    step torchao-beside-mxlib "$PY" -c "
import torch, torchao, mxlib
from mxlib.reference import quantize_mx
out = quantize_mx(torch.randn(4, 64))
print('torch', torch.__version__, 'torchao', torchao.__version__, 'mxlib', mxlib.__version__, [tuple(t.shape) for t in out])
"
fi
torchao_count=$(packages)

step mxlib-workbook-extra "$PY" -m pip install -q "$ROOT[workbook]"
workbook_count=$(packages)
workbook_size=$(du -sm "$VENV" | cut -f1)
site=$("$PY" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
touch "$WORK/before-workbook"
if step workbook-02 env -u MXLIB_CACHE -u PYTHONPATH XDG_CACHE_HOME="$WORK/cache" \
    "$PY" -m mxlib.workbook --only 02 --out "$WORK/executed"; then
    "$PY" - "$WORK/executed/02_microscaling_formats.ipynb" <<'EOF' || fail "the executed notebook 02 is incomplete"
import json, sys
nb = json.load(open(sys.argv[1]))
code = [c for c in nb["cells"] if c["cell_type"] == "code"]
assert code and all(c["execution_count"] is not None for c in code), "a code cell did not run"
print(f"{sys.argv[1]}: {len(code)} code cells run")
EOF
    written=$(find "$site" -newer "$WORK/before-workbook" -type f -not -path '*/__pycache__/*' | head)
    [ -z "$written" ] || fail "the workbook run wrote into site-packages: $written"
fi

echo
echo "mxlib install check in $WORK (torch $torch_version)"
printf '%s\n' "${summary[@]}"
echo "packages: lean $lean_count (${lean_size} MB), with torchao $torchao_count, with the workbook extra $workbook_count (${workbook_size} MB)"
if [ ${#failures[@]} -gt 0 ]; then
    printf 'FAILED: %s\n' "${failures[@]}"
    exit 1
fi
echo "all checks passed"
