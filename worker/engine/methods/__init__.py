"""The training methods, one loop a module: ``rloo`` (reinforcement: rollout, scoring, and its
update in ``rloo_update``), ``supervised`` and ``dpo``; ``policy_gradient`` holds their shared math (the advantage
estimators, KL, the clipped policy loss), pure tensor functions."""
