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
