"""Run megatron-core on CPU: the one place where its CUDA-only calls are redirected.

megatron-core assumes a GPU in a few places that our model path reaches:

- ``torch.cuda.current_device()`` picks the device of communication buffers (the sequence-parallel
  all-gather, vocab-parallel helpers). On CPU it must name the CPU.
- ``torch.cuda.synchronize()`` is called around checkpoint I/O, and DDP's gradient sync asks for
  ``torch.cuda.current_stream()`` to order work. On CPU everything is synchronous: a stream whose
  waits are no-ops stands in.
- The CUDA RNG tracker snapshots CUDA generator states when it forks, and activation recompute
  saves and restores the CUDA RNG state around each checkpointed layer. On CPU we install the
  inference tracker, whose ``fork()`` is a no-op (our model has no dropout), and make the CUDA
  RNG state get/set no-ops (the CPU generator is still saved and restored by megatron).
- ``Attention._apply_output_gate`` is wrapped in ``torch.compile`` at import; on CPU the first call
  compiles C++ for ~20 s per process and gains nothing, so the eager function is restored.

We never call megatron's RotaryEmbedding or default causal-mask helper (both allocate on CUDA):
RoPE frequencies and the PrefixLM mask are computed by our own code on the batch's device.

:func:`setup` does all of this once, only when no GPU is present, so the model code is the
same on CPU (gloo) and GPU (NCCL) with no ``if cpu`` branches. It is explicit: importing
``mimir_megatron.model`` (or this module) patches nothing, so a library that imports ours keeps
torch and megatron-core as they were until an entry point calls :func:`setup`.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import logging
import re
import threading
from pathlib import Path
from typing import Callable, NamedTuple, TypeVar

import torch

from mimir_megatron.gpus import GpuSpec, spec_for_device
from mimir_megatron.logging_setup import quiet_known_noise

log = logging.getLogger(__name__)

T = TypeVar("T")

_ACTIVE = False
_ORIGINALS: dict[str, object] = {}  # what setup() replaced, by name
_GATE = "megatron.core.transformer.attention.Attention._apply_output_gate"


def has_gpu() -> bool:
    return torch.cuda.is_available()


def device() -> torch.device:
    """The device this process computes on."""
    return torch.device("cuda", torch.cuda.current_device()) if has_gpu() else torch.device("cpu")


def peak_memory_gb() -> float:
    """Peak memory of this process in GB (1e9 bytes, the unit of `mimir plan` and of GPU
    datasheets): allocated GPU memory, or the CPU resident set size."""
    if has_gpu():
        return torch.cuda.max_memory_allocated() / 1e9
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # KiB


def gpu_name() -> str | None:
    """This process's GPU as the driver names it (``NVIDIA B200``), or None without one."""
    return torch.cuda.get_device_name() if has_gpu() else None


def gpu_row() -> GpuSpec | None:
    """The GPU table's row of this process's GPU (mimir_megatron/gpus.yaml, found by name), or
    None: no GPU, or one the table lacks."""
    name = gpu_name()
    return None if name is None else spec_for_device(name)


def peak_tflops() -> tuple[float, str]:
    """One device's peak dense TFLOP/s for MFU, and where it comes from: a GPU's bf16 peak from
    the project's GPU table (mimir_megatron/gpus.yaml), or this process's CPU threads measured on an
    fp32 matmul (best of five, inputs without RNG); (0, why) for a GPU the table lacks."""
    if has_gpu():
        spec = gpu_row()
        if spec is None:
            return 0.0, f"{gpu_name()} is not in mimir_megatron/gpus.yaml: set train.peak_tflops"
        return float(spec.bf16_tflops), f"{spec.name} bf16 peak, mimir_megatron/gpus.yaml"
    import time

    n = 1024
    a, b = torch.ones(n, n), torch.full((n, n), 0.5)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return 2 * n**3 / best / 1e12, f"CPU, {torch.get_num_threads()} threads, measured fp32 matmul"


def transformer_engine_missing() -> str | None:
    """Why Transformer Engine cannot be used here, or None when it can (GPU and TE imports)."""
    if not has_gpu():
        return "no GPU in this process"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # ImportError, or a CUDA/library mismatch raised at import
        return f"transformer_engine does not import: {type(exc).__name__}: {exc}"
    return None


