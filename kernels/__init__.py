"""KV-cache kernels (NVFP4) and the KV layout planner: see README.md."""
