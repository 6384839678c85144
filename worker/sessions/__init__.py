"""The worker's Tinker tier: a training worker holding a Tinker training model for a session's
requests (the Celery task, the lease, each request's answer). The model itself is
``worker.engine.tinker``'s."""