def layer_backend(requested: str) -> str:
    """The layer implementation a model uses: ``te`` (Transformer Engine linears, FP8-capable)
    or ``local`` (megatron's own). ``auto`` takes te where it works, else local."""
    if requested == "auto":
        return "te" if transformer_engine_missing() is None else "local"
    if requested == "te" and (why := transformer_engine_missing()):
        from mimir_megatron.errors import ConfigError

        raise ConfigError(f"model.execution.layer_backend=te needs Transformer Engine on a GPU: {why}")
    return requested


def attention_backend(requested: str) -> str:
    """The PrefixLM attention kernel: ``auto`` is FlexAttention on GPU, the dense reference on
    CPU (FlexAttention has no CPU backward)."""
    if requested == "auto":
        return "flex" if has_gpu() else "dense"
    return requested


def distributed_backend() -> str:
    return "nccl" if has_gpu() else "gloo"


def decode_compile_options(device: torch.device) -> dict:
    """``torch.compile`` options of the engine's compiled decoding step (``--compile-decode``).

    On a GPU, CUDA graphs (``reduce-overhead``) over static shapes: the rows padded to a power of
    two, the whole cache allocation attended under a mask, its buffers marked static (a graph
    replays at fixed addresses); a graph per schedule, allocation and padded row count. On CPU,
    Inductor's C++ kernels over dynamic shapes: the step's own rows and attended length, one
    graph per schedule whatever the batch, the lengths or the allocation (a CPU graph only
    removes per-operation overhead; static shapes would cost a compile per shape and attention
    over unused cache positions, measured slower than eager at 8 and 32 rows)."""
    if uses_cuda_graphs(device):
        return {"mode": "reduce-overhead", "dynamic": False}
    return {"mode": "default", "dynamic": True}


def uses_cuda_graphs(device: torch.device) -> bool:
    """Whether compiled decoding on ``device`` is captured as CUDA graphs, whose inputs (the KV
    cache's buffers) must then stay at one address and shape: marked static, allocated up front
    and never reallocated (:func:`decode_compile_options`)."""
    return device.type == "cuda"


def prepacks_weights(device: torch.device) -> bool:
    """Whether the inference engine's eager products on ``device`` read weights prepacked once
    for the GEMM library (``inference/products.py``): on CPU where torch has oneDNN, whose
    product on its own blocked layout beats MKL's sgemm re-packing the weight every call at a
    decoding step's rows; on a GPU cuBLAS reads the weights as they are."""
    return device.type == "cpu" and torch.backends.mkldnn.is_available()


def native_cpu_step_ops(device: torch.device) -> bool:
    """Whether the inference step's norms, decoding attention and (where :func:`few_row_products`
    picks them) products at 1-8 rows on ``device`` run the C kernels of ``mimir_kernels.cpu_step``
    (fp32, where the install built them; ``inference/step_ops.py``, ``inference/products.py``): on
    CPU, where torch's operations and oneDNN's products cost ~1.2-2.3x the kernels' time per
    decoding step (dispatch, a padded and masked SDPA, GEMMs that read one-row weights slower than
    a plain loop); on a GPU torch's."""
    return device.type == "cpu"


