#!/usr/bin/env bash
# Run the partitioned pready example as its two ranks on this machine: run.sh [--header PATH] [ROUNDS]
# EXE=path/to/partitioned_pready (default: ./partitioned_pready). The exit status is 0 only if both ranks succeeded.
exe=${EXE:-./partitioned_pready}
export GSC_NRANKS=2 GSC_BOOTSTRAP_ADDR=127.0.0.1:$((29000 + RANDOM % 1000))
export GSC_BOOTSTRAP_SECRET=pready-$RANDOM$RANDOM$RANDOM
status=0
pids=()
for r in 0 1; do GSC_RANK=$r "$exe" "$@" & pids+=($!); done
for p in "${pids[@]}"; do wait "$p" || status=1; done
exit $status
