#!/bin/sh
# `make test`: the whole suite in two parts, then its wall time against its budget.
#  1. every test but the `alone` ones, side by side on xdist workers: most of a test is
#     waiting (process start-ups, back-offs, timeouts), and the waits overlap; each worker
#     is a host of its own where root allows it (a network namespace), else the tests of
#     `ddp-ops local`'s process runtime share one worker (tests/conftest.py, LOCAL_PODS);
#  2. the `alone` tests, one at a time, with the machine to themselves.
# Each part prints its slowest tests, so a slow newcomer shows where it lands. The last
# lines: the tests skipped and why (no root, no Docker, no GPU), then the wall time against
# the budget. Past the budget they say which tests grew against tests/durations.json; past
# 1.5 times the budget, which no machine's noise reaches, make test fails.
# Usage: suite.sh PYTEST [PYTEST ARGS...]
set -u
PYTEST=$1
shift
# the suite is bound by CPU on 2 cores (mostly interpreters importing torch), yet 4 workers
# beat 3 (30m50s against 37m38s); 5 gained nothing (16m12s against 16m10s, the CPUs 99 % busy)
WORKERS=${TEST_WORKERS:-4}
BUDGET_S=900  # 15 minutes, which every change keeps (docs/development.md)
LIMIT_S=$((BUDGET_S * 3 / 2))
PYTHON=$(dirname "$PYTEST")/python
reports=$(mktemp -d)
trap 'rm -rf "$reports"' EXIT
started=$(date +%s)

# pytest exits 5 when a part selects no test (a path given that holds none of its tests)
"$PYTEST" -n "$WORKERS" -m "not alone and not image" --durations=25 --junitxml="$reports/side.xml" "$@"
side_by_side=$?
"$PYTEST" -p no:xdist -m "alone and not image" --durations=10 --junitxml="$reports/alone.xml" "$@"
alone=$?

wall=$(( $(date +%s) - started ))
if [ "$side_by_side" -eq 5 ] && [ "$alone" -eq 5 ]; then status=5
elif [ "$side_by_side" -ne 0 ] && [ "$side_by_side" -ne 5 ]; then status=$side_by_side
elif [ "$alone" -ne 0 ] && [ "$alone" -ne 5 ]; then status=$alone
else status=0
fi
if [ "$wall" -gt "$BUDGET_S" ]; then
  "$PYTHON" tests/suite_report.py growth "$reports"/*.xml
fi
# RECORD_DURATIONS=1 make test: this run's durations become the record a later run compares with
if [ "${RECORD_DURATIONS:-0}" = 1 ]; then
  "$PYTHON" tests/suite_report.py record "$reports"/*.xml
fi
"$PYTHON" tests/suite_report.py skips "$reports"/*.xml
if [ "$wall" -le "$BUDGET_S" ]; then verdict="within it"
elif [ "$wall" -le "$LIMIT_S" ]; then verdict="OVER it: see what grew above"
else
  verdict="OVER $((LIMIT_S / 60)) minutes, 1.5 times the budget: see what grew above"
  [ "$status" -eq 0 ] && status=3
fi
echo "make test: $( [ "$status" -eq 0 ] && echo passed || echo "FAILED (exit $status)" ) in $((wall / 60))m$((wall % 60))s of its $((BUDGET_S / 60))-minute budget, $verdict"
exit "$status"
