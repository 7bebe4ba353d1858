"""The HTTP API's bearer key as plain logic: where the key comes from, and the check itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollmesh.serve_apps import (
    AuthenticationError,
    InvalidApiKeyFileError,
    check_authorization,
    resolve_api_key,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

KEY = "sk-local-123"


def test_no_key_configured_lets_every_request_through() -> None:
    check_authorization(None, "")
    check_authorization("Bearer anything", "")


def test_the_right_bearer_key_passes() -> None:
    check_authorization(f"Bearer {KEY}", KEY)
    check_authorization(f"bearer  {KEY} ", KEY)


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", f"Basic {KEY}", KEY,
                                    "Bearer sk-local-12", f"Bearer {KEY}x"])
def test_a_missing_or_wrong_key_is_refused_with_401_and_no_key_in_the_message(
    header: str | None,
) -> None:
    with pytest.raises(AuthenticationError) as raised:
        check_authorization(header, KEY)
    error = raised.value
    assert error.status == 401
    assert error.code == "invalid_api_key"
    assert error.to_response().error.type == "invalid_request_error"
    assert KEY not in error.message


def test_the_environment_wins_over_the_key_file(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert resolve_api_key(str(key_file), {"ROLLMESH_API_KEY": "from-env"}) == "from-env"
    assert resolve_api_key(str(key_file), {}) == "from-file"
    assert resolve_api_key("", {}) == ""


@pytest.mark.parametrize("contents", [None, "  \n"])
def test_an_unreadable_or_empty_key_file_is_an_error(tmp_path: Path, contents: str | None) -> None:
    key_file = tmp_path / "key"
    if contents is not None:
        key_file.write_text(contents)
    with pytest.raises(InvalidApiKeyFileError):
        resolve_api_key(str(key_file), {})
