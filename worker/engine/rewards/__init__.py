"""Scoring completions: ``scoring`` runs the job's grader over a batch (reward models batched here),
``shared_prefix`` reads each prompt once for its k completions, ``remote`` sends a reward model's
batch to the inference workers."""
