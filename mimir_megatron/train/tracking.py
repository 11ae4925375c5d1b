"""MLflow tracking from rank 0 that never stops training.

The default store is a sqlite database in the run directory (browse it with ``mimir ui``);
``tracking.uri`` points at a server instead. When the server cannot be reached, a warning is
logged once, metrics are buffered in memory, and they are delivered when it answers again
(retried at most every ``retry_seconds``). Requests use short timeouts and no client-side
retries so an unreachable server costs one failed request per retry period, not minutes.

A resumed run continues its MLflow run. Steps after the checkpoint that the run had already
logged before it stopped (a kill between checkpoints) are replayed by training but not logged
again: the run keeps one value per step. Where the replayed steps are another trajectory (the
resume changed the configuration or the data), they go to a new run instead, tagged with the
run it continues (``mimir.resumed_from_run_id``).

What a researcher opens first: MLflow's charts put a metric in the section named by the part of
its name before the last "/", sections in alphabetical order (names without a "/" last), charts
in a section alphabetically. :data:`METRIC_NAMES` numbers the sections so that the curves come in
this order: ``1-train`` (loss, gradient norm, tokens/s, MFU, TFLOP/s), ``2-schedule`` (the window k,
k_L, k_H and each module's learning rate, side by side), ``3-eval``, ``4-tokens`` (tokens seen:
pick it as the charts' x axis), ``5-step`` (step time, memory, skipped steps, the plan's
figures). The run's description (:func:`run_description`) says what the schedule curves mean.
Params are the resolved config split into hyperparameters (their config names) and
``settings.*`` (:func:`run_params`); the resolved config, the plan, the lineage and the data policy
decision are artifacts of the run, delivered like metrics: when the store refuses them (a server
down, an artifact store read-only or full) they wait and are retried, and at the end the ones
still undelivered are named in one warning.

Where MLflow 3's UI files the run: its experiment is of the model-training kind
(``mlflow_store.experiment_id``), and the run outputs a LoggedModel, the model it trains, whose
weights stay outside MLflow (the run's checkpoints, tag ``mimir.checkpoints``; MLflow's
"external model"). MLflow 3.17's UI, which opens in a GenAI view whatever the experiment's kind,
lists a run with a model output under "Training runs", and one without under "Evaluation runs".
"""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path
from typing import Any

from mimir_megatron.checkpoint.run_directory import RunDirectory
from mimir_megatron.integrity import fingerprint

log = logging.getLogger(__name__)

_BATCH = 900  # MLflow accepts at most 1000 metrics per log_batch
# The LoggedModel's status when the run ends this way (a pre-empted run, KILLED, goes on later).
_MODEL_STATUS = {"FINISHED": "READY", "FAILED": "FAILED"}


METRIC_NAMES = {
    "loss": "1-train/loss",
    "grad_norm": "1-train/grad_norm",
    "tokens_per_s": "1-train/tokens_per_s",
    "mfu": "1-train/mfu",
    "tflops_per_device": "1-train/tflops_per_device",
    "window_k": "2-schedule/window_k",
    "k_L": "2-schedule/k_L",
    "k_H": "2-schedule/k_H",
    "tokens_seen": "4-tokens/seen",
    "supervised_tokens": "4-tokens/supervised",
    "step_time_s": "5-step/step_time_s",
    "peak_memory_gb": "5-step/peak_memory_gb",
    "nonfinite_skip": "5-step/nonfinite_skip",
}
"""The trainer's metric -> its name in MLflow (see the module docstring)."""
_PREFIXES = {"lr/": "2-schedule/lr_", "eval/": "3-eval/", "plan/": "5-step/planned_"}
LOSS = METRIC_NAMES["loss"]


def metric_name(key: str) -> str:
    """The MLflow name of the trainer's metric ``key`` (unknown keys unchanged)."""
    if key in METRIC_NAMES:
        return METRIC_NAMES[key]
    for prefix, section in _PREFIXES.items():
        if key.startswith(prefix):
            return section + key[len(prefix):]
    return key


