"""``python -m services.metering``: the usage ledger, keys and budgets onto the bus, the billing API."""

from services.metering.config import MeteringConfig
from services.metering.service import MeteringService
from shared.runner import main

if __name__ == "__main__":
    main("metering", MeteringConfig, lambda config, bus: MeteringService(bus, config))
