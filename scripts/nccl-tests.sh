#!/usr/bin/env bash
# On a GPU machine: build nccl-tests against NVIDIA's nccl.h with gscomm's libnccl.so.2 as the
# library, then run each test on gscomm's library and on NVIDIA's, side by side, eager (-G 0)
# and captured (-G 5), every size checked (-c 1). Results go to $OUT/nccltests.txt (one
# section per run); one summary line per run is printed.
#
#   NCCLTESTS=dir GSC_NCCL_LIB=path scripts/nccl-tests.sh NGPUS "TESTS" [nccl-tests args]
#   e.g. scripts/nccl-tests.sh 4 "sendrecv alltoall" -b 8 -e 64M -f 8 -n 20 -w 5
#
# NCCLTESTS: a checkout of https://github.com/NVIDIA/nccl-tests (v2.19.6, which calls nccl.h
# 2.28's ncclAlltoAll, ncclGather and ncclScatter, is used since session 26; v2.16.9 before; the
# machines have no network, so carry it: git archive v2.19.6 | tar -x -C .nccltests). GSC_NCCL_LIB:
# gscomm's library (cargo build --release -p gscomm-nccl; target/release/libnccl.so).
# NVIDIA's NCCL is taken from the torch venv, as on our machines.
ng=${1:-2}; tests=${2:-"sendrecv alltoall"}; shift 2; extra=("$@")
ntdir=${NCCLTESTS:-.nccltests}
ourlib=${GSC_NCCL_LIB:-.gpu/lib/libnccl.so.2}
# The script's own input, not a knob: gscomm's library would warn about it as an unknown GSC_*.
unset GSC_NCCL_LIB
OUT=${OUT:-/tmp/nccltests-out}; mkdir -p "$OUT"
nv=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/nccl | head -1)
mkdir -p /tmp/nh/include /tmp/nh/lib
cp -r "$nv"/include/. /tmp/nh/include/  # nccl.h and nccl_device.h with its directory
cp "$ourlib" /tmp/nh/lib/libnccl.so.2 && ln -sf libnccl.so.2 /tmp/nh/lib/libnccl.so
if [ ! -x /tmp/ntb/sendrecv_perf ]; then
  make -C "$ntdir/src" -j16 MPI=0 NCCL_HOME=/tmp/nh CUDA_HOME=/usr/local/cuda \
    NVCC_GENCODE="-gencode=arch=compute_90,code=sm_90" BUILDDIR=/tmp/ntb > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
export NCCL_NVLS_ENABLE=0
for lib in gscomm nvidia; do
  if [ $lib = gscomm ]; then L=/tmp/nh/lib; else L=$nv/lib; fi
  for t in $tests; do
    for G in 0 5; do
      f=/tmp/nt-one.txt
      LD_LIBRARY_PATH=$L:/usr/local/cuda/lib64 ldd /tmp/ntb/${t}_perf | grep nccl > "$f"
      LD_LIBRARY_PATH=$L:/usr/local/cuda/lib64 timeout 150 /tmp/ntb/${t}_perf -g "$ng" -c 1 -G $G "${extra[@]}" >> "$f" 2>&1
      rc=$?
      { echo "=== $lib $t -g $ng -G $G ${extra[*]} rc=$rc"; cat "$f"; } >> "$OUT/nccltests.txt"
      echo "$lib $t -g $ng -G $G rc=$rc $(grep -E 'Avg bus|Out of bounds' "$f" | tr '\n' ' ')"
    done
  done
done
