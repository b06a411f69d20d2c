"""``python -m services.admission``: leases on each model pool's capacity."""

from services.admission.config import AdmissionConfig
from services.admission.service import AdmissionService
from shared.runner import main

if __name__ == "__main__":
    main("admission", AdmissionConfig, lambda config, bus: AdmissionService(bus, config))
