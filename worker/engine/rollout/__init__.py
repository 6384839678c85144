"""Rollouts: k sampled completions a prompt and their token log-probs. ``base`` holds what both
backends share and the transformers backend, ``vllm_backend`` the vLLM one, ``backends`` the choice
between them (``RLOO_ROLLOUT_BACKEND``)."""
