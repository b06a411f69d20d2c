"""Worker service: one inference engine in a role (prefill, decode, or both) on the bus."""
