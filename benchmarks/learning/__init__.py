"""Does RLOO's baseline earn its keep, and which of the field's options help? The learning benchmark
(``make bench-learning``, ``python -m benchmarks.learning``), on tasks a tiny model really learns
(``examples/addition``: two-digit sums), built offline in a home of its own.

* ``grid`` (``grid``, ``analysis``): runs of ``rloo train``'s own path, 10 seeds per arm, each
  scored without sampling noise (``scoring``: the exact expected accuracy of one sample, and the
  greedy accuracy) every 100 steps. Arms: each advantage estimator (``rloo``, ``grpo``,
  ``reinforce``, ``reinforce_mean``) at three learning rates; RLOO under each ``loss_aggregation``;
  RLOO with ``drop_constant_groups``; and a copy of the default arm on other seeds, identical by
  construction, whose difference from it is the noise floor. On two tasks (``tasks``): the exact
  sum (reward 0/1) and a graded similarity to it (reward in [0, 1]).
* ``variance`` (``variance``): at fixed weights along an RLOO run, each estimator's gradient
  variance, bias and scale over 128 fresh batches, the reward-offset experiment, the constant
  baseline that would minimise the variance, and how far each update goes along the true gradient
  (clipped, and Adam-preconditioned).
* ``trl`` (``trl_check``): TRL's ``RLOOTrainer`` and this engine on the same weights and the same
  rollouts: advantages and gradients compared, number by number.
* ``api`` (``api``): the RLOO seed-0 job through the HTTP API against the same run in-process.

Figures go to stdout and ``benchmarks/learning.json``; the picture to ``benchmarks/learning.png``;
``benchmarks/RESULTS.md`` section 8 reads them. Finished runs are kept under ``--cache``
(``var/bench-learning``): a rerun, or a grid stopped half way, takes them from there.
"""
