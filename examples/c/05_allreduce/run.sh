#!/usr/bin/env bash
# Run the all-reduce example as N ranks on this machine (launcher-style, no mpirun): run.sh N
# EXE=path/to/allreduce (default: ./allreduce). The exit status is 0 only if every rank succeeded.
exe=${EXE:-./allreduce}
n=$1; shift
export GSC_NRANKS=$n GSC_BOOTSTRAP_ADDR=127.0.0.1:$((29000 + RANDOM % 1000))
export GSC_BOOTSTRAP_SECRET=allreduce-$RANDOM$RANDOM$RANDOM
status=0
pids=()
for r in $(seq 0 $((n - 1))); do GSC_RANK=$r "$exe" "$@" & pids+=($!); done
for p in "${pids[@]}"; do wait "$p" || status=1; done
exit $status
