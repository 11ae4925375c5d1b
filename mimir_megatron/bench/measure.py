"""What every measurement of a bench run shares: the batch, the timing loop, the weights, results."""

from __future__ import annotations

import gc
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported when the command runs, not when the CLI starts
    import torch

    from mimir_megatron.batch import Batch

log = logging.getLogger(__name__)


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
    """GB (1e9 bytes): torch's allocator peak on a GPU, the process's resident set on a CPU."""
    planned_peak_memory_gb: float | None = None
    """`mimir plan`'s peak of the same step (ours only; GB), beside the measured one."""
    window: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class StepSettings:
    """The optimizer side of a step, the same for our trainer and the peer."""

    optimizer: str = "adamw"
    lr: float = 1e-4
    clip_grad: float = 1.0
    ema_decay: float = 0.9999


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
    step: StepSettings = field(default_factory=StepSettings)


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


def time_steps(step: Callable[[], None], warmup: int, steps: int, device: torch.device) -> list[float]:
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


def result(name: str, times: list[float], setup: BenchSetup, flops_per_token: float, window: str,
           settings: dict[str, Any], k: int) -> BenchResult:
    from mimir_megatron.backend import peak_memory_gb

    median = statistics.median(times)
    tflops = flops_per_token * setup.tokens / median / 1e12
    return BenchResult(name=name, k=k, tokens_per_s=setup.tokens / median, tflops_per_s=tflops,
                       mfu=tflops / setup.peak_tflops if setup.peak_tflops else None,
                       step_median_s=median, step_spread_s=max(times) - min(times),
                       peak_memory_gb=peak_memory_gb(), window=window, settings=settings)


def autocast(setup: BenchSetup):
    import torch

    bf16 = setup.precision == "bf16" or (setup.precision == "auto" and setup.device.type == "cuda")
    return torch.autocast(setup.device.type, dtype=torch.bfloat16, enabled=bf16)


def release(device: torch.device) -> None:
    """Free the previous measurement's model and optimizer before the next one's peak memory."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def reset_peak(device: torch.device) -> None:
    """Between the windows of one model: its weights and optimizer state stay, the peak restarts."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def failed(name: str, exc: BaseException, device: torch.device, k: int = 0) -> BenchResult:
    log.error("%s failed: %s: %s", name, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
    release(device)
    return BenchResult(name=name, k=k, error=f"{type(exc).__name__}: {exc}"[:500])


def measure_windows(name: str, setup: BenchSetup, measure: Callable[[int], BenchResult]
                    ) -> Iterator[BenchResult]:
    """``measure(k)`` for each window; a failing window is reported and the next still runs."""
    for k in setup.windows:
        reset_peak(setup.device)
        try:
            yield measure(k)
        except Exception as exc:  # noqa: BLE001 - one failing window must not hide the others
            yield failed(name, exc, setup.device, k)


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
        release(device)
        return build_model(cfg, device=device)
