"""The Celery tier of the training worker: the tasks (``tasks``; ``job_config`` turns a job row into
the engine's config), the worker's start (``celery_worker``), the reconciler beside it
(``reconciler``), when pool processes import torch (``preload``), the message guard
(``message_guard``) and the broker's transport (``broker``), results recorded in the database
(``database_recorder``), a job's ranks (``rank``), failures, dry runs of graders, the host's devices
and the worker's metrics server."""
