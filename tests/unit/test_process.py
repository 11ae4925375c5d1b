"""``mimir_megatron.process``: what a long-running service does to its process once built."""

from __future__ import annotations

import gc

import pytest
import uvicorn
from fastapi import FastAPI

from mimir_megatron.inference.server import app as server_app
from mimir_megatron.process import freeze_startup_objects


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()


def test_start_up_objects_leave_the_collectors_reach(unfrozen):
    """After the freeze a full collection scans none of start-up's objects (a module's dict, say)."""
    assert freeze_startup_objects() > 1000  # the count itself moves as other threads free objects
    assert not any(o is server_app.__dict__ for o in gc.get_objects())


def test_mimir_serve_freezes_once_its_app_is_built(monkeypatch, unfrozen):
    calls = []
    monkeypatch.setattr(server_app, "build_app", lambda engine, **kw: calls.append("app") or FastAPI())
    monkeypatch.setattr(server_app, "freeze_startup_objects", lambda: calls.append("freeze"))
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: calls.append("run"))
    server_app.serve(object(), port=0)
    assert calls == ["app", "freeze", "run"]
