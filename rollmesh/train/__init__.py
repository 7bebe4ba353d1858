"""Training jobs: ``rollmesh train RUN.toml`` runs a run file's ``[[stages]]`` on a mesh.

``rollmesh.training.prompt_ids`` names each prompt's group (there so that the supervised trainer
may use it: this package sits above the domain packages), ``feeder_cursor`` keeps the feeder's
place durably, ``feeder_window`` decides what to publish (plain logic), ``prompt_source`` turns a
position in a stage's data into a rollout's task input, ``feeder`` is the NATS shell that feeds an
RL stage, and ``job`` runs the stages on a mesh it starts or attaches to.
"""
