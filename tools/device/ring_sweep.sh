#!/bin/bash
# The copy-engine ring (GSC_COLL_RING=on) against NCCL at large sizes, by pieces per step
# (GSC_COLL_RING_PIECES), graph mode; one log per collective and piece count under $OUT.
# Usage: bash tools/device/ring_sweep.sh GPUS "PIECES..." [MIN MAX] [MODES]
#   bash tools/device/ring_sweep.sh 4 "1 2 4" 32M 512M graph,stream
set -u
source "$(dirname "$0")/env.sh"
g=${1:?GPUs}; pieces=${2:-2}; lo=${3:-32M}; hi=${4:-512M}; modes=${5:-graph}
for c in all-reduce reduce-scatter; do
    nccl=--nccl
    for p in $pieces; do
        GSC_COLL_RING=on GSC_COLL_RING_PIECES=$p timeout 240 .gpu/bin/gsc-bench "$c" -b "$lo" -e "$hi" -f 2 -g "$g" -n 20 -w 5 -m "$modes" $nccl \
            > "$OUT/ring-$c-$p.log" 2>&1 || echo "$c pieces $p: exit $?" >> "$OUT/ring-$c-$p.log"
        nccl=
    done
done
