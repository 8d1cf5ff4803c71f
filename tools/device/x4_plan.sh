#!/bin/bash
# Issue #6's four-GPU runs, in parts that each fit one device command (< 10 min), on
# `nvidia-h200-x4` with the bundle carried (`.gpu`). Logs go under $OUT, packed into one
# archive per part (the device returns only a few files).
#   bash tools/device/x4_plan.sh probe   # sm_patterns.py, push_allreduce.py; the four-rank exact suites
#   bash tools/device/x4_plan.sh bench   # 8 B latency, the direct kernel's sweep, auto, NCCL
#   bash tools/device/x4_plan.sh san     # the direct kernel on four GPUs under memcheck and racecheck
#   bash tools/device/x4_plan.sh floors  # what auto's floors on four ranks rest on: the direct
#                                        # all-gather, and the other paths without the ring, by size
#   bash tools/device/x4_plan.sh paths   # reduce-scatter and all-reduce 8-128 MiB: the direct
#                                        # kernel alone, then the ring alone (to set auto)
#   bash tools/device/x4_plan.sh p2p     # send/recv on four GPUs: the exact suite, gsc-bench
#                                        # sendrecv and all-to-all, nccl-tests (carry .nccltests
#                                        # and .gpn: see scripts/nccl-tests.sh)
set -u
here=$(cd "$(dirname "$0")" && pwd)
source "$here/env.sh"
cd "$here/../.."
part=${1:?probe|bench|floors|paths|p2p|san}
case $part in
probe)
    nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
    timeout 240 "$PY" docs/probes/sm_patterns.py 128 > "$OUT/sm_patterns.txt" 2>&1
    timeout 120 "$PY" docs/probes/push_allreduce.py 128 512 > "$OUT/push_allreduce.txt" 2>&1
    GSC_TIMEOUT=30s timeout 300 .gpu/tests/collectives_gpu-test four_gpus --test-threads=1 > "$OUT/four_gpus.log" 2>&1
    echo "four_gpus rc $?" >> "$OUT/four_gpus.log"
    ;;
bench)
    B=.gpu/bin/gsc-bench
    timeout 120 $B all-reduce -b 8 -e 8 -g 4 -n 2000 -w 200 -m stream,graph --nccl > "$OUT/ar8.log" 2>&1
    bash "$here/direct_sweep.sh" 4 "def 132" 32M 512M
    for c in all-reduce all-gather reduce-scatter; do
        timeout 200 $B "$c" -b 1M -e 512M -f 8 -g 4 -n 20 -w 5 -m graph,stream --nccl > "$OUT/$c-auto.log" 2>&1
    done
    ;;
floors)
    B=.gpu/bin/gsc-bench
    GSC_COLL_SM=on timeout 200 $B all-gather -b 1M -e 512M -f 4 -g 4 -n 20 -w 5 -m graph --nccl > "$OUT/ag-direct.log" 2>&1
    for c in all-reduce reduce-scatter; do
        GSC_COLL_RING=off timeout 200 $B "$c" -b 8M -e 512M -f 2 -g 4 -n 20 -w 5 -m graph --nccl > "$OUT/$c-noring.log" 2>&1
    done
    timeout 120 $B all-reduce -b 8 -e 8 -g 4 -n 2000 -w 200 -m graph --nccl > "$OUT/ar8.log" 2>&1
    ;;
paths)
    B=.gpu/bin/gsc-bench
    for c in reduce-scatter all-reduce; do
        GSC_COLL_SM=on GSC_COLL_RING=off timeout 200 $B "$c" -b 8M -e 128M -f 2 -g 4 -n 20 -w 5 -m graph --nccl > "$OUT/$c-sm.log" 2>&1
        GSC_COLL_RING=on GSC_COLL_SM=off timeout 200 $B "$c" -b 8M -e 128M -f 2 -g 4 -n 20 -w 5 -m graph --nccl > "$OUT/$c-ring.log" 2>&1
    done
    ;;
p2p)
    B=.gpu/bin/gsc-bench
    timeout 200 .gpu/tests/p2p_kernel_gpu-test four --test-threads=1 > "$OUT/p2p-four.log" 2>&1
    echo "p2p four rc $?" >> "$OUT/p2p-four.log"
    timeout 150 $B sendrecv -b 8 -e 128M -f 4 -g 4 -n 200 -w 20 -m stream,graph --nccl > "$OUT/sendrecv.log" 2>&1
    timeout 150 $B all-to-all -b 64 -e 128M -f 4 -g 4 -n 200 -w 20 -m stream,graph --nccl > "$OUT/all-to-all.log" 2>&1
    if [ -d .nccltests ] && [ -f .gpn/libnccl.so.2 ]; then
        NCCLTESTS=.nccltests GSC_NCCL_LIB=.gpn/libnccl.so.2 timeout 240 bash scripts/nccl-tests.sh 4 "sendrecv alltoall" \
            -b 8 -e 128M -f 8 -n 20 -w 5 > "$OUT/nccltests-summary.txt" 2>&1
    fi
    ;;
san)
    bash "$here/san.sh" memcheck x4 280 collectives_gpu:direct_kernel_collectives_exact_on_four_gpus
    bash "$here/san.sh" racecheck x4 280 collectives_gpu:direct_kernel_collectives_exact_on_four_gpus
    ;;
*) echo "unknown part $part" >&2; exit 2 ;;
esac
cd "$OUT" && files=$(ls ./*.log ./*.txt 2>/dev/null; true) && tar czf "x4-$part.tgz" $files && rm -f $files; ls "$OUT"
