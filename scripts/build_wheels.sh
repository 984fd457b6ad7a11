#!/usr/bin/env bash
# Build a wheel for every distribution this repository publishes: areal-core, each first-party plugin
# (plugins/*/*) and the meta-distribution areal-rl (meta/), into dist/ (DIST=folder to choose).
#
#   bash scripts/build_wheels.sh                 # dist/*.whl, with the .venv's hatchling
#   bash scripts/build_wheels.sh --check-names   # also ask the package index whether each name is taken
#
# Then, on any machine with the same Python:
#   pip install --find-links dist 'areal-rl'            # the core and every CPU plugin (the demo runs)
#   pip install --find-links dist 'areal-rl[vllm,ray]'  # plus the vLLM and Ray plugins; [all] for every one
# The wheels are pure Python (py3-none-any). None of these names is on the package index yet: until they are
# published (.github/workflows/release.yml), install from these wheels or from a checkout (scripts/install.sh).
#
# The wheels are built without build isolation, by the hatchling in the venv (AREAL_VENV, default .venv),
# so building needs no network. An earlier build's areal wheels in the folder are replaced, never mixed.
set -euo pipefail
cd "$(dirname "$0")/.."

check_names=0
for arg in "$@"; do
    case "$arg" in
        --check-names) check_names=1 ;;
        *) echo "build_wheels: unknown argument '$arg'; the only option is --check-names" >&2; exit 2 ;;
    esac
done

PY=${AREAL_VENV:-.venv}/bin/python
DIST=${DIST:-dist}
if [ ! -x "$PY" ]; then
    echo "build_wheels: no Python at $PY; run scripts/install.sh first (or set AREAL_VENV)" >&2
    exit 1
fi
if ! "$PY" -c "import hatchling" 2>/dev/null; then
    echo "build_wheels: hatchling is not installed in $PY's environment; Fix: $PY -m pip install 'hatchling>=1.21'" >&2
    exit 1
fi

projects=(./ ./meta)  # paths written with ./ so pip never takes "meta" for a name on the index
for project in plugins/*/*/pyproject.toml; do
    case "$project" in plugins/_template/*) continue ;; esac  # the template is copied, never published
    projects+=("./$(dirname "$project")")
done

mkdir -p "$DIST"
rm -f "$DIST"/areal_core-*.whl "$DIST"/areal_plugin_*.whl "$DIST"/areal_rl-*.whl
# One pip call: pip builds each project in a temporary folder of its own, so nothing is left in the sources.
"$PY" -m pip --disable-pip-version-check -q wheel --no-deps --no-build-isolation -w "$DIST" "${projects[@]}"
count=$( (ls "$DIST"/areal_core-*.whl "$DIST"/areal_plugin_*.whl "$DIST"/areal_rl-*.whl 2>/dev/null || true) | wc -l)
if [ "$count" -ne "${#projects[@]}" ]; then
    echo "build_wheels: expected ${#projects[@]} wheels in $DIST, found $count" >&2
    exit 1
fi
echo "build_wheels: $count wheels in $DIST/"

if [ $check_names -eq 1 ]; then
    # a control: `areal` is another project's name on the index, so an index that does not answer it is not reached
    if ! "$PY" -m pip --disable-pip-version-check index versions areal >/dev/null 2>&1; then
        echo "build_wheels: the package index did not answer for 'areal' (another project's name): not reached, so no name was checked" >&2
        exit 1
    fi
    taken=0
    for project in "${projects[@]}"; do
        name=$("$PY" -c "import sys, tomllib; print(tomllib.load(open(sys.argv[1], 'rb'))['project']['name'])" \
            "$project/pyproject.toml")
        if answer=$("$PY" -m pip --disable-pip-version-check index versions "$name" 2>/dev/null); then
            echo "build_wheels: $name is TAKEN on the index: $(echo "$answer" | head -n 1)"
            taken=1
        else
            echo "build_wheels: $name is free on the index"
        fi
    done
    exit $taken
fi
