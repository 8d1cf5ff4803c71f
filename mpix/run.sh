#!/usr/bin/env bash
# Run the stream-enqueue test as N ranks on this machine: run.sh N
# TEST=path/to/test_mpix (default: ./test_mpix). The exit status is 0 only if every rank succeeded.
halo=${TEST:-./test_mpix}
n=$1; shift
export GSC_NRANKS=$n GSC_BOOTSTRAP_ADDR=127.0.0.1:$((29000 + RANDOM % 1000))
export GSC_BOOTSTRAP_SECRET=mpix-$RANDOM$RANDOM$RANDOM
status=0
pids=()
for r in $(seq 0 $((n - 1))); do GSC_RANK=$r "$halo" "$@" & pids+=($!); done
for p in "${pids[@]}"; do wait "$p" || status=1; done
exit $status
