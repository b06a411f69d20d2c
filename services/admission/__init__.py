"""Admission: leases on a model pool's capacity, fair between teams, granted before a request is routed."""
