"""The training engine: a job's loop (rollout, scoring, update) for RLOO, supervised and DPO, on one
device or several ranks, with torch alone. It imports no Celery, Redis, SQL or HTTP layer
(``tests/test_layout.py`` checks it by path): the Celery tier (``worker.jobs``) and ``rloo train``
(``worker.engine.standalone``) both drive it through ``train(config, recorder)``."""
