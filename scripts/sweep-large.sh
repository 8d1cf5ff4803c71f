#!/usr/bin/env bash
# Sweep the large collectives' knobs on one machine of 4 GPUs (issue #6), one short gsc-bench
# process per setting, nothing rebuilt: GSC_COLL_LARGE_ALGO/_STAGES/_BLOCKS/_THREADS/_WARPS do
# not change the kernels' source, so the kernel cache compiled by the warm-up serves every run
# (GSC_COLL_LARGE_ROUND does change it: ~1.5 min of NVRTC per new value; not swept here).
# Usage: scripts/sweep-large.sh [path to gsc-bench]   (default target/release/gsc-bench)
set -uo pipefail
B=${1:-target/release/gsc-bench}
export GSC_TIMEOUT=10s # a wrong setting that deadlocks costs 10 s, not 60
AR="$B all-reduce -b 128M -e 512M -f 4 -g 4 -n 30 -w 5 -m graph"
HALF="-b 512M -e 512M -g 4 -n 20 -w 3 -m graph"
rows() { grep -v '^#' || true; }
run() { # label, then env assignments and the command
    local label=$1; shift
    echo "== $label"
    env "$@" 2>&1 | rows
}
# The first process on a fresh machine runs slow (docs/PERF.md) and compiles the kernels.
timeout 300 $AR --nccl > /dev/null 2>&1
run "phased (today's default), NCCL beside it" timeout 90 $AR --nccl
# stages blocks threads warps(push:reduce:copy)
for cfg in "4 128 512 auto" "2 128 512 auto" "3 128 512 auto" "8 128 512 auto" \
           "4 96 512 auto" "4 64 512 auto" "4 128 384 auto" "4 128 256 auto" \
           "4 128 512 2:2:1" "4 128 512 3:2:2" "4 128 512 2:3:2"; do
    set -- $cfg
    run "pipelined stages=$1 blocks=$2 threads=$3 warps=$4" GSC_COLL_LARGE_ALGO=pipelined GSC_COLL_LARGE_STAGES=$1 \
        GSC_COLL_LARGE_BLOCKS=$2 GSC_COLL_LARGE_THREADS=$3 GSC_COLL_LARGE_WARPS=$4 timeout 90 $AR
done
for c in all-gather reduce-scatter; do
    run "$c phased, NCCL beside it" timeout 90 $B $c $HALF --nccl
    for cfg in "4 128 512 auto" "2 128 512 auto" "8 128 512 auto" "4 128 512 1:1:1"; do
        set -- $cfg
        run "$c pipelined stages=$1 blocks=$2 threads=$3 warps=$4" GSC_COLL_LARGE_ALGO=pipelined GSC_COLL_LARGE_STAGES=$1 \
            GSC_COLL_LARGE_BLOCKS=$2 GSC_COLL_LARGE_THREADS=$3 GSC_COLL_LARGE_WARPS=$4 timeout 90 $B $c $HALF
    done
done
