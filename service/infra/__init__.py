"""The machinery under the domain: artifacts on disk or S3, the Celery task queue, the inference
bus over Redis, wake-ups, the embedded Redis of ``rloo up``, the egress rules and the one outbound
HTTP client with a total deadline."""