# Config keys that change how a run is carried out or reported, not what it computes: MLflow
# params ``settings.<key>``; every other key is a hyperparameter, under its own name.
_SETTINGS = ("checkpoint.", "data.eval_path", "data.index_dir", "data.prefetch", "data.verify", "eval.",
             "model.execution.", "model.parallel.", "model.tokenizer", "run.", "source", "tracking.",
             "train.collective_timeout_s", "train.log_interval", "train.max_nonfinite_skips",
             "train.micro_batch_size", "train.on_nonfinite", "train.peak_tflops", "train.plan_",
             "optim.shard_state")
_HYPERPARAMETERS = ("checkpoint.init_from", "checkpoint.keep_optimizer", "model.execution.fp8", "run.seed")


def run_params(flat_config: dict[str, Any], effective: dict[str, Any] | None = None) -> dict[str, Any]:
    """MLflow params of a run: the flattened config, settings under ``settings.``; ``effective``
    replaces config values by what the run actually does (sequence parallelism only with TP > 1),
    so that no param contradicts the run's tags."""
    values = flat_config | (effective or {})
    params = {}
    for key, value in values.items():
        setting = key.startswith(_SETTINGS) and not key.startswith(_HYPERPARAMETERS)
        params[f"settings.{key}" if setting else key] = value
    return params


def config_digest(config: dict[str, Any]) -> str:
    """A short hash of a resolved config (what tells two runs of one recipe apart)."""
    return fingerprint(config)[:6]


def run_name(cfg: Any) -> str:
    """The MLflow run name: ``tracking.run_name`` if set, else ``<run.name>-k<window>-s<steps>-<hash
    of the resolved config>`` (``k2to5`` for a linear window schedule), e.g. ``demo-k2to5-s300-3fa1c2``."""
    if cfg.tracking.run_name:
        return cfg.tracking.run_name
    w = cfg.window
    window = f"k{w.k}" if w.schedule == "constant" else f"k{w.k0}to{w.k1}"
    return f"{cfg.run.name}-{window}-s{cfg.train.steps}-{config_digest(cfg.to_dict())}"


def run_description(cfg: Any, peak_tflops: float, peak_source: str, plan: Any = None) -> str:
    """The run's description (MLflow's ``mlflow.note.content``, Markdown): what it trains and
    what its curves mean; ``plan``: the run's own plan (train/plan/startup.py), if it has one."""
    w, o, m = cfg.window, cfg.optim, cfg.model
    window = (f"constant k = {w.k}" if w.schedule == "constant" else
              f"linear k = {w.k0} -> {w.k1} over the first {w.ramp_fraction:.0%} of the steps")
    divided = ("divided by how often each module is applied inside the window: lr_L = lr / k_L, "
               "lr_H = lr / k_H (`optim.divide_lr_by_window`)" if o.divide_lr_by_window
               else "not divided by the window (`optim.divide_lr_by_window: false`)")
    return "\n".join([
        f"**{cfg.run.name}**: HRM-Text ({m.h_cycles} H cycles x {m.l_cycles} L cycles, hidden "
        f"{m.hidden_size}), {cfg.train.steps} steps x {cfg.train.global_batch_size} contexts x "
        f"{cfg.data.seq_len} tokens, config `{cfg.source}`.",
        "",
        "**Charts** (Model metrics), in this order:",
        "- `1-train`: loss, gradient norm, tokens/s, TFLOP/s per device and MFU = TFLOP/s per "
        f"device / {peak_tflops:.4g} TFLOP/s ({peak_source}).",
        f"- `2-schedule`: the truncated-backprop window k ({window}; `window_policy: "
        f"{m.window_policy}`) and what it holds of each stack, k_L and k_H applications; the "
        f"learning rates of embedding, head, L and H side by side. L and H learning rates are {divided}, "
        "so they change exactly when the window does; a module outside the window (k_L or k_H = 0, or "
        "the embedding when the window does not reach it) is frozen and shows lr 0. Warm-up "
        f"{o.warmup_steps} steps, " + ("no cool-down." if o.cooldown == "none" else
                                        f"{o.cooldown} cool-down over the last {o.cooldown_steps} steps."),
        "- `3-eval`: held-out exact match (and the benchmark suite) every "
        + (f"{cfg.eval.interval} steps and " if cfg.eval.interval else "") + "at the end.",
        "- `4-tokens`: tokens seen (choose it as the x axis in the chart settings) and supervised "
        "tokens per step.",
        "- `5-step`: step time, peak memory, non-finite steps skipped"
        + (" and the plan's figures next to the measured ones (GB = 1e9 bytes)."
           if plan is not None and plan.compared else "."),
        "",
        "**Artifacts**: the resolved config, the data policy decision, the lineage (updated at every "
        "checkpoint), " + ("the plan, " if plan is not None else "") + "evaluation results; "
        "evaluations and audits of its checkpoints are child runs.",
    ])


