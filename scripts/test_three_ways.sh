#!/usr/bin/env bash
# The default test suite three ways, as a user's machine may run it (DEVELOPERS.md, "Test on any machine"):
#
#   plain   as CI runs it;
#   loaded  with every core kept busy by another process (one busy loop per core, at the suite's priority);
#   niced   under `nice -n 10`, as a user sharing a machine might run it.
#
#   bash scripts/test_three_ways.sh                  # all three, one after the other
#   bash scripts/test_three_ways.sh loaded niced     # some of them
#   ROUNDS=3 bash scripts/test_three_ways.sh         # each of them three times in a row
#   bash scripts/test_three_ways.sh plain -- -x tests/test_weight_check.py   # pytest arguments after --
#
# Each run's output goes to test-<way>-<round>.log (AREAL_TEST_LOGS=folder, default .test-logs); the script
# prints one line per run (passed / failed, the time) and exits non-zero if any run failed. The busy loops are
# stopped when the script exits, however it exits.
set -uo pipefail
cd "$(dirname "$0")/.."

ways=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    case "$1" in
        plain|loaded|niced) ways+=("$1") ;;
        *) echo "test_three_ways: unknown way '$1'; the ways are plain, loaded and niced" >&2; exit 2 ;;
    esac
    shift
done
[ "${1:-}" = "--" ] && shift
[ ${#ways[@]} -eq 0 ] && ways=(plain loaded niced)
rounds=${ROUNDS:-1}
logs=${AREAL_TEST_LOGS:-.test-logs}
mkdir -p "$logs"
PY=${AREAL_VENV:-.venv}/bin/python

burners=()
stop_burners() {
    [ ${#burners[@]} -gt 0 ] && kill "${burners[@]}" 2>/dev/null
    burners=()
}
trap stop_burners EXIT INT TERM

failed=0
for round in $(seq 1 "$rounds"); do
    for way in "${ways[@]}"; do
        prefix=()
        if [ "$way" = loaded ]; then
            for _ in $(seq 1 "$(nproc)"); do
                "$PY" -c "while True: pass" &
                burners+=($!)
            done
        elif [ "$way" = niced ]; then
            prefix=(nice -n 10)
        fi
        log="$logs/test-$way-$round.log"
        began=$(date +%s)
        "${prefix[@]}" "$PY" -m pytest -p no:cacheprovider "$@" >"$log" 2>&1
        status=$?
        stop_burners
        summary=$(tail -n 1 "$log")
        echo "test_three_ways: $way, round $round: exit $status in $(( $(date +%s) - began )) s: $summary"
        [ $status -ne 0 ] && failed=1
    done
done
exit $failed
