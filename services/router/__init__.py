"""Router service: picks the worker for each request (least-loaded now, KV-aware later)."""
