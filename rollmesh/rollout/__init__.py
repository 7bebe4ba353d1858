"""rollmesh.rollout: the agent loop, task plugins, tool runs and rollout state.

Public names, by module (imported from their modules, so a task plugin that imports ``tasks``
loads neither the engine nor torch): ``tasks`` (``Task``, ``DemonstrableTask``, ``RewardInput``,
``RewardScore``, ``SandboxCommand``, ``PythonTool``, ``ToolOutput``, ``TaskRegistry``,
``load_task``, ``TaskInputError``, ``UnknownTaskError``), ``agent_loop`` (``RolloutWorkerLogic``),
``trajectory`` (``RolloutTrajectory``), ``saved_state`` (``InMemoryRolloutStates``),
``molar_mass`` (``MolarMassTask``, the demo's task), ``dataset_task`` (``DatasetTask``, the
built-in task of RL stages on a dataset; its rewards are ``rollmesh.rewards``). docs/task-plugins.md describes the task API.
"""
