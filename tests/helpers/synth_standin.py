"""A small OpenAI-compatible chat server on 127.0.0.1 for the synth pipeline tests.

It answers `POST /v1/chat/completions` with what a test's ``responder(body) -> str`` returns, and
can inject faults into chosen requests: ``"429"``/``"500"``/``"502"``/``"503"`` (status replies;
429 carries ``Retry-After``), ``"timeout"`` (answers only after ``slow_s``) and ``"drop"`` (closes
the connection without a reply). It can be stopped and started again on the same port.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

Responder = Callable[[dict[str, Any]], str]
FaultRule = Callable[[dict[str, Any], int], "str | None"]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # the default backlog of 5 drops connections from concurrent clients

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # dropped connections and clients that timed out are the point, not news


class StandIn:
    def __init__(self, responder: Responder, port: int = 0, delay_s: float = 0.0):
        self.responder = responder
        self.delay_s = delay_s
        self.slow_s = 5.0
        self.fault: FaultRule | None = None
        self.port = port
        self.lock = threading.Lock()
        self.requests = 0  # every request received, faults included
        self.faults_served: dict[str, int] = {}
        self.seen: dict[str, int] = {}  # times each distinct body was received
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> "StandIn":
        self._server = _Server(("127.0.0.1", self.port), _handler(self))
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "StandIn":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _decide(self, body: dict[str, Any]) -> tuple[str | None, int]:
        key = json.dumps(body, sort_keys=True)
        with self.lock:
            self.requests += 1
            count = self.seen.get(key, 0)
            self.seen[key] = count + 1
        fault = self.fault(body, count) if self.fault else None
        if fault:
            with self.lock:
                self.faults_served[fault] = self.faults_served.get(fault, 0) + 1
        return fault, count


def _handler(standin: StandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def _json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path.rstrip("/") in ("/v1/models", "/health"):
                self._json(200, {"object": "list", "data": [{"id": "standin", "object": "model"}]})
            else:
                self._json(404, {"error": {"message": "not found"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path.rstrip("/") != "/v1/chat/completions":
                self._json(404, {"error": {"message": "not found"}})
                return
            fault, _ = standin._decide(body)
            if fault == "drop":
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            if fault == "timeout":
                time.sleep(standin.slow_s)
            elif fault and fault.isdigit():
                headers = {"Retry-After": "0.05"} if fault == "429" else None
                self._json(int(fault), {"error": {"message": f"injected {fault}", "type": "injected"}},
                           headers)
                return
            if standin.delay_s:
                time.sleep(standin.delay_s)
            text = standin.responder(body)
            self._json(200, {
                "id": f"cmpl-{standin.requests}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model", "standin"),
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": text}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            })

    return Handler
