"""``python -m services.edge``: the OpenAI-compatible HTTP edge."""

from services.edge.config import EdgeConfig
from services.edge.service import EdgeService
from shared.runner import main

if __name__ == "__main__":
    main("edge", EdgeConfig, EdgeService)
