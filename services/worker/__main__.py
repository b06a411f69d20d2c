"""``python -m services.worker``: one engine (sim or vllm) on the bus, or several sim engines."""

from services.worker.config import WorkerConfig
from services.worker.group import build_worker
from shared.runner import main

if __name__ == "__main__":
    main("worker", WorkerConfig, build_worker)
