#!/bin/bash
# Issue #6's two-GPU measurements left open since session 34, on `nvidia-h200-x2`, in parts that
# each fit one device command (< 10 min). Carry the bundle (`.gpu`); the nccl-tests part also
# `.gpn` (gscomm's libnccl.so.2: cargo build --release -p gscomm-nccl; strip -o
# .gpn/libnccl.so.2 target/release/libnccl.so) and `.nccltests` (see scripts/nccl-tests.sh).
# Logs go under $OUT.
#   bash tools/device/x2_plan.sh checks    # 8 B all-reduce (the one-shot kernel's warp vote),
#                                          # reduce-scatter 128 MiB + 8 B (parts off 16 bytes),
#                                          # reduce and broadcast at 256-512 MiB
#   bash tools/device/x2_plan.sh pipelined # the pipelined kernel and its narrow twin (parts off
#                                          # 16 bytes) against the phased kernel and NCCL
#   bash tools/device/x2_plan.sh narrow    # what docs/probes/narrow_gather16.patch changes:
#                                          # run once on a bundle without it and once with it
#                                          # applied; keep it only if it wins
#   bash tools/device/x2_plan.sh suites    # the two-GPU exact suites (correctness after a change)
set -u
here=$(cd "$(dirname "$0")" && pwd)
source "$here/env.sh"
cd "$here/../.."
B=.gpu/bin/gsc-bench
part=${1:?checks|pipelined|narrow|suites}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpus.txt"
bench() { # NAME ARGS...: one gsc-bench run, its log under $OUT, its table printed
    local name=$1; shift
    timeout 200 $B "$@" > "$OUT/$name.log" 2>&1; echo "== $name rc=$? ($*)"; grep -v -E "^#|^$" "$OUT/$name.log" | tail -12
}
case $part in
checks)
    bench ar8 all-reduce -b 8 -e 8 -g 2 -n 2000 -w 200 -m stream,graph --nccl
    bench rs-off16 reduce-scatter -b 134217736 -e 134217736 -g 2 -n 10 -w 3 -m stream,graph --nccl
    bench reduce-big reduce -b 256M -e 512M -f 2 -g 2 -n 10 -w 3 -m stream,graph --nccl
    bench bcast-big broadcast -b 256M -e 512M -f 2 -g 2 -n 10 -w 3 -m stream,graph --nccl
    ;;
pipelined)
    # 64 MiB and 512 MiB, then the same sizes + 8 B (parts off 16 bytes: the narrow twins).
    for c in all-reduce all-gather reduce-scatter; do
        for algo in phased pipelined; do
            GSC_COLL_LARGE_ALGO=$algo bench "$c-$algo" "$c" -b 64M -e 512M -f 8 -g 2 -n 10 -w 3 -m graph --nccl
            GSC_COLL_LARGE_ALGO=$algo bench "$c-$algo-off16" "$c" -b 67108872 -e 67108872 -g 2 -n 10 -w 3 -m graph --nccl
        done
    done
    ;;
narrow)
    for c in reduce broadcast all-reduce all-gather reduce-scatter; do
        bench "$c-off16" "$c" -b 67108872 -e 67108872 -g 2 -n 20 -w 5 -m stream,graph --nccl
    done
    if [ -d .nccltests ] && [ -f .gpn/libnccl.so.2 ]; then
        NCCLTESTS=.nccltests GSC_NCCL_LIB=.gpn/libnccl.so.2 timeout 300 bash scripts/nccl-tests.sh 2 "reduce broadcast" \
            -u 1 -b 64M -e 64M -n 20 -w 5 > "$OUT/nccltests-summary.txt" 2>&1
        cat "$OUT/nccltests-summary.txt"
    fi
    ;;
suites)
    t=.gpu/tests/collectives_gpu-test
    for s in collectives_exact_on_two_gpus pipelined_large_collectives_exact_on_two_gpus ranks_at_different_alignments_exact_on_two_gpus; do
        timeout 300 $t --test-threads 1 --exact $s > "$OUT/$s.log" 2>&1; echo "== $s rc=$? $(grep -E '^test result' "$OUT/$s.log")"
    done
    ;;
*) echo "unknown part $part" >&2; exit 2 ;;
esac
