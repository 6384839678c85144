"""The training engine: a job's loop (rollout, scoring, update) for RLOO, supervised and DPO, on one
device or several ranks, with torch alone. It imports no Celery, Redis, SQL or HTTP layer (a remote
reward model's batch goes through ``service.infra.inference_bus``; ``tests/test_layout.py`` checks it by
path; a run of several ranks starts ``python -m worker.jobs.rank`` as processes). The Celery tier
(``worker.jobs``) and ``rloo train`` (``worker.engine.standalone``) both drive it through
``train(config, recorder)`` (``worker.engine.methods.rloo``).

Its folders: ``methods`` (the loops and their math), ``rollout`` (sampling, both backends),
``rewards`` (scoring a batch), ``distributed`` (ranks); beside them what every method shares: the
run's config and state, ``prepare`` (model, data, optimizer), ``loop`` (recording, checkpoints, the
end), ``data``, ``sequences``, ``samples``, ``metrics``, ``recorders``, ``modeling``,
``checkpoints``, ``resume``, ``overlap``, and ``standalone`` (``rloo train``)."""
