"""`mimir bench`: training-step throughput of this model next to the transformers `hrm_text` peer.

Both run the same shape, batch and window on one device: forward over all applications,
backward over the window, AdamW step. The peer's window is expressed through its
``L_bp_cycles`` (its H-applications always get gradients), which matches ``last_k`` exactly for
k = 5..8 (k=5: ``L_bp = [0, 3]``); other k are reported with the peer's nearest window.

Our model can be measured in several variants in one run (``--variant``), each a set of model
overrides: the speed levers (attention kernel, layer backend and FP8, torch.compile, recompute,
chunked loss) are all model settings. A variant that fails (out of memory, a missing library)
is reported with its error; the others still run. Several windows (``--window 5,8``) are
measured on the same model of each variant, so a run builds, exports and compiles once.

Order (:func:`run_order`): the variants as given, except that compiled ones go last (a compile
takes minutes, so under a time limit it is the one to lose), and the peer runs right after the
first variant, so a run cut short still has a ratio. The peer is never compiled.

Reports tokens/s, TFLOP/s (formula: :mod:`mimir_megatron.train.flops`), MFU when the device's
peak is known, step-time median and spread, and peak memory, as a table and as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported when the command runs, not when the CLI starts
    import torch

    from mimir_megatron.batch import Batch

log = logging.getLogger(__name__)

SHAPES = {"tiny": "configs/model/tiny.yaml", "mimir": "configs/model/mimir.yaml"}
# Dense bf16 peaks (TFLOP/s) of devices we know; MFU is left out elsewhere unless --peak-tflops.
PEAK_BF16 = {"H100": 989.0, "H200": 989.0, "B200": 2250.0, "A100": 312.0}
PEER_NAME = "transformers hrm_text"


@dataclass
class BenchResult:
    name: str
    k: int = 0
    tokens_per_s: float = 0.0
    tflops_per_s: float = 0.0
    mfu: float | None = None
    step_median_s: float = 0.0
    step_spread_s: float = 0.0
    peak_memory_gb: float = 0.0
    window: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class Variant:
    """One configuration of our model to measure: a name and model ``key=value`` overrides."""

    name: str
    overrides: list[str]


@dataclass
class BenchSetup:
    """What every measurement of one run shares."""

    windows: list[int]
    tokens: int
    seq_len: int
    batch: Batch
    device: torch.device
    precision: str
    peak_tflops: float | None
    warmup: int
    steps: int
    attended_keys: float
    """Mean keys each position attends to in this batch (the attention FLOPs)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="training-step throughput vs the transformers hrm_text peer")
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--config", help="model YAML instead of --shape")
    p.add_argument("--window", type=parse_windows, default=[5], metavar="K[,K...]",
                   help="bp window k, or several (5,8) measured on the same models (default 5)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--samples-per-context", type=int, default=1,
                   help="packed samples per context (the PrefixLM kernels' sparsity depends on it)")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (and compilation)")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                   help="compute precision: auto = bf16 autocast on GPU, fp32 on CPU")
    p.add_argument("--variant", action="append", default=[], metavar="NAME[:KEY=VALUE,...]",
                   help="measure our model with these extra overrides (repeatable), e.g. "
                        "'flex+compile:execution.attention_backend=flex,execution.compile=true'")
    p.add_argument("--no-peer", action="store_true", help="skip the transformers peer")
    p.add_argument("--peer-checkpointing", action="store_true",
                   help="gradient checkpointing in the peer (compare with execution.recompute=full "
                        "variants; the peer needs it to fit the Mimir shape at 4 x 4096 tokens)")
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("overrides", nargs="*", help="model key=value overrides for every variant")
    p.set_defaults(handler=cmd_bench)


