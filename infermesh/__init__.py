"""infermesh: an event-driven inference mesh over NATS with OpenAI-compatible endpoints."""

__version__ = "0.1.0"
