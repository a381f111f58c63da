#!/usr/bin/env bash
# Run the whole test suite; creates .venv and installs everything on first use.
#   ./run_tests.sh                 # all tests
#   ./run_tests.sh tests/test_x.py # pytest arguments pass through
set -euo pipefail
repo_root="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd)"
"$repo_root/scripts/bootstrap.sh"
cd "$repo_root"
exec "$repo_root/.venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
