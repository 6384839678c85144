"""rloo-service: the HTTP API, settings and database layer. Never imports torch."""
