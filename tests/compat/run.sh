#!/usr/bin/env bash
# make test-compat: the compat subset (tests/compat/subset.txt) in one fresh venv per combination.
#
#   floor     the oldest Python that pyproject.toml allows, and every dependency of the package and of
#             its [plot,recipes] extras at the lowest version it allows (uv's --resolution lowest-direct:
#             torch, Lightning, torchmetrics, omegaconf, safetensors, psutil, matplotlib, scikit-learn, pillow)
#   gloo-sum  the floor, but torch $COMPAT_GLOO_SUM_TORCH: gloo's reduce-scatter sums when asked to average
#             (pytorch/pytorch#162338) and mgpu_fsdp corrects it; FSDP2 runs on CPU from torch 2.7, so
#             mgpu_fsdp's fits are checked here rather than on the floor's torch
#   newest    the newest Python on this machine ($COMPAT_NEWEST_PYTHON) and the newest release of everything
#
# usage: tests/compat/run.sh [floor] [gloo-sum] [newest]        (all three when none is named)
#
# Each line of subset.txt names the combinations that run it. Each venv is built from nothing by uv, whose
# cache ($UV_CACHE_DIR, ~/.cache/uv by default) keeps every downloaded wheel: PyPI's torch wheels come with
# their CUDA packages (about 3 GB to download per torch version, 5-6 GB installed); from the cache uv
# hard-links them into a new venv in seconds. A combination that passes has its venv removed; one that
# fails keeps it under $COMPAT_DIR for a look.
set -euo pipefail
cd "$(dirname "$0")/../.."

COMPAT_DIR=${COMPAT_DIR:-.compat}
COMPAT_NEWEST_PYTHON=${COMPAT_NEWEST_PYTHON:-3.13}
COMPAT_GLOO_SUM_TORCH=${COMPAT_GLOO_SUM_TORCH:-2.8.0}
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

NAMES=()
for combination in "${@:-floor gloo-sum newest}"; do
    for name in $combination; do
        case $name in
            floor | gloo-sum | newest) NAMES+=("$name") ;;
            *) echo "test-compat: unknown combination '$name' (floor, gloo-sum, newest)" >&2; exit 2 ;;
        esac
    done
done

mkdir -p "$COMPAT_DIR"
UV="$COMPAT_DIR/uv-$UV_VERSION/bin/uv"
if [ ! -x "$UV" ]; then
    python3 -m venv "$COMPAT_DIR/uv-$UV_VERSION"
    "$COMPAT_DIR/uv-$UV_VERSION/bin/python" -m pip install -q "uv==$UV_VERSION"
fi

subset_for() {  # the test ids of subset.txt's lines that name combination $1 (the last word is the test)
    grep -vE '^\s*(#|$)' tests/compat/subset.txt | awk -v name="$1" '{for (i = 1; i < NF; i++) if ($i == name) print $NF}'
}
build_venv() {  # NAME: its venv from nothing; the seconds it took go to $COMPAT_DIR/NAME.built
    local name=$1 venv="$COMPAT_DIR/$1" start python resolution pins=()
    start=$(date +%s)
    case $name in
        floor) python=$(python_for "$(floor_python)") resolution=lowest-direct ;;
        gloo-sum) python=$(python_for "$(floor_python)") resolution=lowest-direct pins=("torch==$COMPAT_GLOO_SUM_TORCH") ;;
        newest) python=$(python_for "$COMPAT_NEWEST_PYTHON") resolution=highest ;;
    esac
    [ -n "$python" ] || return 1
    rm -rf "$venv"
    "$UV" venv -q --seed --python "$python" "$venv" || return 1  # --seed: pip, for test_pip_keeps_torch.py
    "$UV" pip install -q --python "$venv/bin/python" --resolution "$resolution" -e ".[plot,recipes]" "${pins[@]}" ||
        return 1
    # test tools: newest; setuptools for pip's offline --no-build-isolation check of this project
    "$UV" pip install -q --python "$venv/bin/python" "pytest>=8" "pytest-timeout>=2.2" "pytest-xdist>=3.5" \
        "setuptools>=77" || return 1
    echo $(($(date +%s) - start)) >"$venv.built"
}

# The venvs are built one after another in the background, so that the next ones download while the
# first one's tests run (an empty uv cache downloads about 3 GB per torch version).
rm -f "$COMPAT_DIR"/*.built
(
    for name in "${NAMES[@]}"; do
        build_venv "$name" >"$COMPAT_DIR/$name.build.log" 2>&1 || echo failed >"$COMPAT_DIR/$name.built"
    done
) &
BUILDER=$!
trap 'kill $BUILDER 2>/dev/null || true' EXIT

SUMMARY=()
FAILED=0

run_combination() {  # NAME: wait for its venv, then run its lines of the subset in it
    local name=$1 venv="$COMPAT_DIR/$1" start built versions status subset
    while [ ! -s "$venv.built" ]; do sleep 1; done
    built=$(cat "$venv.built")
    if [ "$built" = failed ]; then
        cat "$venv.build.log"
        SUMMARY+=("$name: venv build FAILED ($venv.build.log)")
        FAILED=1
        return
    fi
    versions=$("$venv/bin/python" -c '
import platform, importlib.metadata as m
names = ["torch", "lightning", "torchmetrics", "omegaconf", "safetensors", "psutil", "numpy"]
print(f"Python {platform.python_version()}", *(f"{n} {m.version(n)}" for n in names), sep=", ")')
    echo "== test-compat $name: $versions (venv built in ${built}s)"
    start=$(date +%s)
    read -r -a subset <<<"$(subset_for "$name" | tr '\n' ' ')"
    # two workers, a file each, as make test runs them
    if "$venv/bin/python" -m pytest -p no:cacheprovider -q --disable-warnings -n 2 --dist loadfile "${subset[@]}"; then
        status=passed
        rm -rf "$venv"
    else
        status="FAILED (venv kept in $venv)"
        FAILED=1
    fi
    SUMMARY+=("$name: $versions; venv ${built}s, subset $(($(date +%s) - start))s: $status")
}

for name in "${NAMES[@]}"; do
    run_combination "$name"
done
wait $BUILDER

echo "== test-compat summary"
printf '  %s\n' "${SUMMARY[@]}"
exit $FAILED
