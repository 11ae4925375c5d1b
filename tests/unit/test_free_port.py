"""``mimir_megatron.ports.free_port``: a port below the kernel's ephemeral range, where nothing the
OS hands out on its own can take it before the server binds."""

from __future__ import annotations

import socket

from mimir_megatron import ports
from mimir_megatron.ports import free_port


def test_free_port_is_below_the_ephemeral_range_and_bindable(tmp_path, monkeypatch):
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("40000\t60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", range_file)
    for _ in range(20):
        port = free_port()
        assert 20000 <= port < 40000
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_free_port_skips_a_taken_port(tmp_path, monkeypatch):
    with socket.socket() as taken, socket.socket() as other:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        other.bind(("127.0.0.1", 0))
        busy, free = taken.getsockname()[1], other.getsockname()[1]
        other.close()
        monkeypatch.setattr(ports.random, "sample", lambda population, k: [busy, free])
        assert free_port() == free


def test_free_port_falls_back_to_the_os_where_no_port_is_below_the_range(tmp_path, monkeypatch):
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("1024\t60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", range_file)
    assert free_port() >= 1024


def test_free_port_assumes_the_kernels_default_range_where_the_file_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", tmp_path / "missing")
    assert all(16384 <= free_port() < 32768 for _ in range(20))
