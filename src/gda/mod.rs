//! GPU-initiated execution (issue #5): NVLink put/signal by kernels on prepared transfers, and
//! the verbs doorbell path for mlx5 NICs. Not built yet.
