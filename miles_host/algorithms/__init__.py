"""RL math of miles: advantage estimators, KL estimators, policy losses, off-policy corrections.

Each algorithm is a small pure function in a dict registry (``ADVANTAGE_ESTIMATORS``,
``KL_ESTIMATORS``, ``POLICY_LOSSES``, ``LOSS_AGGREGATIONS``, ``CORRECTIONS``); the host's
built-in plugin registers them, and plugins add their own through the same hooks.
"""
