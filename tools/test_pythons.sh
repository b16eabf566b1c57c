#!/usr/bin/env bash
# The unit and adapter tiers under the oldest and the newest Python that pyproject.toml claims
# (3.10, 3.13; the main venv is the third) where this machine has them, each in its own venv
# (.venv-3.X): requires-python must be true, not hoped for. 3.12 lies between 3.11 and 3.13
# and costs CI four minutes (of its 30): FANFS_TEST_PYTHONS="3.10 3.12 3.13" adds it. An
# interpreter is found as python3.X on PATH, else in pyenv's versions. Versions this machine
# lacks are named, not hidden. PyTorch is not needed by these tiers.
set -euo pipefail
cd "$(dirname "$0")/.."
find_python() {
    local v=$1 cand
    for cand in "python$v" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$v".*/bin/"python$v"; do
        if "$cand" -c 'import sys' >/dev/null 2>&1; then
            command -v "$cand"
            return
        fi
    done
}
ran=()
for v in ${FANFS_TEST_PYTHONS:-3.10 3.13}; do
    py=$(find_python "$v")
    if [ -z "$py" ]; then
        echo "test-pythons: no Python $v on this machine"
        continue
    fi
    venv=.venv-$v
    [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip setuptools wheel
    "$venv/bin/python" tools/install_pyfuse3.py
    "$venv/bin/python" -m pip install -q -e . pytest pytest-timeout pytest-trio hypothesis
    echo "test-pythons: $("$venv/bin/python" --version)"
    # Only these tiers' folders: the others' files import what these venvs lack (PyTorch).
    "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "unit or adapter" tests/unit tests/adapter
    ran+=("$v")
done
echo "test-pythons: unit and adapter tiers passed under Python ${ran[*]:-(none but the main venv)}"
