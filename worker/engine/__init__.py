"""The training engine: a job's loop (rollout, scoring, update) for RLOO, supervised and DPO, on one
device or several ranks, with torch alone. It imports no Celery, SQL or HTTP layer, and Redis only
inside the function that sends a remote reward model's batch (``tests/test_layout.py`` checks it by
path; a run of several ranks starts ``python -m worker.jobs.rank`` as processes). The Celery tier
(``worker.jobs``) and ``rloo train`` (``worker.engine.standalone``) both drive it through
``train(config, recorder)``."""
