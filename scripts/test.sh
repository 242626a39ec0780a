#!/usr/bin/env bash
# The tests, on a fresh machine too: installs what they need (scripts/setup.sh, idempotent), then runs
# pytest on the default set (every tier but tests/slow; pytest.ini says so, so a bare pytest runs the same set).
# Extra arguments go to pytest:
#   bash scripts/test.sh                 # the CI set
#   bash scripts/test.sh -m unit         # one tier: unit, cli, e2e, reliability
#   bash scripts/test.sh -m slow         # the slow suites (benchmark-sized runs)
#   bash scripts/test.sh tests/cli/test_masks.py -k llama3
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
set +e
.venv/bin/python -m pytest -ra "$@"
rc=$?
set -e
# pytest's 5 = "no tests collected": a selection that ran nothing is a failure here, not a pass.
[ $rc -eq 5 ] && { echo "test.sh: no tests ran" >&2; exit 1; }
exit $rc
