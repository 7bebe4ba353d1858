"""rollmesh.rewards: what a reward sees, the built-in rewards, rewards by import path, and their
weighted combination.

Public names, by module (imported from their modules, so the math worker process started by
``math_answer`` loads nothing else of rollmesh): ``reward_input`` (``RewardInput``,
``RewardScore``, ``score_of``, ``ToolOutput``, ``FinishReason``), ``combined``
(``CombinedReward``, ``check_reward_specs``, ``load_reward``, ``reward_labels``), ``builtin``
(``BUILTIN_REWARDS``: ``math``, ``exact_match``), ``math_answer`` (``MathChecker``,
``math_reward``), ``errors`` (``RewardError``, ``RewardInputError``, ``RewardLoadError``,
``RewardUnavailableError``). docs/task-plugins.md describes rewards.
"""
