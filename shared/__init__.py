"""Code shared by every infermesh service: bus schema, subjects, bus layer, config, telemetry."""
