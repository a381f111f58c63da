#!/usr/bin/env bash
# Creates .venv and installs the package with its pinned dependencies the first
# time; afterwards it only compares a stamp, so it is quick and idempotent.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo_root/.venv"
stamp="$venv/.torchtitan_ext-installed"
want="$(sha256sum "$repo_root/pyproject.toml" | cut -d' ' -f1)"

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    exit 0
fi
python_bin="${PYTHON:-python3}"
[[ -x "$venv/bin/python" ]] || "$python_bin" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
"$venv/bin/python" -m pip install --quiet -e "$repo_root[test]" 2>&1 \
    | grep -v "^WARNING: Location" || true
"$venv/bin/python" -c "import torchtitan, torchvision, triton, tokenizers" \
    || { echo "bootstrap: dependencies failed to install" >&2; exit 1; }
echo "$want" > "$stamp"
