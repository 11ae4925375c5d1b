"""API keys of `mimir serve` (mimir_megatron/inference/api_keys.py): the constant-time check by
construction, where keys come from, and the command lines that must not carry or lose one.

The check's behaviour against real clients is in tests/integration/test_serve_clients.py; the
served process (its log, its `ps` line) in tests/integration/test_serve.py."""

from __future__ import annotations

import hmac
import logging

import pytest

from mimir_megatron import user_config
from mimir_megatron.cli import main
from mimir_megatron.errors import UserError
from mimir_megatron.inference import api_keys
from mimir_megatron.inference.api_keys import ApiKeys, Endpoint, client_key, read_key_file, server_keys

KEYS = ["k-first-0123456789abcdef", "k-second-0123456789abcdef", "k-third-0123456789abcdef"]


@pytest.fixture
def compares(monkeypatch):
    """Every call of hmac.compare_digest the key check makes, as (presented, stored) digests."""
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counted(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(api_keys.hmac, "compare_digest", counted)
    return calls


@pytest.mark.parametrize("presented", [KEYS[0], KEYS[2], "k-wrong-0123456789abcdef", "", None])
def test_the_check_compares_with_every_key_in_constant_time_whatever_is_presented(compares, presented):
    keys = ApiKeys(KEYS)
    assert keys.accepts(presented) is (presented in KEYS)
    # one compare_digest per key, no early exit at a match, always over equal-length digests
    assert len(compares) == len(KEYS)
    assert {len(a) for a, _ in compares} | {len(b) for _, b in compares} == {32}
    assert len({b for _, b in compares}) == len(KEYS)


def test_keys_are_kept_as_digests_and_never_shown():
    keys = ApiKeys(KEYS)
    assert repr(keys) == "ApiKeys(3 keys)"
    assert not any(k.encode() in b"".join(keys._digests) for k in KEYS)
    endpoint = Endpoint("http://127.0.0.1:1/v1/", KEYS[0])
    assert KEYS[0] not in repr(endpoint) and endpoint.base_url == "http://127.0.0.1:1/v1"
    assert endpoint.headers == {"Authorization": f"Bearer {KEYS[0]}"}
    assert Endpoint.of("http://h/v1").headers == {} and Endpoint.of("http://h/v1").sdk_key == "EMPTY"


def test_key_file_lines_comments_and_the_environment(tmp_path, caplog):
    path = tmp_path / "keys"
    path.write_text(f"# team keys\n\n{KEYS[0]}\n  {KEYS[1]}  \n")
    path.chmod(0o600)
    with caplog.at_level(logging.WARNING):
        keys = server_keys(path, {"MIMIR_API_KEY": KEYS[2]})
    assert len(keys) == 3 and all(keys.accepts(k) for k in KEYS) and not keys.accepts("# team keys")
    assert not caplog.records
    assert server_keys(None, {}) is None
    assert client_key(path, {"MIMIR_API_KEY": KEYS[2]}) == KEYS[0]  # the file's first key wins
    assert client_key(None, {"MIMIR_API_KEY": f" {KEYS[2]}\n"}) == KEYS[2]
    assert client_key(None, {}) is None


def test_bad_key_sources_are_one_line_without_the_key(tmp_path, caplog):
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    with pytest.raises(UserError, match="holds no key"):
        read_key_file(empty)
    with pytest.raises(UserError, match="no such file"):
        read_key_file(tmp_path / "missing")
    with pytest.raises(UserError, match="MIMIR_API_KEY is set but empty"):
        server_keys(None, {"MIMIR_API_KEY": " "})
    open_file = tmp_path / "open"
    open_file.write_text("short\n")
    open_file.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        server_keys(open_file, {})
    said = caplog.text
    assert "may be read by other users (mode 0644): chmod 600" in said and "shorter than 16" in said
    assert "short" not in said.replace("shorter", "")


def test_a_key_on_the_command_line_is_refused_without_repeating_it(capsys):
    secret = "sk-on-the-command-line-0123456789"
    for argv in (["serve", "--weights", "w", "--api-key", secret], ["serve", "--weights", "w", f"--api-key={secret}"],
                 ["eval", "--base-url", "http://h/v1", "--suite", "s.yaml", "--api-key", secret]):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert "would show the key to every user of this machine" in err and secret not in err


def test_serve_refuses_a_network_address_without_a_key_before_loading_anything(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("MIMIR_API_KEY", raising=False)
    (tmp_path / "empty").mkdir()
    missing = str(tmp_path / "empty")  # a directory, but no model in it

    def said(argv: list[str]) -> tuple[int, str]:
        caplog.clear()
        return main(argv), caplog.text

    rc, text = said(["serve", "--weights", missing, "--host", "0.0.0.0"])
    assert rc == 2 and "--host 0.0.0.0 without an API key would serve the model to anyone" in text
    key_file = tmp_path / "key"
    key_file.write_text(KEYS[0] + "\n")
    key_file.chmod(0o600)
    rc, text = said(["serve", "--weights", missing, "--host", "0.0.0.0", "--api-key-file", str(key_file),
                     "--allow-unauthenticated"])
    assert rc == 2 and "give one or the other" in text
    # with a key (or said explicitly) the address is accepted: the next complaint is the model's
    for extra in (["--api-key-file", str(key_file)], ["--allow-unauthenticated"]):
        rc, text = said(["serve", "--weights", missing, "--host", "0.0.0.0", *extra])
        assert rc == 2 and "model.yaml" in text and "would serve the model" not in text
        assert KEYS[0] not in text


def test_eval_takes_a_key_file_only_for_a_running_server(tmp_path, caplog):
    key_file = tmp_path / "key"
    key_file.write_text(KEYS[0] + "\n")
    assert main(["eval", "--weights", str(tmp_path), "--suite", "s.yaml", "--api-key-file", str(key_file)]) == 2
    assert "--api-key-file is the key of a running server (--base-url)" in caplog.text


def test_the_users_own_key_is_made_once_private_and_then_reused(tmp_path):
    """`mimir serve` given no key on loopback: the user's own key file, made with a fresh key (mode
    600, folder 700, under $XDG_CONFIG_HOME), then the same key at every later start."""
    import stat

    environ = {"XDG_CONFIG_HOME": str(tmp_path / "config")}
    keys, path, made = api_keys.own_keys(environ)
    assert made and path == tmp_path / "config" / "mimir" / "api-key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    key = path.read_text().strip()
    assert len(key) >= 40 and keys.accepts(key) and not keys.accepts(key[:-1])
    again, same_path, made_again = api_keys.own_keys(environ)
    assert not made_again and same_path == path and again.accepts(key) and path.read_text().strip() == key


def test_serve_without_a_key_serves_behind_the_users_own_and_unauthenticated_only_when_said(
        tmp_path, monkeypatch, caplog):
    from mimir_megatron.inference import loading, server

    monkeypatch.delenv("MIMIR_API_KEY", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    served: dict = {}
    monkeypatch.setattr(loading, "load_engine", lambda **kw: type("Engine", (), {"logprobs_mode": "raw"})())
    monkeypatch.setattr(server, "serve", lambda engine, **kw: served.update(kw))
    caplog.set_level(logging.INFO)
    assert main(["serve", "--weights", str(tmp_path)]) == 0
    key = (tmp_path / "mimir" / "api-key").read_text().strip()
    assert served["api_keys"].accepts(key) and not served["api_keys"].accepts("EMPTY")
    assert str(tmp_path / "mimir" / "api-key") in caplog.text and key not in caplog.text
    assert main(["serve", "--weights", str(tmp_path), "--allow-unauthenticated"]) == 0
    assert served["api_keys"] is None and "every user of this machine may use the model" in caplog.text


def test_two_servers_making_the_key_at_once_share_the_first_one(tmp_path, monkeypatch):
    """Another server links its key into place between our check and our link: ours is dropped,
    the first one is used, and no draft is left behind."""
    import os

    environ = {"XDG_CONFIG_HOME": str(tmp_path)}
    path = api_keys.own_key_file(environ)
    real_link = os.link

    def another_server_first(src, dst):
        path.write_text(KEYS[0] + "\n")
        path.chmod(0o600)
        return real_link(src, dst)

    monkeypatch.setattr(user_config.os, "link", another_server_first)
    keys, _, made = api_keys.own_keys(environ)
    assert not made and keys.accepts(KEYS[0]) and path.read_text() == KEYS[0] + "\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["api-key"]