def parse_variant(text: str) -> Variant:
    """``NAME:key=value,key=value`` (or just ``NAME`` for the shared settings)."""
    name, _, rest = text.partition(":")
    if not name.strip():
        raise ValueError(f"variant {text!r} needs a name before ':'")
    overrides = [item.strip() for item in rest.split(",") if item.strip()]
    bad = [item for item in overrides if "=" not in item]
    if bad:
        raise ValueError(f"variant {name!r}: expected key=value, got {', '.join(bad)}")
    return Variant(name.strip(), overrides)


def parse_windows(text: str) -> list[int]:
    """``5`` or ``5,8``: the bp windows to measure, in that order."""
    try:
        windows = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K or K,K,..., got {text!r}") from None
    if not windows or any(k < 1 for k in windows):
        raise argparse.ArgumentTypeError(f"windows must be positive integers, got {text!r}")
    return windows


PEER = None
"""Stands for the transformers peer in a run order."""


def is_compiled(variant: Variant, shared: Sequence[str] = ()) -> bool:
    """Whether the variant's settings (shared ones first, its own override them) compile."""
    value = None
    for item in [*shared, *variant.overrides]:
        key, _, v = item.partition("=")
        if key.strip().removeprefix("model.") == "execution.compile":
            value = v.strip().lower()
    return value in ("true", "1", "yes", "on")


def run_order(variants: list[Variant], peer: bool, shared: Sequence[str] = ()) -> list[Variant | None]:
    """The measuring order: uncompiled variants as given, then compiled ones; the peer
    (:data:`PEER`) right after the first."""
    order: list[Variant | None] = sorted(variants, key=lambda v: is_compiled(v, shared))
    if peer:
        order.insert(min(1, len(order)), PEER)
    return order


def _repo_path(relative: str) -> Path:
    here = Path(relative)
    return here if here.is_file() else Path(__file__).resolve().parent.parent / relative


def bench_batch(vocab: int, micro_batch: int, seq_len: int, samples_per_context: int = 1) -> Batch:
    """Random tokens, ``samples_per_context`` samples packed per row (the last one takes the
    remainder), each half prefix and half supervised response."""
    import torch

    from mimir_megatron.batch import IGNORE_INDEX, Batch

    if not 1 <= samples_per_context <= seq_len // 2:
        raise ValueError(f"--samples-per-context must be in 1..{seq_len // 2}, got {samples_per_context}")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (micro_batch, seq_len), generator=g)
    labels = torch.randint(0, vocab, (micro_batch, seq_len), generator=g)
    length = seq_len // samples_per_context
    starts = [i * length for i in range(samples_per_context)] + [seq_len]
    segment = torch.zeros(seq_len, dtype=torch.long)
    position = torch.zeros(seq_len, dtype=torch.long)
    prefix = torch.zeros(seq_len, dtype=torch.bool)
    supervised = torch.zeros(seq_len, dtype=torch.bool)
    for n, (a, b) in enumerate(zip(starts, starts[1:]), start=1):
        half = (b - a) // 2
        segment[a:b] = n
        position[a:b] = torch.arange(b - a)
        prefix[a : a + half] = True
        supervised[a + half - 1 : b] = True
    labels[:, ~supervised] = IGNORE_INDEX
    rows = micro_batch
    return Batch(ids, position.repeat(rows, 1), segment.repeat(rows, 1), prefix.repeat(rows, 1), labels)


def _time_steps(step: Callable[[], None], warmup: int, steps: int, device: torch.device) -> list[float]:
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return times


def _result(name: str, times: list[float], setup: BenchSetup, flops_per_token: float, window: str,
            settings: dict[str, Any], k: int) -> BenchResult:
    from mimir_megatron.backend import peak_memory_gb

    median = statistics.median(times)
    tflops = flops_per_token * setup.tokens / median / 1e12
    return BenchResult(name=name, k=k, tokens_per_s=setup.tokens / median, tflops_per_s=tflops,
                       mfu=tflops / setup.peak_tflops if setup.peak_tflops else None,
                       step_median_s=median, step_spread_s=max(times) - min(times),
                       peak_memory_gb=peak_memory_gb(), window=window, settings=settings)


