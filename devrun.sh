export GSC_TEST_GPU=1 NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64:$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/nccl/lib|head -1)
"$@"
