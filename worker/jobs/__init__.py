"""The Celery tier of the training worker: the tasks (``tasks``, which turn a job row into the
engine's config), the message guard (``requests``) and the broker's transport (``broker``), its
results recorded in the database (``database_recorder``), a job's ranks (``rank``), failures, dry
runs of graders, the host's devices and the worker's metrics server."""
