#!/usr/bin/env bash
# Run the graph send/recv example as its two ranks on this machine: run.sh [graph_sendrecv arguments...]
# EXE=path/to/graph_sendrecv (default: ./graph_sendrecv). The exit status is 0 only if both ranks succeeded.
exe=${EXE:-./graph_sendrecv}
export GSC_NRANKS=2 GSC_BOOTSTRAP_ADDR=127.0.0.1:$((29000 + RANDOM % 1000))
export GSC_BOOTSTRAP_SECRET=sendrecv-$RANDOM$RANDOM$RANDOM
status=0
pids=()
for r in 0 1; do GSC_RANK=$r "$exe" "$@" & pids+=($!); done
for p in "${pids[@]}"; do wait "$p" || status=1; done
exit $status
