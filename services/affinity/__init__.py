"""Session affinity: session -> decode worker bindings shared by every edge and router replica."""
