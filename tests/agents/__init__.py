"""The real coding-agent harnesses against the mesh: configuration, a recording proxy, fixtures (see harnesses.py)."""
