#!/usr/bin/env bash
# On a GPU machine with PyTorch: PyTorch's NCCL process group, unchanged, on NVIDIA's NCCL and
# then on gscomm's libnccl.so.2 (preloaded, so it serves every NCCL call torch makes), with
# scripts/torch_nccl.py's checks and timings side by side. First it lists the NCCL functions
# torch's libraries import and says which of them gscomm's library does not define (those would
# still go to NVIDIA's library under LD_PRELOAD, so the list must be empty).
#
#   GSC_NCCL_LIB=path [PY=python] scripts/torch-nccl.sh [NGPUS] [--quick]
#
# GSC_NCCL_LIB: gscomm's library (cargo build --release -p gscomm-nccl; target/release/libnccl.so).
# Results: $OUT/torch-{nvidia,gscomm}.{json,err}, $OUT/torch-imports.txt; a summary on stdout.
set -u
ourlib=$(realpath "${GSC_NCCL_LIB:-.gpu/lib/libnccl.so.2}")
# The script's own input, not a knob: gscomm's library would warn about it as an unknown GSC_*.
unset GSC_NCCL_LIB
PY=${PY:-/opt/torch/.venv/bin/python3}
OUT=${OUT:-/tmp/torch-nccl-out}
mkdir -p "$OUT"
here=$(cd "$(dirname "$0")" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 GSC_KERNEL_CACHE_DIR=${GSC_KERNEL_CACHE_DIR:-/tmp/gsc-kc}

tlib=$("$PY" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
{
    echo "torch libraries: $tlib"
    readelf -d "$tlib/libtorch_cuda.so" | grep -E 'NEEDED.*nccl|RPATH|RUNPATH'
    nm -D --undefined-only "$tlib"/*.so 2>/dev/null | awk '$2 ~ /^nccl/ {print $2}' | sort -u > "$OUT/torch-wants.txt"
    nm -D --defined-only "$ourlib" | awk '{print $3}' | grep '^nccl' | sort -u > "$OUT/gscomm-has.txt"
    echo "NCCL functions torch imports: $(wc -l < "$OUT/torch-wants.txt")"
    tr '\n' ' ' < "$OUT/torch-wants.txt"; echo
    echo "of them, not defined by gscomm's library: $(comm -23 "$OUT/torch-wants.txt" "$OUT/gscomm-has.txt" | tr '\n' ' ')"
} > "$OUT/torch-imports.txt" 2>&1
grep -E "^NCCL functions|^of them" "$OUT/torch-imports.txt"

for lib in nvidia gscomm; do
    pre=""
    [ $lib = gscomm ] && pre=$ourlib
    LD_PRELOAD=$pre timeout "${TORCH_TIMEOUT:-500}" "$PY" "$here/torch_nccl.py" "$@" > "$OUT/torch-$lib.json" 2> "$OUT/torch-$lib.err"
    echo "$lib: rc=$? $(tail -c 600 "$OUT/torch-$lib.json" | tr -d '\n' | cut -c1-600)"
done

"$PY" - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
def load(lib):
    try:
        return json.loads(open(f"{out}/torch-{lib}.json").read().strip().splitlines()[-1])
    except Exception as e:
        return {"failed": [f"no result: {e}"], "time_us": {}}
nv, gs = load("nvidia"), load("gscomm")
for name, r in (("NVIDIA", nv), ("gscomm", gs)):
    print(f"{name}: {r.get('passed', 0)} checks passed, failed: {r.get('failed')}, gsc threads: {r.get('gsc_threads')}, "
          f"NCCL version reported: {r.get('nccl_version')}, torch {r.get('torch')}, exit codes {r.get('exit_codes')}")
print(f"| {'what':<24} | {'NVIDIA NCCL (µs)':>16} | {'gscomm (µs)':>12} | NVIDIA / gscomm |")
print("| --- | ---: | ---: | ---: |")
for k, v in nv.get("time_us", {}).items():
    g = gs.get("time_us", {}).get(k)
    if g:
        print(f"| {k:<24} | {v:16.2f} | {g:12.2f} | {v / g:15.2f} |")
EOF
