"""The HTTP API's bearer key as plain logic: where the key comes from, and the check itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollmesh.serve_apps import (
    ApiKeyRequiredError,
    AuthenticationError,
    InvalidApiKeyFileError,
    check_authorization,
    is_loopback,
    required_api_key,
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


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_on_loopback_without_security_no_key_is_needed(host: str) -> None:
    assert is_loopback(host)
    assert required_api_key("", {}, host=host, security_enabled=False) == ""


@pytest.mark.parametrize("host, security", [("0.0.0.0", False), ("::", False), ("10.1.2.3", False),
                                            ("head-node", False), ("127.0.0.1", True)])
def test_beyond_loopback_or_with_security_a_missing_key_stops_startup(host: str, security: bool) -> None:
    with pytest.raises(ApiKeyRequiredError, match="ROLLMESH_API_KEY"):
        required_api_key("", {}, host=host, security_enabled=security)
    assert required_api_key("", {"ROLLMESH_API_KEY": KEY}, host=host, security_enabled=security) == KEY


def test_keys_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    import hmac

    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", recording)
    check_authorization(f"Bearer {KEY}", KEY)
    with pytest.raises(AuthenticationError):
        check_authorization("Bearer sk-wrong", KEY)
    assert compared == [(KEY.encode(), KEY.encode()), (b"sk-wrong", KEY.encode())]
