"""Device and developer scripts: the GPU run (gpu.sh), the sanitizer driver,
kernel timing, the comparison of two builds, and the multi-GPU checks
(multi_gpu.py under torchrun; dist_checks.py).  Not installed."""
