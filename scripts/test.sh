#!/usr/bin/env bash
# The tests, on a fresh machine too: installs what they need (scripts/setup.sh, idempotent), then runs
# pytest on the default set (every tier but tests/slow; pytest.ini says so, so a bare pytest runs the same set).
# Extra arguments go to pytest:
#   bash scripts/test.sh                 # the CI set
#   bash scripts/test.sh -m unit         # one tier: unit, cli, e2e, reliability
#   bash scripts/test.sh -m slow         # the slow suites (benchmark-sized runs)
#   bash scripts/test.sh tests/cli/test_masks.py -k llama3
set -euo pipefail
CDPATH= cd -- "$(dirname -- "$0")/.."
. scripts/lib.sh
run bash scripts/setup.sh
rc=0
run .venv/bin/python -m pytest -ra "$@" || rc=$?
# pytest's 5 = "no tests collected": a selection that ran nothing is a failure here, not a pass; its 4 = a usage
# error (its own lines above), this project's exit code for a bad argument is 2.
[ $rc -eq 5 ] && { echo "test.sh: no tests ran" >&2; exit 1; }
[ $rc -eq 4 ] && exit 2
exit $rc
