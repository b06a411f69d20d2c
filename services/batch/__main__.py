"""``python -m services.batch``: batch jobs from /v1/batches and the bus, run on idle capacity."""

from services.batch.config import BatchConfig
from services.batch.service import BatchService
from shared.runner import main

if __name__ == "__main__":
    main("batch", BatchConfig, lambda config, bus: BatchService(bus, config))
