"""``python -m services.breaker``: the shared circuit breaker."""

from services.breaker.config import BreakerConfig
from services.breaker.service import BreakerService
from shared.runner import main

if __name__ == "__main__":
    main("breaker", BreakerConfig, lambda config, bus: BreakerService(bus, config))
