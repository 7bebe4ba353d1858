"""rollmesh.rollout: the agent loop, task plugins, tool runs and rollout state.

Public names, by module (imported from their modules, so a task plugin that imports ``tasks``
loads neither the engine nor torch): ``tasks`` (``Task``, ``DemonstrableTask``, ``Conversation``,
``SandboxCommand``, ``PythonTool``, ``ToolOutput``, ``TaskRegistry``, ``load_task``,
``TaskInputError``, ``UnknownTaskError``), ``agent_loop`` (``RolloutRunner``), ``trajectory``
(``RolloutTrajectory``), ``rollout_state`` (``InMemoryRolloutStates``), ``molar_mass``
(``MolarMassTask``, the demo's task). docs/task-plugins.md describes the task API.
"""
