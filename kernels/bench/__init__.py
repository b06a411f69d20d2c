"""GPU benchmarks for the KV kernels (see README.md)."""
