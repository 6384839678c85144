"""rloo-service worker: the Celery app, the RLOO loop and the ``rloo`` CLI."""

import os

# Model loading and saving draw progress bars per shard; in a worker log they are noise.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
