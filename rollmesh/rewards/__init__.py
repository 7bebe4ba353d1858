"""rollmesh.rewards: what a reward sees, the built-in rewards, rewards by import path, and their
weighted combination.

Public names, by module (imported from their modules, so the math worker process started by
``math_answer`` loads nothing else of rollmesh): ``reward_input`` (``RewardInput``,
``RewardScore``, ``score_of``, ``ToolOutput``, ``FinishReason``), ``combined``
(``CombinedReward``, ``check_reward_specs``, ``load_reward``, ``reward_labels``), ``builtin``
(``BUILTIN_REWARDS``: ``math``, ``exact_match``, ``http``, ``judge``, ``code_tests``),
``math_answer`` (``MathChecker``, ``math_reward``), ``http_reward`` (``http_reward``),
``judge_reward`` (``judge_reward``), ``code_tests_reward`` (``code_tests_reward``,
``CodeSandboxes``), ``errors`` (``RewardError``, ``RewardInputError``, ``RewardLoadError``,
``RewardUnavailableError``). docs/task-plugins.md describes rewards.
"""
