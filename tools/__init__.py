"""Device and developer scripts: the GPU run (gpu.sh), the sanitizer driver,
kernel timing and the comparison of two builds.  Not installed."""
