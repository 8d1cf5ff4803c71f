#!/usr/bin/env bash
# Run bundled test binaries under compute-sanitizer on a device machine (issue #8's runs).
#   bash tools/device/san.sh TOOL TAG BUDGET_S BIN[:FILTER...] ...
#     TOOL    memcheck | racecheck | synccheck | initcheck
#     TAG     a word for the log names
#     BUDGET  seconds each binary may run (then it is killed and reported as such)
#     BIN     a test binary's name in .gpu/tests without "-test" (collectives_gpu), optionally
#             followed by :FILTER (a test-name filter passed to it)
# Children of the tests are sanitized too (--target-processes all). Every binary's log goes to
# $OUT/san-TAG-TOOL-BIN.log; one summary line per binary is printed. Exit 86 from a binary
# means the sanitizer found errors.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/env.sh"
tool=$1 tag=$2 budget=$3
shift 3
root=$(cd "$here/../.." && pwd)
for spec in "$@"; do
    bin=${spec%%:*}
    filter=""
    [[ $spec == *:* ]] && filter=${spec#*:}
    log="$OUT/san-$tag-$tool-$bin${filter:+-$filter}.log"
    t0=$(date +%s)
    timeout "$budget" compute-sanitizer --tool "$tool" --target-processes all --report-api-errors no --error-exitcode 86 \
        "$root/.gpu/tests/$bin-test" $filter --test-threads=1 > "$log" 2>&1
    rc=$?
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test result" "$log" | tail -n 3 | tr '\n' ' ')
    echo "$tool $bin ${filter:+[$filter] }rc=$rc $(( $(date +%s) - t0 ))s $summary"
done
