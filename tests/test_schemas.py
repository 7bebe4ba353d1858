"""The committed JSON Schemas (docs/schemas/) and docs/wire-contract.md's table are exactly what
scripts/generate_schemas.py writes now, so neither can go stale; and they accept what the
subjects accept."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import msgspec
import pytest

from rollmesh.messages.subjects import ALL_SUBJECTS, ROLLOUT_REQUESTED

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

REPO_ROOT = Path(__file__).resolve().parent.parent
SCHEMA_DIR = REPO_ROOT / "docs" / "schemas"


def load_generator():
    spec = importlib.util.spec_from_file_location("generate_schemas", REPO_ROOT / "scripts" / "generate_schemas.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def schema(name: str) -> dict:
    return json.loads((SCHEMA_DIR / name).read_text())


def test_committed_schemas_and_contract_table_are_what_the_script_generates():
    # In a fresh interpreter, as `make schemas` runs it: the suite's other tests load plugins and
    # libraries into this one, and what the files must equal is the script's own output.
    check = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "generate_schemas.py"), "--check"],
                           capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert check.returncode == 0, f"run `make schemas` and commit the result: {check.stdout}{check.stderr}"


def test_every_subject_and_reply_has_a_valid_json_schema_naming_its_contract():
    generator = load_generator()
    for subject in ALL_SUBJECTS:
        message_file, reply_file = generator.schema_file_names(subject)
        for name, struct, role in [(message_file, subject.type, "message"),
                                   *([(reply_file, subject.reply_type, "reply")] if reply_file else [])]:
            document = schema(name)
            jsonschema.Draft202012Validator.check_schema(document)
            assert document["x-rollmesh"]["struct"] == struct.__name__
            assert document["x-rollmesh"]["encoding"] == subject.encoding
            assert document["x-rollmesh"]["role"] == role


def test_a_hand_written_request_is_accepted_by_the_schema_and_the_subject():
    request = {"type": "rollout.requested", "rollout_id": "doc-1", "task": "molar_mass",
               "task_input": {"formula": "H2O"}, "purpose": "eval",
               "sampling": {"temperature": 0.7, "max_new_tokens": 40}, "max_turns": 3}
    jsonschema.validate(request, schema("rollout.requested.json"))
    decoded = ROLLOUT_REQUESTED.decode(json.dumps(request).encode())
    assert decoded.rollout_id == "doc-1" and decoded.sampling.temperature == 0.7
    assert json.loads(ROLLOUT_REQUESTED.encode(decoded)) == {**msgspec.to_builtins(decoded), "type": "rollout.requested"}


@pytest.mark.parametrize("bad", [
    {"rollout_id": "", "task": "molar_mass"},                   # empty id
    {"rollout_id": "x", "task": "molar_mass", "max_turns": 0},  # below the minimum
    {"rollout_id": "x", "task": "molar_mass", "purpose": "sometimes"},
    {"rollout_id": "x", "task": "molar_mass", "sampling": {"top_p": 0}},
    {"task": "molar_mass"},                                     # no id
])
def test_a_bad_request_is_refused_by_both_the_schema_and_the_subject(bad):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"type": "rollout.requested", **bad}, schema("rollout.requested.json"))
    with pytest.raises(msgspec.ValidationError):
        ROLLOUT_REQUESTED.decode(json.dumps(bad).encode())
