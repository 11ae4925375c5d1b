"""The CLI as an operator meets it: signals during start-up, and no known start-up noise."""

import json
import os
import subprocess
import sys

from conftest import REPO, train_overrides

WORKER = REPO / "tests" / "workers" / "signal_during_import.py"


def test_sigterm_while_importing_is_honoured_not_fatal(demo_data, tmp_path):
    cmd = [sys.executable, str(WORKER), "train", "--config", str(REPO / "configs/train/demo.yaml"),
           *train_overrides(demo_data, tmp_path, "train.steps=3", "checkpoint.interval=100")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "received SIGTERM" in output
    # One step, then the pre-emption checkpoint, as for a signal during training.
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_0000001"


NOISE = """
import logging, sys, warnings
from mimir_megatron.logging_setup import quiet_known_noise
quiet_known_noise()
logging.basicConfig(stream=sys.stdout, format="%(name)s: %(message)s")
warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.")
warnings.warn("another UserWarning stays")
# what torch's distributed checkpointing says on every single-process load through megatron
warnings.warn("The argument order of load has been changed. Please check the document to avoid future breakages.")
warnings.warn("torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to "
              "load in a single process.")
warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning)
warnings.warn("another FutureWarning stays", FutureWarning)
ext = logging.getLogger("torch.utils.cpp_extension")
ext.warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local/cuda")
ext.warning("another cpp_extension warning stays")
import torch.utils.cpp_extension  # the real logger: the filter survives torch's import
torch.utils.cpp_extension.logger.warning("No CUDA runtime is found, using CUDA_HOME='/x'")
"""


def test_known_start_up_noise_is_filtered_and_nothing_else():
    done = subprocess.run([sys.executable, "-c", NOISE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    output = done.stdout + done.stderr
    assert "another UserWarning stays" in output
    assert "another FutureWarning stays" in output
    for dropped in ("argument order of load", "torch.distributed is disabled", "ShardedTensor"):
        assert dropped not in output
    assert "another cpp_extension warning stays" in output
    assert "Transformer Engine and Apex" not in output
    assert "No CUDA runtime" not in output


def test_the_cli_installs_its_filter_before_importing_megatron():
    # megatron warns when megatron.core.distributed is imported (as `mimir train` does);
    # `train --help` exits in argument parsing, before any handler or mimir_megatron.backend.
    code = ("import warnings; warnings.simplefilter('default')\n"
            "from mimir_megatron.cli import main\n"
            "try:\n    main(['train', '--help'])\nexcept SystemExit:\n    pass\n"
            "import megatron.core.distributed\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "Transformer Engine and Apex" not in done.stdout + done.stderr


def test_input_mistakes_are_reported_before_torch_is_imported(tmp_path):
    """A missing input path (any megatron command) or a train config mistake is one line and exit 2
    before torch or megatron-core is imported (they take ~5 s to import)."""
    missing = str(tmp_path / "nope")
    commands = {
        "config file not found": ["train", "--config", missing],
        "train.stepz is not a setting": ["train", "--config", "configs/train/demo.yaml", "train.stepz=3"],
        "config file not found: " + missing: ["info", "--config", missing],
        "checkpoint not found: " + missing: ["generate", "--checkpoint", missing, "--input", "x", "--output", "y"],
        "input file not found: " + missing: ["generate", "--hf", ".", "--input", missing, "--output", "y"],
        "model directory not found: " + missing: ["serve", "--weights", missing],
    }
    code = ("import json, sys\n"
            "from mimir_megatron.cli import main\n"
            "codes = [main(argv) for argv in json.loads(sys.argv[1])]\n"
            "print(codes, sorted(m for m in ('torch', 'megatron') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(list(commands.values()))], capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{[2] * len(commands)} []", done.stdout + done.stderr
    for message in commands:
        assert message in done.stderr, (message, done.stderr)
