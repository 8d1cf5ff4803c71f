#!/usr/bin/env bash
# Run the kernel-triggered collectives example as N ranks on this machine (launcher-style, no
# mpirun): run.sh N [--header PATH] [ROUNDS]
# EXE=path/to/triggered_allreduce (default: ./triggered_allreduce). The exit status is 0 only if
# every rank succeeded.
exe=${EXE:-./triggered_allreduce}
n=$1; shift
export GSC_NRANKS=$n GSC_BOOTSTRAP_ADDR=127.0.0.1:$((29000 + RANDOM % 1000))
export GSC_BOOTSTRAP_SECRET=triggered-$RANDOM$RANDOM$RANDOM
status=0
pids=()
for r in $(seq 0 $((n - 1))); do GSC_RANK=$r "$exe" "$@" & pids+=($!); done
for p in "${pids[@]}"; do wait "$p" || status=1; done
exit $status
