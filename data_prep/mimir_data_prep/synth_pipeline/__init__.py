"""Generate-and-audit pipelines (`mimir synth run`, or ``python -m mimir_data_prep.synth_pipeline``).

A YAML pipeline (:mod:`.pipeline`) names a source, a generator and an auditor endpoint
(:mod:`.client`) and deterministic checks (:mod:`.checks`); :mod:`.runner` drives the rows, the
state file (:mod:`.evidence_file`) makes a run resumable, :mod:`.acceptance` writes the outputs
and report; :mod:`.run_records` holds the directory's records (evidence rows, pipeline stamp,
acceptance report, MLflow pointer).
"""