def cpu_vendor(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's vendor id (GenuineIntel, AuthenticAMD; empty where ``cpuinfo`` does not say)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return ""
    found = re.search(r"^vendor_id\s*:\s*(\S+)", text, re.MULTILINE)
    return found.group(1) if found else ""


class FewRowKernel(NamedTuple):
    """The kernel of a decoding step's few-row products on this CPU (:func:`few_row_products`)."""

    name: str
    """``"mkl"`` or ``"native"`` (``inference/products.py``'s ``MklProducts``, ``NativeProducts``)."""
    streamed_max_rows: int
    """The most rows it takes of a weight of 2 MiB or more (one that streams from memory); oneDNN's
    GEMM takes more. A smaller weight, in the caches, goes to it at every few-row count."""


def few_row_products(device: torch.device) -> FewRowKernel | None:
    """The kernel of the inference step's fp32 weight products at a decoding step's 1-8 rows on
    ``device`` (``inference/products.py``), or None for the GEMM of more rows:

    - ``"mkl"`` on Intel CPUs where torch has MKL: its sgemm on the weights as stored (``F.linear``),
      which MKL runs through its small-matrix path there. On the 2-core Xeon (AVX-512) its
      decoding steps took 0.70-0.92x the C loop's at mid512 and 0.87-0.99x at tiny; for mid512's
      weights, which stream from memory, oneDNN's GEMM was as fast from 4 rows on;
    - ``"native"`` on other CPUs where the install built the C kernels (:func:`native_cpu_step_ops`):
      ``mimir_kernels.cpu_step.small_gemm``, a loop that streams each weight once for every row.
      MKL takes slower paths on other vendors' CPUs. On the AMD EPYC with AVX2 the loop's steps
      took 0.74-0.94x oneDNN's at mid512 up to 8 rows. With AVX-512, where oneDNN's GEMM computes
      16 floats an instruction and the loop 8, 0.52-0.93x at 1-4 rows and 1.17-1.34x at 6-8, so
      there a streamed weight takes the loop at 1-4 rows only.

    A choice by the CPU's kind, not by timing at start-up, so that a CPU of one kind always
    computes the same tokens (docs/performance.md#serving has the measurements). Where
    :func:`native_gemm` holds, products from two rows up go to the packed GEMM whatever this says.
    """
    if device.type != "cpu":
        return None
    if cpu_vendor() == "GenuineIntel" and torch.backends.mkl.is_available():
        return FewRowKernel("mkl", 3)
    if not native_cpu_step_ops(device):
        return None
    return FewRowKernel("native", 4 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 8)


def native_gemm(device: torch.device) -> bool:
    """Whether the inference step's fp32 products from two rows up on ``device`` run the C GEMM of
    ``mimir_kernels.cpu_step`` on weights packed for it (``packed_gemm``, where the CPU has AVX-512)
    instead of oneDNN's and the few-row kernel's: on CPUs other than Intel's, with AVX-512 (checked
    again by the library), where the install built the C kernels. On the 2-core AMD EPYC (Zen 4)
    a mid512 prefill took 0.93x oneDNN's time and decoding steps of 8-32 rows 0.72-0.86x (torch's
    call of oneDNN's GEMM spends ~10 µs on bookkeeping, and the GEMM reached ~80 % of the FMA units'
    peak there); Intel's CPUs keep oneDNN's and MKL's, where this was not measured."""
    return (native_cpu_step_ops(device) and cpu_vendor() != "GenuineIntel"
            and torch.backends.cpu.get_cpu_capability() == "AVX512")


def run_in_own_thread(work: Callable[[], T], name: str = "mimir-load") -> T:
    """``work()`` on a thread of its own that ends with it; its result returned, its exception raised.

    For setting up what another thread then computes with (the model a server's scheduler thread
    decodes with): torch's CPU threads are libgomp's, which gives every thread that starts
    parallel work a pool of its own and, while the pools together hold more threads than the
    machine has cores, lets idle workers spin only briefly before sleeping, so each product
    wakes them again. A thread that ends frees its pool: loading here leaves the caller's thread
    without one, and the scheduler's pool alone. Measured on 2 cores: a decoding step's products
    took ~2x as long on a second thread once the first had run parallel work. On a GPU ``work``
    runs in the caller's thread (CUDA's current device is per thread; its compute is not the CPU's)."""
    if has_gpu():
        return work()
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["result"] = work()
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["result"]  # type: ignore[return-value]


def release_cpu_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker pool; whether there was a libgomp to ask.

    For a thread that has run torch's CPU kernels (the trainer's) and now waits while another
    thread computes (an evaluation's server scheduler, :func:`run_in_own_thread`'s reason): its
    idle pool would keep libgomp's pools above the core count, and the other thread's workers
    would sleep between products. ``omp_pause_resource_all(omp_pause_soft)`` (OpenMP 5.0) ends
    the calling thread's workers; its next parallel region makes a new pool. Measured on 2
    cores: 16 products at M = 8 took 202 µs a call on a second thread beside the main thread's
    pool, 115-126 µs once the main thread had released it. Where torch's OpenMP is not a loaded
    libgomp (another runtime, macOS) this does nothing and returns False."""
    gomp = _libgomp()
    if gomp is None:
        return False
    gomp.omp_pause_resource_all(1)  # omp_pause_soft
    return True


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch runs on, as this process has loaded it: torch's own copy in its wheel
    where there is one (other wheels may bring copies of their own), else the only one loaded."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "/libgomp" in line})
    except OSError:
        return None
    torch_dir = str(Path(torch.__file__).resolve().parent) + "/"
    ours = [p for p in paths if p.startswith(torch_dir)] or (paths if len(paths) == 1 else [])
    if not ours:
        return None
    gomp = ctypes.CDLL(ours[0])  # already loaded: the same instance torch uses
    return gomp if hasattr(gomp, "omp_pause_resource_all") else None


def setup() -> None:
    """Redirect megatron-core's CUDA-only calls to the CPU when no GPU is present (idempotent).

    Called once by each entry point (the CLI, the test configuration, worker and benchmark
    scripts) before any model is built, and by :func:`mimir_megatron.parallel.init_distributed`
    so that library use (a notebook's ``build_model``) is covered too. Importing this module or
    the model patches nothing. The symbols replaced are listed in :data:`PATCHED`; a contract
    test pins each of them against the installed torch and megatron-core.
    """
    global _ACTIVE
    quiet_known_noise()  # megatron-core's import-time warnings (a library caller may come here first)
    if _ACTIVE or has_gpu():
        return
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.attention import Attention

    for owner, name in ((torch.cuda, "current_device"), (torch.cuda, "synchronize"),
                        (torch.cuda, "current_stream"), (mcore_random, "_get_cuda_rng_state"),
                        (mcore_random, "_set_cuda_rng_state")):
        _ORIGINALS.setdefault(f"{owner.__name__}.{name}", getattr(owner, name))
    _ORIGINALS.setdefault(_GATE, Attention.__dict__["_apply_output_gate"])

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    torch.cuda.current_stream = lambda *args, **kwargs: _SynchronousStream()  # type: ignore[assignment]
    mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: None
    mcore_random._set_cuda_rng_state = lambda *args, **kwargs: None
    compiled = Attention.__dict__["_apply_output_gate"]
    Attention._apply_output_gate = getattr(compiled, "_torchdynamo_orig_callable", compiled)
    _ACTIVE = True
    log.debug("CPU backend set up: megatron-core CUDA calls redirected")


def is_set_up() -> bool:
    """Whether :func:`setup` has redirected megatron-core's CUDA calls in this process."""
    return _ACTIVE


PATCHED = (
    "torch.cuda.current_device", "torch.cuda.synchronize", "torch.cuda.current_stream",
    "megatron.core.tensor_parallel.random._get_cuda_rng_state",
    "megatron.core.tensor_parallel.random._set_cuda_rng_state", _GATE,
)
"""The symbols :func:`setup` replaces on CPU (it also installs megatron's inference RNG tracker
through ``initialize_rng_tracker``); tests/integration/test_backend_contract.py pins each of them."""


def original(name: str) -> object:
    """The symbol named in :data:`PATCHED` as the installed library defines it (what
    :func:`setup` replaced, or the current one when setup has not run)."""
    if name in _ORIGINALS:
        return _ORIGINALS[name]
    if name == _GATE:
        from megatron.core.transformer.attention import Attention

        return Attention.__dict__["_apply_output_gate"]
    module, attr = name.rsplit(".", 1)
    return getattr(importlib.import_module(module), attr)


class _SynchronousStream:
    """Stands in for a CUDA stream on CPU, where every operation has completed on return."""

    def wait_event(self, event: object) -> None:
        pass

    def wait_stream(self, stream: object) -> None:
        pass

    def synchronize(self) -> None:
        pass


def seed_rng_tracker(seed: int) -> None:
    """Seed megatron's model-parallel RNG tracker on GPU (the CPU tracker is a no-op)."""
    if has_gpu():
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
