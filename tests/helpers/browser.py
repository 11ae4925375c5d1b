"""Headless chromium driven over its DevTools protocol, for the pages of `mimir ui`.

Each visit starts chromium on one profile (its localStorage persists between visits, as a user's
browser does), loads the page with a virtual-time budget (chromium's own ``--virtual-time-budget``:
the page's scripts and requests run to completion, whatever the machine's load), saves a screenshot
and returns the page's DOM.

The UI asks for a login (HTTP basic). With ``login`` the browser sends it with every request
(``Network.setExtraHTTPHeaders``), as a browser does once its user typed the login into its
prompt; without it the page is what the server answers a stranger. (A ``user:password@`` URL is
no substitute: the UI's scripts refuse to fetch from a page whose address holds credentials; and
answering the prompt through ``Fetch`` interception stops the virtual clock from waiting for the
page's requests.)
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import subprocess
import time
from pathlib import Path
from typing import Any

VIRTUAL_TIME_MS = 30_000


class Browser:
    def __init__(self, chromium: str, profile: Path, screenshots: Path, login: tuple[str, str] | None = None):
        self.chromium, self.profile, self.screenshots, self.login = chromium, profile, screenshots, login

    def visit(self, url: str, screenshot: str) -> str:
        self.screenshots.mkdir(parents=True, exist_ok=True)
        self.profile.mkdir(parents=True, exist_ok=True)
        active = self.profile / "DevToolsActivePort"
        active.unlink(missing_ok=True)
        cmd = [self.chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={self.profile}", "--window-size=1600,1000", "--hide-scrollbars",
               "--run-all-compositor-stages-before-draw", "--remote-debugging-port=0", "about:blank"]
        process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while not (active.exists() and len(active.read_text().splitlines()) == 2):
                assert process.poll() is None, process.stderr.read()[-2000:] if process.stderr else ""
                assert time.monotonic() < deadline, "chromium did not open its DevTools port"
                time.sleep(0.05)
            port, path = active.read_text().splitlines()
            return asyncio.run(asyncio.wait_for(
                self._visit(f"ws://127.0.0.1:{port}{path}", url, self.screenshots / screenshot), 180))
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(30)

    async def _visit(self, endpoint: str, url: str, screenshot: Path) -> str:
        import websockets

        async with websockets.connect(endpoint, max_size=None) as ws:
            session = _Session(ws)
            reader = asyncio.create_task(session.read())
            try:
                pages = (await session.call("Target.getTargets"))["targetInfos"]
                target = next(t["targetId"] for t in pages if t["type"] == "page")  # the window's tab
                session.id = (await session.call("Target.attachToTarget", targetId=target, flatten=True))["sessionId"]
                if self.login is not None:
                    token = base64.b64encode(":".join(self.login).encode()).decode()
                    await session.call("Network.enable")
                    await session.call("Network.setExtraHTTPHeaders", headers={"Authorization": f"Basic {token}"})
                await session.call("Page.enable")
                await session.call("Emulation.setDeviceMetricsOverride", width=1600, height=1000,
                                   deviceScaleFactor=1, mobile=False)
                await session.call("Page.navigate", url=url)  # returns once the page's document arrived
                await session.call("Emulation.setVirtualTimePolicy", policy="pauseIfNetworkFetchesPending",
                                   budget=VIRTUAL_TIME_MS)
                await session.budget_spent.wait()
                await session.call("Emulation.setVirtualTimePolicy", policy="advance")  # frames for the shot
                dom = await session.call("Runtime.evaluate", expression="document.documentElement.outerHTML",
                                         returnByValue=True)
                shot = await session.call("Page.captureScreenshot", format="png")
                screenshot.write_bytes(base64.b64decode(shot["data"]))
                return dom["result"]["value"]
            finally:
                reader.cancel()


class _Session:
    """One page's DevTools session: calls by id, and the end of the virtual-time budget."""

    def __init__(self, ws: Any) -> None:
        self.ws, self.id = ws, None
        self.ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future] = {}
        self.budget_spent = asyncio.Event()

    async def send(self, method: str, **params: Any) -> int:
        call = next(self.ids)
        message = {"id": call, "method": method, "params": params}
        if self.id is not None:
            message["sessionId"] = self.id
        self.pending[call] = asyncio.get_running_loop().create_future()
        await self.ws.send(json.dumps(message))
        return call

    async def call(self, method: str, **params: Any) -> dict:
        reply = await self.pending[await self.send(method, **params)]
        if "error" in reply:
            raise AssertionError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    async def read(self) -> None:
        async for raw in self.ws:
            message = json.loads(raw)
            if "id" in message:
                self.pending.pop(message["id"]).set_result(message)
                continue
            if message.get("method") == "Emulation.virtualTimeBudgetExpired":
                self.budget_spent.set()
