"""The shared circuit breaker: per-worker state from request outcomes, in a KV bucket every router and edge watches."""
