#!/usr/bin/env bash
# Build every C example against a gscomm library and run them on this machine's GPUs, one
# PASS/FAIL line per build and per run (for the device machines; CI builds and runs the CPU
# ones through `cargo test --test install`).
#
#   examples/c/run_gpu.sh [--build-only] LIBDIR INCLUDEDIR
#
#   LIBDIR      holds libgscomm.so, or only the versioned file the loader asks for
#               (libgscomm.so.0.MINOR, as .gpu/lib does)
#   INCLUDEDIR  holds gsc.h and gsc_device.cuh (e.g. include/ of the repository)
#
#   --build-only  build into OUT and stop (to carry the binaries to a machine without a C
#                 compiler: there, with no CC found, the script runs what OUT already holds)
#
# Environment: OUT (default /tmp/gsc-examples) gets the binaries and one log per run; CC
# (default cc); GSC_TIMEOUT (default 60s here) and any other GSC_* variable reach every rank.
# Every rank runs under `timeout 300`. Multi-rank runs use GPU rank % (number of GPUs): where
# there are more ranks than GPUs the line says "GPUs shared". A run passes when every rank
# exits 0 and prints its success line (a GPU example that skipped, or fell back to host
# streams, fails here). Exit status 0 only if every build and run passed.
set -u
build_only=0
if [ "${1:-}" = "--build-only" ]; then
    build_only=1
    shift
fi
if [ $# -ne 2 ] || [ ! -d "$1" ] || [ ! -f "$2/gsc.h" ]; then
    echo "usage: $0 [--build-only] LIBDIR INCLUDEDIR   (INCLUDEDIR must hold gsc.h)" >&2
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
libdir=$(cd "$1" && pwd)
incdir=$(cd "$2" && pwd)
out=${OUT:-/tmp/gsc-examples}
cc=${CC:-cc}
mkdir -p "$out"

# NVLink multicast stays off on the shared machines (KINDS.md); NVRTC (example 04) from the
# CUDA toolkit.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH="$libdir:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export GSC_TIMEOUT=${GSC_TIMEOUT:-60s} GSC_BOOTSTRAP_TIMEOUT=${GSC_BOOTSTRAP_TIMEOUT:-60s}
# A launcher's rank variables would override the ones set per rank below.
unset GSC_RANK GSC_NRANKS GSC_UNIQUE_ID OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_SIZE PMI_RANK PMI_SIZE

ngpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
echo "run_gpu.sh: $ngpus GPU(s); library $libdir; headers $incdir; logs in $out"
nvidia-smi -L 2>/dev/null | sed 's/^/  /'

passed=0
failed=0
report() { # report OK LABEL LOG
    if [ "$1" = 1 ]; then
        echo "PASS  $2"
        passed=$((passed + 1))
    else
        echo "FAIL  $2   (log: $3)"
        tail -n 25 "$3" | sed 's/^/      /'
        failed=$((failed + 1))
    fi
}

# Link against libgscomm.so when it is there, else the versioned file itself (it carries the
# soname the loader looks for, and the rpath finds it).
if [ -e "$libdir/libgscomm.so" ]; then
    link=(-L"$libdir" -lgscomm)
else
    versioned=$(ls "$libdir"/libgscomm.so.* 2>/dev/null | head -n 1)
    if [ -z "$versioned" ]; then
        echo "run_gpu.sh: no libgscomm.so or libgscomm.so.* in $libdir" >&2
        exit 2
    fi
    link=("$versioned")
fi

# Build: every example against INCLUDEDIR, as CI does (C99, every warning an error).
if ! command -v "$cc" > /dev/null 2>&1; then
    echo "run_gpu.sh: no C compiler ($cc): running the binaries already in $out"
fi
for dir in "$here"/[0-9][0-9]_*/; do
    command -v "$cc" > /dev/null 2>&1 || break
    name=$(basename "$dir")
    src=$(ls "$dir"*.c)
    log="$out/build-$name.log"
    "$cc" -std=c99 -Wall -Werror -pedantic -I"$incdir" "$src" -o "$out/$name" "${link[@]}" -ldl \
        -Wl,-rpath,"$libdir" > "$log" 2>&1
    if [ $? -eq 0 ]; then report 1 "build $name" "$log"; else report 0 "build $name" "$log"; fi
done
if [ $build_only = 1 ]; then
    echo "run_gpu.sh: built into $out: $passed passed, $failed failed"
    [ $failed -eq 0 ]
    exit
fi

# run LABEL NRANKS EXPECT EXAMPLE [ARGS...]: NRANKS processes, launcher-style (GSC_RANK etc.);
# PASS when every rank exits 0 and prints EXPECT (so a GPU example that fell back or skipped
# does not pass).
run() {
    local label=$1 n=$2 expect=$3 exe="$out/$4" log st pids r p
    shift 4
    case "$label" in
        *host*) ;;
        *) [ "$n" -gt "$ngpus" ] && label="$label (GPUs shared)" ;;
    esac
    log="$out/$(printf '%s' "$label" | tr -c 'A-Za-z0-9_.-' '_').log"
    if [ ! -x "$exe" ]; then
        echo "not built" > "$log"
        report 0 "$label" "$log"
        return
    fi
    (
        export GSC_NRANKS=$n GSC_BOOTSTRAP_ADDR=127.0.0.1:$((20000 + RANDOM % 20000))
        export GSC_BOOTSTRAP_SECRET=examples-$RANDOM$RANDOM$RANDOM
        st=0
        pids=()
        for r in $(seq 0 $((n - 1))); do
            GSC_RANK=$r timeout 300 "$exe" "$@" > "$log.rank$r" 2>&1 &
            pids+=($!)
        done
        for p in "${pids[@]}"; do wait "$p" || st=1; done
        for r in $(seq 0 $((n - 1))); do
            sed "s/^/[rank $r] /" "$log.rank$r"
            grep -qF -- "$expect" "$log.rank$r" || { echo "[rank $r] (did not print: $expect)"; st=1; }
            rm -f "$log.rank$r"
        done
        exit $st
    ) > "$log" 2>&1
    if [ $? -eq 0 ]; then report 1 "$label" "$log"; else report 0 "$label" "$log"; fi
}