def peer_l_bp_cycles(h_cycles: int, l_cycles: int, k: int) -> list[int]:
    """transformers' per-H-cycle trailing L iterations with grad that match last_k for k."""
    remaining = max(0, k - h_cycles)  # H-applications always get gradients in the peer
    cycles = []
    for _ in range(h_cycles):
        take = min(l_cycles, remaining)
        cycles.append(take)
        remaining -= take
    return list(reversed(cycles))


def _autocast(setup: BenchSetup):
    import torch

    bf16 = setup.precision == "bf16" or (setup.precision == "auto" and setup.device.type == "cuda")
    return torch.autocast(setup.device.type, dtype=torch.bfloat16, enabled=bf16)


def _release(device: torch.device) -> None:
    """Free the previous measurement's model and optimizer before the next one's peak memory."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _reset_peak(device: torch.device) -> None:
    """Between the windows of one model: its weights and optimizer state stay, the peak restarts."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from mimir_megatron import backend
    from mimir_megatron.config import load_config
    from mimir_megatron.train.flops import attended_keys_per_token

    config_path = _repo_path(args.config or SHAPES[args.shape])
    variants = [parse_variant(v) for v in args.variant] or [Variant("mimir-megatron", [])]
    configs = {v.name: load_config(config_path, [*args.overrides, *v.overrides]) for v in variants}
    device = backend.device()
    peak = args.peak_tflops
    if peak is None and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    first = next(iter(configs.values()))
    batch = bench_batch(first.vocab_size, args.micro_batch, args.seq_len, args.samples_per_context)
    setup = BenchSetup(windows=args.window, tokens=args.micro_batch * args.seq_len, seq_len=args.seq_len,
                       batch=batch.to(device), device=device, precision=args.precision,
                       peak_tflops=peak, warmup=args.warmup, steps=args.steps,
                       attended_keys=attended_keys_per_token(batch.segment_ids, batch.prefix_mask).item())
    report = Report(args, device, setup.attended_keys)
    weights = SharedWeights()
    for item in run_order(variants, peer=not args.no_peer, shared=args.overrides):
        if item is PEER:
            results = _bench_peer(first, setup, weights, args.peer_checkpointing)
        else:
            results = _bench_ours(item.name, configs[item.name], setup, weights)
        for result in results:
            report.add(result)
    report.finish()
    return 0 if all(r.error is None for r in report.results) else 1


