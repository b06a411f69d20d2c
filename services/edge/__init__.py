"""Edge service: the OpenAI-compatible HTTP API (Litestar) in front of the mesh."""