# 00: one process; it must find the GPUs.
log="$out/00_init_info.log"
if timeout 60 "$out/00_init_info" > "$log" 2>&1 && grep -q "GPU(s)" "$log"; then ok=1; else ok=0; fi
report $ok "00_init_info (driver and GPUs found)" "$log"

run "01_tag_pingpong 2 ranks (host memory)" 2 "all checks passed" 01_tag_pingpong

halo=2
[ "$ngpus" -ge 4 ] && halo=4
run "02_prepared_halo $halo ranks, proxy" $halo "all halos checked" 02_prepared_halo 1000
run "02_prepared_halo $halo ranks, GPU rounds" $halo "all halos checked" 02_prepared_halo --gpu-rounds 10000

run "03_graph_sendrecv 2 ranks, CUDA stream and graph" 2 "all checks passed (CUDA stream and graph)" 03_graph_sendrecv 1000
run "03_graph_sendrecv 2 ranks, host streams" 2 "all checks passed (host stream)" 03_graph_sendrecv --host 1000

run "04_partitioned_pready 2 ranks" 2 "all checks passed" 04_partitioned_pready --header "$incdir/gsc_device.cuh"

run "05_allreduce 2 ranks" 2 "all checks passed" 05_allreduce
[ "$ngpus" -ge 4 ] && run "05_allreduce 4 ranks" 4 "all checks passed" 05_allreduce
if command -v mpirun > /dev/null 2>&1; then
    log="$out/05_allreduce_mpirun.log"
    (
        export GSC_BOOTSTRAP_ADDR=127.0.0.1:$((20000 + RANDOM % 20000))
        export GSC_BOOTSTRAP_SECRET=examples-$RANDOM$RANDOM$RANDOM
        if mpirun --version 2>&1 | grep -qi "open mpi"; then
            timeout 300 mpirun --allow-run-as-root -np 2 -x GSC_BOOTSTRAP_ADDR -x GSC_BOOTSTRAP_SECRET \
                -x GSC_TIMEOUT -x GSC_BOOTSTRAP_TIMEOUT -x LD_LIBRARY_PATH -x NCCL_NVLS_ENABLE "$out/05_allreduce"
        else
            timeout 300 mpirun -np 2 "$out/05_allreduce" # MPICH/Hydra passes the environment on
        fi
    ) > "$log" 2>&1
    st=$?
    if [ $st -eq 0 ] && [ "$(grep -c 'all checks passed' "$log")" -eq 2 ]; then ok=1; else ok=0; fi
    report $ok "05_allreduce 2 ranks under mpirun" "$log"
else
    echo "----  05_allreduce under mpirun: no mpirun on this machine (not run)"
fi

run "06_graph_broadcast 2 ranks" 2 "all checks passed" 06_graph_broadcast 1000
run "06_graph_broadcast 3 ranks (the seed's shape)" 3 "all checks passed" 06_graph_broadcast 1000
[ "$ngpus" -ge 4 ] && run "06_graph_broadcast 4 ranks (receive, then two sends)" 4 "all checks passed" 06_graph_broadcast 1000

run "07_triggered_allreduce 2 ranks" 2 "all checks passed" 07_triggered_allreduce --header "$incdir/gsc_device.cuh"
[ "$ngpus" -ge 4 ] && run "07_triggered_allreduce 4 ranks" 4 "all checks passed" 07_triggered_allreduce --header "$incdir/gsc_device.cuh"

run "08_alltoall 2 ranks, stream and graph" 2 "all checks passed" 08_alltoall
run "08_alltoall 3 ranks, stream and graph" 3 "all checks passed" 08_alltoall
[ "$ngpus" -ge 4 ] && run "08_alltoall 4 ranks, stream and graph" 4 "all checks passed" 08_alltoall

run "09_split_shrink 2 ranks" 2 "all checks passed" 09_split_shrink
run "09_split_shrink 3 ranks" 3 "all checks passed" 09_split_shrink
[ "$ngpus" -ge 4 ] && run "09_split_shrink 4 ranks" 4 "all checks passed" 09_split_shrink

echo "run_gpu.sh: $passed passed, $failed failed"
[ $failed -eq 0 ]