class SharedWeights:
    """Initialise the weights once (a Mimir-size init takes tens of seconds on CPU) and give every
    later model of the run the same values: built on the meta device, then loaded."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] | None = None

    def model(self, cfg, device: torch.device):
        import torch

        from mimir_megatron import backend
        from mimir_megatron.model import build_model

        te = backend.layer_backend(cfg.execution.layer_backend) == "te"
        if self.state is None or te:  # TE keeps FP8 state that an empty model would not have
            model = _build_on(cfg, device)
            if self.state is None and not te:
                self.state = {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
                              for k, v in model.state_dict().items()}
            elif self.state is not None:
                model.load_state_dict(self.state, strict=False)  # missing: TE's `_extra_state`
            return model
        model = build_model(cfg, device="meta").to_empty(device=device)
        model.load_state_dict(self.state)
        return model


def _build_on(cfg, device: torch.device):
    """Build and initialise on ``device`` itself: megatron's "CPU initialisation" allocates with
    torch's default device, so the init of a Mimir-size model (tens of seconds, minutes with some
    torch versions' truncated normal on CPU) runs on the GPU instead. Values differ from a CPU
    build of the same seed, which a benchmark does not mind; a build that fails this way is
    retried the ordinary way (CPU init, then moved)."""
    import torch

    from mimir_megatron.model import build_model

    if device.type == "cpu":
        return build_model(cfg, device=device)
    try:
        with torch.device(device):
            return build_model(cfg, device=device)
    except Exception as exc:  # noqa: BLE001 - the ordinary build below is the fallback
        log.warning("building on %s failed (%s: %s); initialising on the CPU instead",
                    device, type(exc).__name__, exc)
        _release(device)
        return build_model(cfg, device=device)


def _failed(name: str, exc: BaseException, device: torch.device, k: int = 0) -> BenchResult:
    log.error("%s failed: %s: %s", name, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
    _release(device)
    return BenchResult(name=name, k=k, error=f"{type(exc).__name__}: {exc}"[:500])


def _measure_windows(name: str, setup: BenchSetup, measure: Callable[[int], BenchResult]):
    """``measure(k)`` for each window; a failing window is reported and the next still runs."""
    for k in setup.windows:
        _reset_peak(setup.device)
        try:
            yield measure(k)
        except Exception as exc:  # noqa: BLE001 - one failing window must not hide the others
            yield _failed(name, exc, setup.device, k)


def _bench_ours(name: str, cfg, setup: BenchSetup, weights: SharedWeights) -> list[BenchResult]:
    import torch

    from mimir_megatron.train.flops import flops_per_token

    _release(setup.device)
    try:
        model = weights.model(cfg, setup.device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    except Exception as exc:  # noqa: BLE001 - one failing variant must not hide the others
        return [_failed(name, exc, setup.device, k) for k in setup.windows]
    autocast = _autocast(setup)
    settings = {"attention": model.attention_backend, "layers": model.layer_backend,
                "fp8": str(cfg.execution.fp8), "compile": cfg.execution.compile,
                "recompute": str(cfg.execution.recompute),
                "loss_chunk_tokens": cfg.execution.loss_chunk_tokens}

    def measure(k: int) -> BenchResult:
        plan = model.window_plan(k)

        def step() -> None:
            with autocast:
                out = model(setup.batch, window=k, return_logits=False, validate=False)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        times = _time_steps(step, setup.warmup, setup.steps, setup.device)
        fpt = flops_per_token(cfg, plan.k_L, plan.k_H, setup.seq_len, attended_keys=setup.attended_keys)
        return _result(name, times, setup, fpt, plan.describe(), settings, k)

    return list(_measure_windows(name, setup, measure))


def _bench_peer(cfg, setup: BenchSetup, weights: SharedWeights, checkpointing: bool) -> list[BenchResult]:
    import torch
    from transformers import AutoModelForCausalLM

    from mimir_megatron.interop import export_hf
    from mimir_megatron.train.flops import flops_per_token

    _release(setup.device)
    try:
        # Checked before the export and load, which take minutes at the Mimir shape.
        if int(setup.batch.segment_ids.max()) > 1:
            raise ValueError("the transformers peer cannot express packed samples "
                             "(use --samples-per-context 1, or --no-peer)")
        with tempfile.TemporaryDirectory() as tmp:
            plain = replace(cfg.execution, layer_backend="local", fp8="none", compile=False)
            local = replace(cfg, execution=plain)  # never compiled
            export_hf(weights.model(local, torch.device("cpu")), Path(tmp) / "hf")
            peer = AutoModelForCausalLM.from_pretrained(Path(tmp) / "hf", dtype=torch.float32,
                                                        attn_implementation="sdpa")
        peer = peer.to(setup.device).train()
        if checkpointing:  # non-reentrant: the first grad application's inputs need no grad
            peer.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        opt = torch.optim.AdamW(peer.parameters(), lr=1e-4)
    except Exception as exc:  # noqa: BLE001
        return [_failed(PEER_NAME, exc, setup.device, k) for k in setup.windows]
    batch, autocast = setup.batch, _autocast(setup)
    valid = batch.segment_ids > 0
    settings = {"attention": "sdpa", "gradient_checkpointing": checkpointing}

    def measure(k: int) -> BenchResult:
        bp = peer_l_bp_cycles(cfg.h_cycles, cfg.l_cycles, k)
        peer.model.L_bp_cycles_padded = bp
        k_L, k_H = sum(bp), cfg.h_cycles

        def step() -> None:
            with autocast:
                out = peer(input_ids=batch.input_ids, attention_mask=valid.long(),
                           token_type_ids=batch.prefix_mask.long(), labels=batch.labels,
                           use_cache=False)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        times = _time_steps(step, setup.warmup, setup.steps, setup.device)
        window = f"L_bp={bp} (k_L={k_L}, k_H={k_H})"
        fpt = flops_per_token(cfg, k_L, k_H, setup.seq_len, attended_keys=setup.attended_keys)
        return _result(PEER_NAME, times, setup, fpt, window, settings, k)

    return list(_measure_windows(PEER_NAME, setup, measure))


class Report:
    """Prints each result as it is measured and rewrites the JSON after each one, so a run cut
    short (a time limit, an out-of-memory kill) keeps what it measured."""

    def __init__(self, args: argparse.Namespace, device: torch.device, attended_keys: float) -> None:
        import torch

        self.args, self.results, self.attended_keys = args, [], attended_keys
        print(f"attention FLOPs counted for {attended_keys:,.1f} keys per position (this batch)")
        self.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        self.torch_version = torch.__version__
        header = (f"{'implementation':<28}{'k':>3}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}{'step (s)':>10}"
                  f"{'spread':>9}{'peak GB':>9}  window / settings")
        print(header)
        print("-" * len(header), flush=True)

    def add(self, r: BenchResult) -> None:
        self.results.append(r)
        if r.error:
            print(f"{r.name:<28}{r.k:>3}  FAILED: {r.error.splitlines()[0]}", flush=True)
        else:
            mfu = f"{r.mfu:.1%}" if r.mfu is not None else "n/a"
            settings = " ".join(f"{k}={v}" for k, v in r.settings.items())
            print(f"{r.name:<28}{r.k:>3}{r.tokens_per_s:>12,.0f}{r.tflops_per_s:>10.3f}{mfu:>8}"
                  f"{r.step_median_s:>10.3f}{r.step_spread_s:>9.3f}{r.peak_memory_gb:>9.2f}  "
                  f"{r.window}  {settings}", flush=True)
        self._write()

    def ratios(self) -> dict[str, dict[str, float]]:
        """Per window (``"k=5"``): tokens/s of each of our variants over the peer's, where the
        peer ran at that window."""
        ratios: dict[str, dict[str, float]] = {}
        for peer in (r for r in self.results if r.name == PEER_NAME and not r.error):
            ratios[f"k={peer.k}"] = {r.name: r.tokens_per_s / peer.tokens_per_s for r in self.results
                                     if r.k == peer.k and r.name != PEER_NAME and not r.error}
        return ratios

    def finish(self) -> None:
        for window, by_name in self.ratios().items():
            for name, ratio in by_name.items():
                print(f"ratio {name} / transformers at {window} (tokens/s): {ratio:.2f}")
        if self.device_name == "cpu" and len(self.results) > 1:
            print("peak GB on CPU is the process's largest resident set so far, not per row")
        self._write()

    def _write(self) -> None:
        if not self.args.json:
            return
        a = self.args
        payload = {"shape": a.config or a.shape, "windows": a.window, "seq_len": a.seq_len,
                   "micro_batch": a.micro_batch, "samples_per_context": a.samples_per_context,
                   "precision": a.precision, "device": self.device_name, "torch": self.torch_version,
                   "attended_keys_per_token": self.attended_keys,
                   "date": time.strftime("%Y-%m-%d"), "results": [asdict(r) for r in self.results],
                   "ratio_vs_transformers": self.ratios()}
        Path(a.json).write_text(json.dumps(payload, indent=2))
