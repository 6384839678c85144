"""The training methods, one loop a module: ``rloo`` (reinforcement: rollout, scoring, the RLOO
update), ``supervised`` and ``dpo``; ``policy_gradient`` holds their shared math (the advantage
estimators, KL, the clipped policy loss), pure tensor functions."""
