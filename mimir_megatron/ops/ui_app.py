"""The server app of `mimir ui`: MLflow's own, whose page opens in the model-training view.

MLflow 3.17's UI does not read the experiment tag ``mlflow.experimentKind`` to pick its view (the
bundle's experiment-kind hook returns the UI's workflow type whenever its workflow switch is on,
which 3.17 hard-codes on). The GenAI / Model training switch is a browser setting instead: the
``?workflowType=`` query parameter of the page, else ``localStorage["mlflow.workflowType_v1"]``
(a JSON string), else GenAI. No server option or stored default sets it.

Its assistant panel (a quarter of the page) opens itself on a browser's first visit unless
``localStorage["mlflow.assistant.fab.autoOpenedOnFirstLoad_v1"]`` says it already did.

So the page this app serves sets these browser settings, the training view and the assistant's
first opening done, where the browser has none yet, before MLflow's script starts; a user who
switches to GenAI or opens the assistant keeps that choice (localStorage is per origin: it
touches no other MLflow server). It is an MLflow server plugin (entry point ``mlflow.app`` named
``mimir``, the mechanism of ``mlflow server --app-name basic-auth``), so MLflow's own command line
still builds the server, its stores and its options; and it is MLflow's basic-auth app as well:
every request but ``/health`` and the static files needs the login that `mimir ui` sets up
(:mod:`.ui_login`). Everything else is MLflow's server unchanged.
"""

from __future__ import annotations

import json
import os
from typing import Any

APP_NAME = "mimir"
"""The ``mlflow.app`` entry point of this module (pyproject.toml)."""
WORKFLOW_STORAGE_KEY = "mlflow.workflowType_v1"
"""Where MLflow 3.17's UI stores its GenAI / Model training switch (key ``_v`` version)."""
TRAINING_VIEW = "machine_learning"
"""The switch's value for the model-training view (the other is ``genai``)."""

BROWSER_DEFAULTS = {
    WORKFLOW_STORAGE_KEY: TRAINING_VIEW,
    "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": True,
}
"""localStorage entries (values JSON-encoded, as the UI stores them) set where absent."""

_DEFAULT_VIEW_SCRIPT = (
    "<script>try{var d=" + json.dumps({k: json.dumps(v) for k, v in BROWSER_DEFAULTS.items()})
    + ";for(var k in d)if(window.localStorage.getItem(k)===null)window.localStorage.setItem(k,d[k]);"
    "}catch(e){}</script>"
)


def with_training_view(index_html: str) -> str:
    """MLflow's ``index.html`` with the default-view script ahead of its own scripts."""
    head = index_html.find("<script")
    if head < 0:
        head = index_html.find("</head>")
    if head < 0:
        return _DEFAULT_VIEW_SCRIPT + index_html
    return index_html[:head] + _DEFAULT_VIEW_SCRIPT + index_html[head:]


def create_app() -> Any:
    """MLflow's server app with its login (``mlflow.server.auth``: FastAPI under uvicorn, else
    Flask) and the page above."""
    from flask import Response
    from mlflow.server import app as flask_app

    original = flask_app.view_functions["serve"]
    index = os.path.join(flask_app.static_folder or "", "index.html")

    def serve() -> Any:
        if not os.path.isfile(index):
            return original()  # a source install without the UI build: MLflow's own message
        with open(index, encoding="utf-8") as f:
            page = with_training_view(f.read())
        return Response(page, mimetype="text/html", headers={"Cache-Control": "no-cache"})

    flask_app.view_functions["serve"] = serve
    from mlflow.server.auth import create_app as with_login

    return with_login(flask_app)
