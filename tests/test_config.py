"""The typed config (``load_config``: TOML, env overrides, validation). ``mesh.json``, the file
that says where a running mesh is: tests/test_mesh_address.py."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from rollmesh.chat import ChatModel
from rollmesh.config import (
    RUN_CONFIG_FILE,
    ConfigError,
    RollmeshConfig,
    TrainerConfig,
    load_config,
    load_run_config,
)
from rollmesh.model_source import DEMO_MODEL_DIR, ModelPathError, resolve_model

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "rollmesh.toml"
    path.write_text(text)
    return path


def test_default_config_runs_everything_on_one_machine():
    config = load_config(environ={})
    assert config.nats.url is None and config.ray.address is None  # embedded server, local Ray
    assert config.rollout.tasks == ["rollmesh.rollout.molar_mass:MolarMassTask",
                                    "rollmesh.rollout.dataset_task:DatasetTask"]


def test_a_file_sets_what_it_names_and_defaults_fill_the_rest(tmp_path):
    config = load_config(write_toml(tmp_path, 'namespace = "exp1"\n[trainer]\nn_samples_per_prompt = 4\n'), environ={})
    assert config.namespace == "exp1"
    assert config.trainer == TrainerConfig(n_samples_per_prompt=4)


def test_env_override_sets_a_field_parsed_as_a_toml_scalar(tmp_path):
    config = load_config(environ={"ROLLMESH_TRAINER__LR": "1e-3", "ROLLMESH_TRAINER__N_SAMPLES_PER_PROMPT": "4",
                                  "ROLLMESH_ROLLOUT__PROGRESS_EVENTS": "false",
                                  "ROLLMESH_ROLLOUT__TASKS": '["pkg.mod:Task"]'})
    assert config.trainer.lr == 1e-3
    assert config.trainer.n_samples_per_prompt == 4
    assert config.rollout.progress_events is False
    assert config.rollout.tasks == ["pkg.mod:Task"]


def test_env_override_that_is_not_toml_is_taken_as_a_string():
    config = load_config(environ={"ROLLMESH_NATS__URL": "nats://10.0.0.5:4222"})
    assert config.nats.url == "nats://10.0.0.5:4222"


def test_env_override_reaches_a_nested_table():
    config = load_config(environ={"ROLLMESH_SCHEDULER__GRANTS__RESHARDER": "0.5"})
    assert config.scheduler.grants["resharder"] == 0.5


def test_env_variables_without_the_prefix_or_a_section_are_ignored():
    assert load_config(environ={"TRAINER__LR": "oops", "ROLLMESH_HOME": "/x"}) == load_config(environ={})


def test_load_config_reads_os_environ_when_no_environ_is_given(monkeypatch):
    monkeypatch.setitem(os.environ, "ROLLMESH_TRAINER__MAX_STALENESS", "5")
    assert load_config().trainer.max_staleness == 5


def test_explicit_overrides_win_over_env():
    config = load_config(environ={"ROLLMESH_TRAINER__LR": "1e-3"}, overrides={"trainer.lr": 5e-4})
    assert config.trainer.lr == 5e-4


@pytest.mark.parametrize("environ", [
    pytest.param({"ROLLMESH_TRAINER__LEARNING_RATE": "1e-3"}, id="unknown field"),
    pytest.param({"ROLLMESH_TRAINERS__LR": "1e-3"}, id="unknown section"),
    pytest.param({"ROLLMESH_TRAINER__LR": "-1"}, id="out of range"),
    pytest.param({"ROLLMESH_TRAINER__N_SAMPLES_PER_PROMPT": "eight"}, id="wrong type"),
])
def test_a_bad_env_override_is_a_config_error(environ):
    with pytest.raises(ConfigError):
        load_config(environ=environ)


def test_an_unknown_field_in_the_file_is_a_config_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="learning_rate") as raised:
        load_config(write_toml(tmp_path, "[trainer]\nlearning_rate = 1e-3\n"), environ={})
    assert raised.value.source == str(tmp_path / "rollmesh.toml")


def test_config_error_path_names_the_offending_field(tmp_path):
    with pytest.raises(ConfigError) as raised:
        load_config(write_toml(tmp_path, "[trainer]\nlr = -1.0\n"), environ={})
    # ConfigError's docstring promises "path names the offending field"; load_config never sets it.
    assert "trainer" in raised.value.path, f"ConfigError.path is {raised.value.path!r}"


def test_an_override_below_a_scalar_field_is_a_config_error_not_a_crash():
    # A typo like ROLLMESH_TRAINER__LR__MAX must be reported like any other bad override.
    with pytest.raises(ConfigError):
        load_config(environ={"ROLLMESH_TRAINER__LR__MAX": "1"})


@pytest.mark.parametrize("text", ["[trainer\n", 'namespace = "a"\nnamespace = "b"\n'])
def test_a_file_that_is_not_valid_toml_is_a_config_error(tmp_path, text):
    with pytest.raises(ConfigError):
        load_config(write_toml(tmp_path, text), environ={})


def test_a_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="missing.toml"):
        load_config(tmp_path / "missing.toml", environ={})


def test_config_is_frozen():
    config = RollmeshConfig()
    with pytest.raises(AttributeError):
        config.trainer.lr = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(("section", "key", "value", "replacement"), [
    ("trainer", "group_size", "8", "trainer.n_samples_per_prompt"),
    ("trainer", "train_truncated", "false", "trainer.overlong"),
    ("demo", "prefetch_steps", "2", "max_groups_ahead"),
])
def test_a_renamed_key_is_a_config_error_naming_its_one_new_name(tmp_path, section, key, value, replacement):
    path = write_toml(tmp_path, f"[{section}]\n{key} = {value}\n")
    with pytest.raises(ConfigError, match=f"{section}.{key} is gone: use {replacement}") as raised:
        load_config(path, environ={})
    assert raised.value.path == f"{section}.{key}"


# --- the model -------------------------------------------------------------------------------

@pytest.mark.parametrize(("key", "value", "replacement"), [
    ("hf_path", '"/models/qwen"', "model.path"),
    ("family", '"hf"', "model.path"),
    ("d_model", "64", "config.json"),
    ("max_seq_len", "512", "config.json"),
    ("seed", "3", "demo.seed"),
])
def test_a_retired_model_key_in_the_file_is_a_config_error_naming_its_replacement(tmp_path, key, value,
                                                                                   replacement):
    path = write_toml(tmp_path, f"[model]\n{key} = {value}\n")
    with pytest.raises(ConfigError, match=f"model.{key} is gone: use .*{replacement}") as raised:
        load_config(path, environ={})
    assert raised.value.path == f"model.{key}" and raised.value.source == str(path)


def test_a_retired_model_key_from_the_environment_is_a_config_error_naming_the_variable():
    with pytest.raises(ConfigError, match="model.hf_path is gone: use model.path") as raised:
        load_config(environ={"ROLLMESH_MODEL__HF_PATH": "/models/qwen"})
    assert raised.value.source == "ROLLMESH_MODEL__HF_PATH" and raised.value.path == "model.hf_path"


def test_a_retired_model_key_in_a_saved_run_config_is_a_config_error(tmp_path):
    (tmp_path / RUN_CONFIG_FILE).write_text('{"model": {"hf_path": "/models/qwen"}}')
    with pytest.raises(ConfigError, match="model.hf_path is gone: use model.path"):
        load_run_config(tmp_path)


def test_the_deprecated_work_heartbeat_key_warns_and_the_keepalive_follows_the_ack_wait(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[rollout]\nwork_heartbeat_s = 1.5\n")
    with pytest.warns(DeprecationWarning, match="rollout.work_heartbeat_s is deprecated and ignored"):
        config = load_config(path, environ={})
    assert not hasattr(config.rollout, "work_heartbeat_s")


def test_a_saved_run_config_with_the_deprecated_work_heartbeat_key_still_loads(tmp_path):
    (tmp_path / RUN_CONFIG_FILE).write_text('{"rollout": {"work_heartbeat_s": 15.0}}')
    with pytest.warns(DeprecationWarning, match="rollout.work_heartbeat_s"):
        load_run_config(tmp_path)


@pytest.mark.parametrize(("old", "new", "value"), [
    ("elastic_decode", "decode_loans", 2),
    ("elastic_drain_s", "decode_loan_drain_s", 0.5),
])
def test_a_renamed_scheduler_key_in_the_file_warns_and_sets_its_new_name(tmp_path, old, new, value):
    path = write_toml(tmp_path, f"[scheduler]\n{old} = {value}\n")
    with pytest.warns(DeprecationWarning, match=f"scheduler.{old} is now scheduler.{new}"):
        config = load_config(path, environ={})
    assert getattr(config.scheduler, new) == value
    with pytest.warns(DeprecationWarning, match=f"is now {new}"):
        assert getattr(config.scheduler, old) == value  # the old attribute reads it too, warning


def test_a_renamed_key_from_the_environment_warns_naming_the_variable():
    with pytest.warns(DeprecationWarning, match="ROLLMESH_SCHEDULER__ELASTIC_DECODE: scheduler.elastic_decode"):
        config = load_config(environ={"ROLLMESH_SCHEDULER__ELASTIC_DECODE": "3"})
    assert config.scheduler.decode_loans == 3


def test_a_renamed_key_in_a_saved_run_config_is_read_as_its_new_name(tmp_path):
    (tmp_path / RUN_CONFIG_FILE).write_text('{"scheduler": {"elastic_decode": 1}}')
    with pytest.warns(DeprecationWarning, match="scheduler.elastic_decode is now scheduler.decode_loans"):
        assert load_run_config(tmp_path).scheduler.decode_loans == 1


def test_a_key_set_under_both_its_old_and_new_name_is_a_config_error(tmp_path):
    path = write_toml(tmp_path, "[scheduler]\nelastic_decode = 1\ndecode_loans = 2\n")
    with pytest.raises(ConfigError, match="both set") as raised:
        load_config(path, environ={})
    assert raised.value.path == "scheduler.elastic_decode"


def test_an_empty_model_path_resolves_to_the_demo_model_built_in_the_run_directory(tmp_path):
    config = load_config(environ={})  # no ROLLMESH_MODEL__PATH: the embedded default
    assert config.model.path == ""
    resolved = resolve_model(config, tmp_path / "run")
    assert resolved.model.path == str((tmp_path / "run" / DEMO_MODEL_DIR).absolute())
    assert ChatModel.from_config(resolved.model).end_of_turn_ids  # a model directory with its tokenizer
    assert resolved.model.path == resolve_model(config, tmp_path / "run").model.path  # kept on resume
    assert msgspec.structs.replace(resolved, model=config.model) == config  # nothing else changes


def test_a_relative_model_path_is_made_absolute_and_a_directory_without_a_model_refused(
        tmp_path, monkeypatch, demo_model_dir):
    monkeypatch.chdir(demo_model_dir.parent)
    config = load_config(environ={"ROLLMESH_MODEL__PATH": demo_model_dir.name})
    assert resolve_model(config, tmp_path).model.path == str(demo_model_dir)
    with pytest.raises(ModelPathError, match="no config.json") as raised:
        resolve_model(load_config(environ={"ROLLMESH_MODEL__PATH": str(tmp_path)}), tmp_path)
    assert raised.value.path == str(tmp_path)


def test_the_megatron_layout_is_a_nested_table_and_its_world_is_tp_x_pp_x_dp(tmp_path):
    path = tmp_path / "megatron.toml"
    path.write_text('[model]\npath = "/models/qwen"\n[trainer]\nbackend = "megatron"\n'
                    "[trainer.megatron]\ntensor_parallel = 2\npipeline_parallel = 2\ndata_parallel = 4\n"
                    "expert_parallel = 2\ndistributed_optimizer = true\n")
    config = load_config(path, environ={})
    assert config.trainer.backend == "megatron" and config.trainer.megatron.world_size == 16
    assert config.model.path == "/models/qwen"


def test_the_megatron_backend_takes_the_default_demo_model():
    # Before the demo model was a Hugging Face directory, megatron refused it; every model is one now.
    config = load_config(environ={"ROLLMESH_TRAINER__BACKEND": "megatron"})
    assert config.trainer.backend == "megatron" and config.model.path == ""


@pytest.mark.parametrize(("text", "message"), [
    ('[trainer]\noptimizer_offload = true\n', "optimizer_offload needs"),
    ('[trainer]\nbackend = "megatron"\nprecision = "bf16"\noptimizer_offload = true\n'
     "[trainer.megatron]\ndistributed_optimizer = true\n", "does not combine"),
    ("[trainer.megatron]\ndata_parallel = 3\nexpert_parallel = 2\n", "expert_parallel must divide"),
])
def test_trainer_settings_that_cannot_run_together_are_config_errors(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path, environ={})
