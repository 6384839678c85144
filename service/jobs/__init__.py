"""The job domain: a job's spec and hyperparameters, what creation checks (``spec``), its memory
plan, its lifecycle (states, events, cancel, pause, resume), results and evaluations, the fleet
(workers' heartbeats, reconciling lost jobs), idempotent creation, the graders' dry runs and the
webhooks that tell users what happened."""