def default_tracking_uri(run_dir: Path) -> str:
    return RunDirectory(run_dir).mlflow_uri


def git_commit() -> str:
    """The commit this code was built from (mimir_megatron.version: also right for an installed
    wheel), "unknown" without one."""
    from mimir_megatron.version import commit

    found = commit()
    return found.sha if found else "unknown"


class Tracker:
    """Buffered MLflow run; every method is a no-op when disabled (non-zero ranks)."""

    def __init__(self, uri: str | None, run_dir: Path, experiment: str, enabled: bool,
                 retry_seconds: float = 10.0, checkpoints: Path | None = None):
        self.enabled = enabled
        self.uri = uri or default_tracking_uri(run_dir)
        self.checkpoints = (checkpoints or RunDirectory(run_dir).checkpoints).resolve()
        self.artifact_root = RunDirectory(run_dir).artifact_root
        self.experiment = experiment
        self.retry_seconds = retry_seconds
        self.run_id: str | None = None
        self.model_id: str | None = None  # the LoggedModel this run trains
        self._client = None
        self._pending_start: dict[str, Any] | None = None
        self._metrics: list = []
        self._tags: dict[str, str] = {}
        self._artifacts: dict[str, str | Path] = {}
        """Artifacts waiting for the store: path in the run -> text, or a local file or directory."""
        self._artifact_error: str | None = None
        self._artifacts_retry_at = 0.0
        self._failing_since: float | None = None
        self._last_attempt = 0.0
        self._warned = False
        self._logged_through = 0
        """Steps up to this one are already in the resumed run: not logged again."""
        if enabled:
            from mimir_megatron.mlflow_store import mlflow_client

            self._client = mlflow_client(self.uri, request_timeout_s=5, artifact_root=self.artifact_root)

    # -- public --------------------------------------------------------------------------------

    def start(self, run_name: str, params: dict[str, Any], tags: dict[str, str],
              resume_run_id: str | None = None, resume_step: int = 0, new_trajectory: bool = False) -> None:
        """Create the run, or continue ``resume_run_id`` from step ``resume_step``;
        ``new_trajectory``: the steps after ``resume_step`` differ from any the run logged."""
        if not self.enabled:
            return
        self.run_id = resume_run_id
        self._pending_start = {"run_name": run_name, "params": params, "tags": tags,
                               "resume_step": resume_step, "new_trajectory": new_trajectory}
        self._flush(force=True)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled or step <= self._logged_through:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._metrics += [Metric(metric_name(k), float(v), now, step) for k, v in metrics.items()]
        self._flush()

    def set_tags(self, tags: dict[str, str]) -> None:
        if not self.enabled:
            return
        self._tags.update({k: str(v) for k, v in tags.items()})
        self._flush()

    def log_text(self, text: str, artifact_file: str) -> None:
        """A small text artifact of the run (e.g. plan.json); a later one at the same path
        replaces it. Delivered like metrics (see the module docstring)."""
        self._queue_artifact(artifact_file, text)

    def log_json(self, value: Any, artifact_file: str) -> None:
        self._queue_artifact(artifact_file, json.dumps(value, indent=2, default=str) + "\n")

    def log_path(self, path: Path, artifact_path: str) -> None:
        """A file (as ``artifact_path``/its name) or a directory's files (under ``artifact_path``)."""
        self._queue_artifact(f"{artifact_path}/{Path(path).name}" if Path(path).is_file() else artifact_path,
                             Path(path))

    def _queue_artifact(self, artifact_file: str, payload: str | Path) -> None:
        if not self.enabled:
            return
        self._artifacts[artifact_file] = payload
        self._flush()

    def close(self, status: str = "FINISHED", wait_seconds: float = 30.0) -> bool:
        """Deliver what is buffered (trying for up to ``wait_seconds``) and end the run."""
        if not self.enabled:
            return True
        deadline = time.time() + wait_seconds
        while not self._flush(force=True) and time.time() < deadline:
            time.sleep(1.0)
        if self._artifacts:
            log.warning("MLflow at %s: %d artifacts not stored (%s): %s", self.uri, len(self._artifacts),
                        ", ".join(self._artifacts), self._artifact_error)
            self._artifacts = {}
        if self.pending:
            log.warning("MLflow unreachable at %s: %d metrics could not be delivered",
                        self.uri, len(self._metrics))
            return False
        try:
            if self.model_id is not None and status in _MODEL_STATUS:
                self._client.finalize_logged_model(self.model_id, _MODEL_STATUS[status])
            self._client.set_terminated(self.run_id, status=status)
        except Exception as exc:  # noqa: BLE001 - tracking must never break training
            log.warning("could not mark the MLflow run %s: %s", status, exc)
            return False
        return True

    @property
    def pending(self) -> bool:
        return bool(self._metrics or self._tags or self._pending_start or self._artifacts)

    # -- delivery ------------------------------------------------------------------------------

    def _flush(self, force: bool = False) -> bool:
        if not self.pending:
            return True
        now = time.time()
        if self._failing_since is not None and not force and now - self._last_attempt < self.retry_seconds:
            return False
        self._last_attempt = now
        try:
            if self._pending_start is not None:
                self._create_or_resume_run()
                self._metrics = [m for m in self._metrics if m.step > self._logged_through]
            if self._tags:
                from mlflow.entities import RunTag

                self._client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in self._tags.items()])
                self._tags = {}
            while self._metrics:
                self._client.log_batch(self.run_id, metrics=self._metrics[:_BATCH])
                self._metrics = self._metrics[_BATCH:]
        except Exception as exc:  # noqa: BLE001 - any transport or server error
            if not self._warned:
                log.warning("MLflow at %s unreachable (%s); buffering metrics and retrying every %.0f s",
                            self.uri, type(exc).__name__, self.retry_seconds)
                self._warned = True
            self._failing_since = self._failing_since or now
            return False
        if self._failing_since is not None:
            log.info("MLflow at %s reachable again; buffered metrics delivered", self.uri)
            self._failing_since, self._warned = None, False
        return self._deliver_artifacts(force)

    def _deliver_artifacts(self, force: bool) -> bool:
        """Store the waiting artifacts (the run exists); one the store refuses (read-only, full,
        unreachable) waits for the next attempt, at most every ``retry_seconds``, while metrics
        go on. Whether none is left."""
        if not self._artifacts or (not force and time.time() < self._artifacts_retry_at):
            return not self._artifacts
        for artifact_file, payload in list(self._artifacts.items()):
            try:
                if isinstance(payload, str):
                    self._client.log_text(self.run_id, payload, artifact_file)
                elif payload.is_dir():
                    self._client.log_artifacts(self.run_id, str(payload), artifact_file)
                else:
                    self._client.log_artifact(self.run_id, str(payload), str(Path(artifact_file).parent))
            except Exception as exc:  # noqa: BLE001 - tracking must never break training
                if self._artifact_error is None:
                    log.warning("MLflow at %s: artifact %s not stored (%s: %s); retrying every %.0f s",
                                self.uri, artifact_file, type(exc).__name__, exc, self.retry_seconds)
                self._artifact_error = f"{type(exc).__name__}: {exc}"
                self._artifacts_retry_at = time.time() + self.retry_seconds
                return False
            del self._artifacts[artifact_file]
        if self._artifact_error is not None:
            log.info("MLflow at %s: waiting artifacts stored", self.uri)
            self._artifact_error = None
        return True

    def _create_or_resume_run(self) -> None:
        from mlflow.entities import Param, RunTag

        from mimir_megatron.mlflow_store import create_run, experiment_id, mark_experiment_kind

        start = self._pending_start
        resumed = self._existing_run(self.run_id) if self.run_id is not None else None
        # The run's latest value per metric carries its step: no need to read the history.
        logged = None if resumed is None else max(
            (m.step for m in resumed.data.to_proto().metrics if m.key in (LOSS, "loss")), default=0)
        if self.run_id is not None and resumed is None:
            # A checkpoint resumed into another run directory (or store) names a run this store
            # never had: continue in a new run that says where it came from, instead of
            # retrying a run that cannot appear and losing every metric.
            log.warning("MLflow run %s (from the checkpoint) is not in %s; logging to a new run "
                        "tagged mimir.resumed_from_run_id", self.run_id, self.uri)
            start["tags"] = start["tags"] | {"mimir.resumed_from_run_id": self.run_id}
            self.run_id = None
        elif logged is not None and logged > start["resume_step"]:
            replayed = f"steps {start['resume_step'] + 1}-{logged}"
            if start["new_trajectory"]:
                log.warning("MLflow run %s already holds %s of the trajectory before this resume; this "
                            "one differs (changed configuration or data): logging to a new run tagged "
                            "mimir.resumed_from_run_id", self.run_id, replayed)
                start["tags"] = start["tags"] | {"mimir.resumed_from_run_id": self.run_id}
                self.run_id = None
            else:
                log.info("MLflow run %s already holds %s (logged before the resume): they are "
                         "replayed, not logged again", self.run_id, replayed)
                self._logged_through = logged
        if self.run_id is None:
            exp_id = experiment_id(self._client, self.experiment, self.artifact_root)  # model-training kind
            run = create_run(self._client, exp_id, start["run_name"], start["tags"])
            self.run_id = run.info.run_id
            params = [Param(k, str(v)[:6000]) for k, v in start["params"].items()]
            for i in range(0, len(params), 90):
                self._client.log_batch(self.run_id, params=params[i:i + 90])
        else:  # a run from before experiments were marked gets its experiment marked now
            exp_id = resumed.info.experiment_id
            mark_experiment_kind(self._client, self._client.get_experiment(exp_id))
            self._client.update_run(self.run_id, status="RUNNING")
            self._client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in start["tags"].items()])
            outputs = resumed.outputs.model_outputs if resumed.outputs else []
            self.model_id = outputs[0].model_id if outputs else None
        if self.model_id is None:
            self.model_id = self._log_trained_model(exp_id, start["run_name"])
        self._pending_start = None

    def _log_trained_model(self, exp_id: str, name: str) -> str | None:
        """The LoggedModel this run outputs (see the module docstring); None, with a warning, where
        the store has no logged models (an MLflow 2 server): the run itself is unaffected."""
        from mlflow.entities import LoggedModelOutput

        try:
            model = self._client.create_logged_model(
                exp_id, name=name, source_run_id=self.run_id, model_type="hrm-text",
                tags={"mlflow.model.isExternal": "true", "mimir.checkpoints": str(self.checkpoints)})
            self._client.log_outputs(self.run_id, [LoggedModelOutput(model.model_id, step=0)])
        except Exception as exc:  # noqa: BLE001 - the run is tracked without it
            log.warning("MLflow at %s: the run's model output not logged (%s); the UI may list the "
                        "run as an evaluation", self.uri, exc)
            return None
        return model.model_id

    def _existing_run(self, run_id: str) -> Any:
        """The run, or None only when the store answers that it has no such run; transport
        errors raise."""
        from mlflow.exceptions import MlflowException

        try:
            return self._client.get_run(run_id)
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise


class SystemMetrics:
    """MLflow's own system-metrics monitor (a thread) for one node, into an existing run.

    CPU, memory, disk and network through psutil; GPU utilisation and memory through NVML
    (nvidia-ml-py) where there is a GPU. ``node_id`` prefixes the names (``system/<node>/...``)
    when several nodes log into the same run. Failures are the monitor's own warnings: they never
    stop training (it stops sampling if the store is unreachable).
    """

    def __init__(self, uri: str, run_id: str, interval: float, node_id: str | None = None):
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        self._monitor = None
        try:
            self._monitor = SystemMetricsMonitor(run_id, sampling_interval=interval, resume_logging=True,
                                                 node_id=node_id, tracking_uri=uri)
            self._monitor.start()
        except Exception as exc:  # noqa: BLE001 - tracking must never break training
            log.warning("MLflow system metrics not started: %s", exc)
            self._monitor = None

    def close(self) -> None:
        if self._monitor is not None:
            self._monitor.finish()
            self._monitor = None


def host_tags(world_size: int, layout: str) -> dict[str, str]:
    return {"git_commit": git_commit(), "host": socket.gethostname(), "world_size": str(world_size),
            "parallel_layout": layout}
