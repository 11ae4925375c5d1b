"""The GPU spec table (``gpus.yaml``, shipped with the package): memory, dense peaks per
precision, NVLink and network bandwidth, and the device names each row matches. The project's
one source of GPU figures: `mimir plan`, the trainer's own plan and its MFU, and `mimir bench`
read it (this process's device through :func:`mimir_megatron.backend.gpu_row`). A user's YAML
(same fields) adds GPUs or overrides rows. Imports no torch: below the backend and the planner.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import lru_cache
from importlib import resources
from pathlib import Path

from mimir_megatron.errors import UserError

PRECISIONS = ("bf16", "fp8", "mxfp8")


@dataclass(frozen=True)
class GpuSpec:
    key: str
    name: str
    memory_gb: float
    """HBM per GPU, GB (1e9 bytes)."""
    bf16_tflops: float
    """Dense bf16 peak, TFLOP/s."""
    fp8_tflops: float | None
    mxfp8_tflops: float | None
    nvlink_gbps: float
    """NVLink bandwidth of one GPU, GB/s, as datasheets give it: the bidirectional total (a
    B200's 1,800 GB/s is 900 GB/s each way). Collectives are timed at :attr:`nvlink_one_way_gbps`."""
    network_gbps: float
    """Network bandwidth per GPU between nodes, GB/s, one direction (a 400 Gb/s NIC: 50 GB/s)."""
    gpus_per_node: int
    source: str
    match: tuple[str, ...] = ()

    @property
    def nvlink_one_way_gbps(self) -> float:
        """What one GPU can send while it receives as much (a ring collective's bandwidth)."""
        return self.nvlink_gbps / 2

    def peak_tflops(self, precision: str) -> float:
        peak = {"bf16": self.bf16_tflops, "fp8": self.fp8_tflops, "mxfp8": self.mxfp8_tflops}[precision]
        if peak is None:
            raise UserError(f"{self.name} has no {precision} peak in the GPU table "
                            f"(it does not support {precision}): use --precision bf16")
        return float(peak)


_REQUIRED = ("memory_gb", "bf16_tflops", "nvlink_gbps", "network_gbps", "source")


def _rows(path: Path, origin: str) -> dict[str, GpuSpec]:
    from mimir_megatron.yaml_config import raise_errors, read_yaml

    tree = read_yaml(path, "'gpus:' (GPU names to their specs)", kind="GPU spec file")
    gpus = tree.get("gpus")
    if not isinstance(gpus, dict):
        raise UserError(f"{origin}: expected a mapping 'gpus:' of GPU names to their specs")
    known = {f.name for f in fields(GpuSpec)} - {"key"}
    specs, problems = {}, []
    for key, row in gpus.items():
        row = row or {}
        problems += [f"gpus.{key}.{f} is required" for f in _REQUIRED if row.get(f) is None]
        problems += [f"gpus.{key}.{f} is not a field (known: {', '.join(sorted(known))})"
                     for f in row if f not in known]
        if not any(p.startswith(f"gpus.{key}.") for p in problems):
            specs[str(key).lower()] = GpuSpec(
                key=str(key).lower(), name=str(row.get("name", key)), memory_gb=float(row["memory_gb"]),
                bf16_tflops=float(row["bf16_tflops"]), fp8_tflops=row.get("fp8_tflops"),
                mxfp8_tflops=row.get("mxfp8_tflops"), nvlink_gbps=float(row["nvlink_gbps"]),
                network_gbps=float(row["network_gbps"]), gpus_per_node=int(row.get("gpus_per_node", 8)),
                source=str(row["source"]), match=tuple(row.get("match") or ()))
    raise_errors(problems, f"invalid GPU table {origin}")
    return specs


@lru_cache(maxsize=1)
def shipped_gpus() -> dict[str, GpuSpec]:
    """The table shipped with the package, by lower-case key (b200, h100, ...)."""
    with resources.as_file(resources.files("mimir_megatron").joinpath("gpus.yaml")) as path:
        return _rows(path, "mimir_megatron/gpus.yaml")


def gpu_spec(choice: str, table: dict[str, GpuSpec] | None = None) -> GpuSpec:
    """``choice``: a key of the table (case-insensitive), or a YAML file of one or more rows
    (the first row is the GPU; rows with a shipped key override it)."""
    table = shipped_gpus() if table is None else table
    if choice.endswith((".yaml", ".yml")):
        path = Path(choice)
        own = _rows(path, str(path))
        if not own:
            raise UserError(f"{choice}: no GPU in 'gpus:'")
        return next(iter(own.values()))
    spec = table.get(choice.lower())
    if spec is None:
        raise UserError(f"unknown GPU {choice!r} (known: {', '.join(sorted(table))}; or a YAML file "
                        "of specs, see docs/planning.md)")
    return spec


def spec_for_device(device_name: str) -> GpuSpec | None:
    """The row whose ``match`` names this CUDA device (torch.cuda.get_device_name), if any.
    The longest match wins (GB200 before B200)."""
    hits = [(len(m), spec) for spec in shipped_gpus().values() for m in spec.match if m in device_name]
    return max(hits, key=lambda hit: hit[0])[1] if hits else None
