#!/usr/bin/env bash
# make test-compat: the compat subset (tests/compat/subset.txt) in one fresh venv per combination.
#
#   floor   the oldest Python that pyproject.toml allows, and every dependency of the package and of
#           its [plot,recipes] extras at the lowest version it allows (uv's --resolution lowest-direct:
#           torch, Lightning, torchmetrics, omegaconf, safetensors, psutil, matplotlib, scikit-learn, pillow)
#   newest  the newest Python on this machine ($COMPAT_NEWEST_PYTHON) and the newest release of everything
#
# usage: tests/compat/run.sh [floor] [newest]        (both when none is named)
#
# Each venv is built from nothing by uv, whose cache ($UV_CACHE_DIR, ~/.cache/uv by default) keeps every
# downloaded wheel: PyPI's torch wheels come with their CUDA packages (about 3 GB to download per torch
# version, 5-6 GB installed); from the cache uv hard-links them into a new venv in seconds. A combination
# that passes has its venv removed; one that fails keeps it under $COMPAT_DIR for a look.
set -euo pipefail
cd "$(dirname "$0")/../.."

COMPAT_DIR=${COMPAT_DIR:-.compat}
COMPAT_NEWEST_PYTHON=${COMPAT_NEWEST_PYTHON:-3.13}
UV_VERSION=${UV_VERSION:-0.13.9}
export UV_CACHE_DIR=${UV_CACHE_DIR:-$HOME/.cache/uv}
export UV_PYTHON_DOWNLOADS=never UV_LINK_MODE=hardlink UV_NO_PROGRESS=1

python_for() {  # the interpreter of Python $1 ("3.10"): pyenv's newest patch release of it, else one on PATH
    local full
    if command -v pyenv >/dev/null; then
        full=$(pyenv versions --bare | grep -E "^${1//./\\.}\.[0-9]+$" | sort -V | tail -1 || true)
        if [ -n "$full" ]; then
            echo "$(pyenv prefix "$full")/bin/python$1"
            return
        fi
    fi
    command -v "python$1" || { echo "test-compat: no Python $1 here (pyenv install $1, or put python$1 on PATH)" >&2; exit 1; }
}

floor_python() {  # "3.10" from requires-python = ">=3.10"
    sed -nE 's/^requires-python = ">=([0-9]+\.[0-9]+)".*/\1/p' pyproject.toml
}

mkdir -p "$COMPAT_DIR"
UV="$COMPAT_DIR/uv-$UV_VERSION/bin/uv"
if [ ! -x "$UV" ]; then
    python3 -m venv "$COMPAT_DIR/uv-$UV_VERSION"
    "$COMPAT_DIR/uv-$UV_VERSION/bin/python" -m pip install -q "uv==$UV_VERSION"
fi

read -r -a SUBSET <<<"$(grep -vE '^\s*(#|$)' tests/compat/subset.txt | tr '\n' ' ')"
SUMMARY=()
FAILED=0

run_combination() {  # NAME PYTHON RESOLUTION
    local name=$1 python=$2 resolution=$3 venv="$COMPAT_DIR/$1" start built versions status
    start=$(date +%s)
    rm -rf "$venv"
    "$UV" venv -q --python "$python" "$venv"
    "$UV" pip install -q --python "$venv/bin/python" --resolution "$resolution" -e ".[plot,recipes]"
    "$UV" pip install -q --python "$venv/bin/python" "pytest>=8" "pytest-timeout>=2.2"  # test tools: newest
    built=$(($(date +%s) - start))
    versions=$("$venv/bin/python" -c '
import platform, importlib.metadata as m
names = ["torch", "lightning", "torchmetrics", "omegaconf", "safetensors", "psutil", "numpy"]
print(f"Python {platform.python_version()}", *(f"{n} {m.version(n)}" for n in names), sep=", ")')
    echo "== test-compat $name: $versions (venv built in ${built}s)"
    start=$(date +%s)
    if "$venv/bin/python" -m pytest -p no:cacheprovider -q --disable-warnings "${SUBSET[@]}"; then
        status=passed
        rm -rf "$venv"
    else
        status="FAILED (venv kept in $venv)"
        FAILED=1
    fi
    SUMMARY+=("$name: $versions; venv ${built}s, subset $(($(date +%s) - start))s: $status")
}

for combination in "${@:-floor newest}"; do
    for name in $combination; do
        case $name in
            floor) run_combination floor "$(python_for "$(floor_python)")" lowest-direct ;;
            newest) run_combination newest "$(python_for "$COMPAT_NEWEST_PYTHON")" highest ;;
            *) echo "test-compat: unknown combination '$name' (floor, newest)" >&2; exit 2 ;;
        esac
    done
done

echo "== test-compat summary"
printf '  %s\n' "${SUMMARY[@]}"
exit $FAILED
