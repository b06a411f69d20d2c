"""``python -m services.worker``: one engine (sim or vllm) on the bus."""

from services.worker.config import WorkerConfig
from services.worker.service import WorkerService
from shared.runner import main

if __name__ == "__main__":
    main("worker", WorkerConfig, WorkerService)
