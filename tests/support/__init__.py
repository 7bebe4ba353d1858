"""What the tests share that is not itself a test: fakes, model and checkpoint builders, servers
and clusters the tests run against, task plugins and rewards that the session mesh imports.

Imported as ``support.<module>``: pytest puts tests/ on ``sys.path`` (the rootdir conftest), and
the Ray the tests start gives its workers the same path (``conftest.ray_session``), so actors and
config import paths ("support.mesh_test_tasks:GatedMolarMassTask") find these modules too.

- ``fakes``: the true edges' fakes, one class per edge; ``sglang_fake`` and
  ``sglang_weight_server``: SGLang's HTTP API and its weight-update side.
- Models: ``chat_models`` (per chat family), ``engine_models`` (the demo model as the engine
  runs it), ``fitted_models``, ``hf_llamas``, ``moe_models``, ``serve_models``.
- Megatron: ``megatron_checkpoints`` (real checkpoints on CPU) and ``megatron_backend_worker``
  (the trainer backend on gloo ranks); both also run as scripts.
- Infrastructure: ``nats_cluster``, ``nats_jwt``, ``ray_actors``, ``cluster_brokers`` (a script),
  ``oci_images``, ``sandbox_helpers``, ``reward_servers``.
- Loaded by import path: ``mesh_test_tasks``, ``cluster_test_tasks``, ``eval_test_rewards``.
- ``waiting``: ``wait_until`` a condition that no event announces, with a generous timeout.
"""
