# Source on a device machine (`source tools/device/env.sh`) before running bundled binaries by
# hand: what .gpu/run.sh sets up for the test binaries (GPU tests on, NVLink multicast off,
# CUDA's and NCCL's libraries found), plus nvcc/compute-sanitizer on PATH and $PY, the Python
# with cupy and torch (for docs/probes).
export GSC_TEST_GPU=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nccl_lib=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/nccl/lib 2>/dev/null | head -1)
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${nccl_lib:+:$nccl_lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="/usr/local/cuda/bin:$PATH"
export PY=/opt/torch/.venv/bin/python3
export OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
