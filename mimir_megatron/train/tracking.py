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

Where MLflow 3's UI files the run: its experiment is of the model-training kind
(``mlflow_store.experiment_id``), and the run outputs a LoggedModel, the model it trains, whose
weights stay outside MLflow (the run's checkpoints, tag ``mimir.checkpoints``; MLflow's
"external model"). MLflow 3.17's UI, which opens in a GenAI view whatever the experiment's kind,
lists a run with a model output under "Training runs", and one without under "Evaluation runs".
"""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path
from typing import Any

from mimir_megatron.checkpoint.layout import RUN_CHECKPOINTS

log = logging.getLogger(__name__)

_BATCH = 900  # MLflow accepts at most 1000 metrics per log_batch
# The LoggedModel's status when the run ends this way (a pre-empted run, KILLED, goes on later).
_MODEL_STATUS = {"FINISHED": "READY", "FAILED": "FAILED"}


def default_tracking_uri(run_dir: Path) -> str:
    return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


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
        self.checkpoints = (checkpoints or run_dir / RUN_CHECKPOINTS).resolve()
        self.artifact_root = (run_dir / "mlartifacts").resolve().as_uri()
        self.experiment = experiment
        self.retry_seconds = retry_seconds
        self.run_id: str | None = None
        self.model_id: str | None = None  # the LoggedModel this run trains
        self._client = None
        self._pending_start: dict[str, Any] | None = None
        self._metrics: list = []
        self._tags: dict[str, str] = {}
        self._failing_since: float | None = None
        self._last_attempt = 0.0
        self._warned = False
        self._logged_through = 0
        """Steps up to this one are already in the resumed run: not logged again."""
        if enabled:
            from mimir_megatron.mlflow_store import mlflow_client

            self._client = mlflow_client(self.uri, request_timeout_s=5)

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
        self._metrics += [Metric(k, float(v), now, step) for k, v in metrics.items()]
        self._flush()

    def set_tags(self, tags: dict[str, str]) -> None:
        if not self.enabled:
            return
        self._tags.update({k: str(v) for k, v in tags.items()})
        self._flush()

    def log_text(self, text: str, artifact_file: str) -> None:
        """A small text artifact of the run (e.g. plan.json), once the run exists; best effort."""
        if not self.enabled:
            return
        if self.run_id is None:
            self._flush(force=True)
        try:
            self._client.log_text(self.run_id, text, artifact_file)
        except Exception as exc:  # noqa: BLE001 - tracking must never break training
            log.warning("could not log %s to MLflow: %s", artifact_file, exc)

    def close(self, status: str = "FINISHED", wait_seconds: float = 30.0) -> bool:
        """Deliver what is buffered (trying for up to ``wait_seconds``) and end the run."""
        if not self.enabled:
            return True
        deadline = time.time() + wait_seconds
        while not self._flush(force=True) and time.time() < deadline:
            time.sleep(1.0)
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
        return bool(self._metrics or self._tags or self._pending_start)

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
        return True

    def _create_or_resume_run(self) -> None:
        from mlflow.entities import Param, RunTag

        from mimir_megatron.mlflow_store import experiment_id, mark_experiment_kind

        start = self._pending_start
        resumed = self._existing_run(self.run_id) if self.run_id is not None else None
        # The run's latest value per metric carries its step: no need to read the history.
        logged = None if resumed is None else max(
            (m.step for m in resumed.data.to_proto().metrics if m.key == "loss"), default=0)
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
            run = self._client.create_run(exp_id, run_name=start["run_name"], tags=start["tags"])
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
