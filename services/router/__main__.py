"""``python -m services.router``: the routing service."""

from services.router.config import RouterConfig
from services.router.service import RouterService
from shared.runner import main

if __name__ == "__main__":
    main("router", RouterConfig, lambda config, bus: RouterService(bus, config))
