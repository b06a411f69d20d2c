"""infermesh services: one sub-package per service, one process each."""
