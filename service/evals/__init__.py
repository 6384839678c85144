"""OpenAI's Evals API on our graders and models: an eval (what an item is, how an answer is judged)
and its runs (items from a file or inline, answered by one of the project's models or read from the
lines, graded by the eval's testing criteria on the inference workers). A run is a row of the
evaluation engine that also scores a job's checkpoints (``worker.serving.evaluate``): one engine.

``criteria``: testing criteria, parsed by the graders' own parser, each with its pass threshold.
``spec``: an eval's ``data_source_config`` and a run's ``data_source``, checked as the API takes them.
``items``: a run's items, read and checked against the eval's ``item_schema``; prompts rendered.
``runs``: a run's ends by the tenant's hand (cancel, its file or model deleted), and its webhooks.
"""
