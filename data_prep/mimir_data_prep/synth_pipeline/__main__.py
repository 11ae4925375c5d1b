"""``python -m mimir_data_prep.synth_pipeline PIPELINE.yaml``: `mimir synth run` without the CLI."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
