#!/bin/bash
# The direct kernel (GSC_COLL_SM=on) against NCCL at large sizes, by blocks per launch
# (GSC_COLL_SM_BLOCKS; "def" = two per SM), graph mode; one log per collective and block count
# under $OUT. Usage: bash tools/device/direct_sweep.sh GPUS "BLOCKS..." [MIN MAX]
#   bash tools/device/direct_sweep.sh 4 "def 64 132" 128M 512M
set -u
source "$(dirname "$0")/env.sh"
g=${1:?GPUs}; blocks=${2:-def}; lo=${3:-128M}; hi=${4:-512M}
for c in all-reduce all-gather reduce-scatter; do
    nccl=--nccl
    for b in $blocks; do
        if [ "$b" = def ]; then unset GSC_COLL_SM_BLOCKS; else export GSC_COLL_SM_BLOCKS=$b; fi
        GSC_COLL_SM=on timeout 240 .gpu/bin/gsc-bench "$c" -b "$lo" -e "$hi" -f 4 -g "$g" -n 20 -w 5 -m graph $nccl \
            > "$OUT/$c-$b.log" 2>&1 || echo "$c blocks $b: exit $?" >> "$OUT/$c-$b.log"
        nccl=
    done
done
unset GSC_COLL_SM_BLOCKS
