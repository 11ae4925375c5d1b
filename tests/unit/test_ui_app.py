"""`mimir ui`'s server app: MLflow's page with the browser defaults that open the training view
(the browser check itself: tests/system/test_ui_browser.py)."""

from __future__ import annotations

import json
import re

from mimir_megatron.ops import ui, ui_app


def test_the_page_sets_the_browser_defaults_before_mlflows_script():
    page = ui_app.with_training_view('<html><head><title>MLflow</title><script defer="defer" src="m.js">'
                                     '</script></head></html>')
    assert page.index("<script>try{") < page.index("<script defer") and page.count("<script>try{") == 1
    defaults = json.loads(re.search(r"var d=(\{.*?\});", page).group(1))
    assert json.loads(defaults["mlflow.workflowType_v1"]) == "machine_learning"
    assert json.loads(defaults["mlflow.assistant.fab.autoOpenedOnFirstLoad_v1"]) is True
    assert "getItem(k)===null" in page  # a choice the user made stands


def test_a_page_without_scripts_still_gets_the_defaults_first():
    assert ui_app.with_training_view("<html><head></head></html>").startswith("<html><head><script>try{")


def test_mimir_ui_runs_mlflow_with_the_app(tmp_path):
    (tmp_path / "mlflow.db").write_bytes(b"")
    cmd = ui.ui_command(str(tmp_path), None, None, port=5999)
    assert cmd[cmd.index("--app-name") + 1] == "mimir" == ui_app.APP_NAME
    assert ui.start_url("http://127.0.0.1:5999", f"sqlite:///{tmp_path / 'none.db'}") == \
        "http://127.0.0.1:5999/#/experiments?workflowType=machine_learning"


def test_the_login_is_made_once_private_and_repaired_when_opened_up(tmp_path, caplog):
    import stat

    from mimir_megatron.errors import UserError
    from mimir_megatron.ops.ui_login import config_dir, ui_login

    assert config_dir({"XDG_CONFIG_HOME": str(tmp_path)}) == tmp_path / "mimir" / "ui"
    directory = tmp_path / "mimir" / "ui"
    login, created = ui_login(directory)
    assert created and len(login.password) >= 32 and login.password not in repr(login)
    assert login.login_file.read_text() == f"{login.username}:{login.password}\n"
    for path, mode in ((directory, 0o700), (login.login_file, 0o600), (login.auth_config, 0o600),
                       (login.auth_db, 0o600)):
        assert stat.S_IMODE(path.stat().st_mode) == mode, path
    ini = login.auth_config.read_text()
    assert f"database_uri = sqlite:///{login.auth_db}" in ini and "default_permission = NO_PERMISSIONS" in ini
    assert login.password not in ini  # the password reaches the server through its environment only
    env = login.server_env()
    assert env["MLFLOW_AUTH_ADMIN_PASSWORD"] == login.password and env["MLFLOW_AUTH_CONFIG_PATH"] == str(login.auth_config)

    login.login_file.chmod(0o644)
    directory.chmod(0o755)
    again, created = ui_login(directory)
    assert not created and again == login  # the same login at every start
    assert stat.S_IMODE(login.login_file.stat().st_mode) == 0o600 and stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert "could be read by other users (mode 0644): made 0600" in caplog.text

    login.login_file.write_text("no colon\n")
    try:
        ui_login(directory)
    except UserError as exc:
        assert "is not USER:PASSWORD; delete it" in str(exc)
    else:
        raise AssertionError("a damaged login file was accepted")
    login.login_file.unlink()
    fresh, created = ui_login(directory)
    assert created and fresh.password != login.password and login.auth_db.stat().st_size == 0  # account rebuilt
