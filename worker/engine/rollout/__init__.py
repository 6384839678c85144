"""Rollouts: k sampled completions a prompt and their token log-probs. ``base`` holds what both
backends and the training loops share (the rollout's layout, the sampling math, log-probs),
``transformers_backend`` the policy sampling itself, ``vllm_backend`` vLLM, ``backends`` the choice
between them (``RLOO_ROLLOUT_BACKEND``)."""
