"""The contract between ``mimir_megatron.backend.setup`` and the torch / megatron-core it patches.

Each symbol setup() replaces on CPU is pinned here against the installed libraries: that it still
exists, has the parameters our stand-ins accept, and is still reached the way the patch assumes
(looked up at call time through its module, not bound at import). A megatron-core upgrade that
moves or renames one fails here, by name, instead of silently running the GPU path on CPU.
"""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

from mimir_megatron import backend

RANDOM = "megatron.core.tensor_parallel.random"


def parameters(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_every_patched_symbol_exists():
    assert len(backend.PATCHED) == 6
    for name in backend.PATCHED:
        assert callable(backend.original(name)), name


def test_torch_cuda_functions_we_replace():
    assert parameters(backend.original("torch.cuda.current_device")) == []
    assert parameters(backend.original("torch.cuda.synchronize")) == ["device"]
    assert parameters(backend.original("torch.cuda.current_stream")) == ["device"]
    # megatron reads them at call time through the module (so the patch reaches it).
    from megatron.core.tensor_parallel import layers, mappings

    assert "current_device" in mappings._gather_along_first_dim.__code__.co_names
    assert "current_device" in layers.VocabParallelEmbedding.__init__.__code__.co_names


def test_megatron_rng_state_functions_we_replace():
    from megatron.core.tensor_parallel import random as mcore_random

    get, put = (backend.original(f"{RANDOM}.{n}") for n in ("_get_cuda_rng_state", "_set_cuda_rng_state"))
    assert parameters(get) == ["device", "clone", "graph_safe"]
    assert parameters(put) == ["new_state", "device", "graph_safe"]
    # Activation recompute and the tracker reach them as module globals, at call time.
    assert "_get_cuda_rng_state" in mcore_random._get_all_rng_states.__code__.co_names
    assert "_set_cuda_rng_state" in mcore_random._set_all_rng_states.__code__.co_names
    assert "_get_all_rng_states" in mcore_random.CheckpointFunction.forward.__code__.co_names
    fork = mcore_random.CudaRNGStatesTracker.fork.__wrapped__  # a contextmanager
    assert {"_get_cuda_rng_state", "_set_cuda_rng_state"} <= set(fork.__code__.co_names)


def test_megatron_inference_rng_tracker_we_install():
    from megatron.core.tensor_parallel import random as mcore_random

    assert {"inference_rng_tracker", "force_reset"} <= set(parameters(mcore_random.initialize_rng_tracker))
    if not backend.has_gpu():  # the CPU tracker is installed only without a GPU
        tracker = mcore_random.get_cuda_rng_tracker()
        with tracker.fork():  # a no-op: no CUDA generator is touched
            pass
        tracker.add("another", 1)  # the inference tracker ignores seeds


def test_attention_output_gate_we_unwrap():
    """megatron wraps the gate in torch.compile (``jit_fuser``); setup restores the eager function,
    which must still compute x * sigmoid(gate) in x's dtype."""
    compiled = backend.original("megatron.core.transformer.attention.Attention._apply_output_gate")
    eager = getattr(compiled, "_torchdynamo_orig_callable", None)
    assert eager is not None, "Attention._apply_output_gate is no longer a torch.compile wrapper"
    assert parameters(eager) == ["self", "x", "gate"]
    x, gate = torch.randn(2, 3, dtype=torch.bfloat16), torch.randn(2, 3)
    expected = (x * torch.sigmoid(gate)).to(torch.bfloat16)
    assert torch.equal(eager(None, x, gate), expected)
    if not backend.has_gpu():
        from megatron.core.transformer.attention import Attention

        assert Attention.__dict__["_apply_output_gate"] is eager


@pytest.mark.skipif(backend.has_gpu(), reason="checks the CPU choices (setup() is a no-op with a GPU)")
def test_setup_is_idempotent_and_redirects_on_cpu():
    backend.setup()  # the test configuration called it already
    backend.setup()
    assert backend.is_set_up() and torch.cuda.current_device() == "cpu"
    assert torch.cuda.current_device is not backend.original("torch.cuda.current_device")
    torch.cuda.current_stream().wait_stream(None)


def run_in_a_fresh_interpreter(code: str) -> None:
    """Run ``code`` where nothing is imported yet (its asserts fail the test with its stderr)."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_importing_the_model_patches_nothing():
    code = (
        "import logging, sys, warnings, torch\n"
        "from megatron.core.tensor_parallel import random as r\n"
        "before = (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.current_stream,"
        " r._get_cuda_rng_state, r._set_cuda_rng_state)\n"
        "state = (list(warnings.filters), list(sys.meta_path))\n"
        "import mimir_megatron.model, mimir_megatron.inference, mimir_megatron.checkpoint\n"
        "import mimir_megatron.data, mimir_megatron.train.loop, mimir_megatron.cli\n"
        "from mimir_megatron import backend\n"
        "from megatron.core.transformer.attention import Attention\n"
        "after = (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.current_stream,"
        " r._get_cuda_rng_state, r._set_cuda_rng_state)\n"
        "assert before == after and not backend.is_set_up()\n"
        "assert warnings.filters == state[0], 'importing added warning filters'\n"
        "assert sys.meta_path == state[1], 'importing added an import hook'\n"
        "quieted = logging.getLogger('megatron.core.datasets.indexed_dataset').level\n"
        "assert quieted == logging.NOTSET, 'importing set a logger level (the set-up does that)'\n"
        "assert hasattr(Attention.__dict__['_apply_output_gate'], '_torchdynamo_orig_callable')\n"
    )
    run_in_a_fresh_interpreter(code)


def test_megatron_core_imports_without_torch_compiler():
    """megatron-core's ``torch.compile`` decorations are deferred to first call
    (``mimir_megatron.megatron_import``): importing the model, trainer, inference and checkpoint
    code imports neither TorchDynamo nor Inductor, torch.compile is torch's own again afterwards,
    and megatron's fused helpers still carry their eager function."""
    code = (
        "import sys, torch\n"
        "real = torch.compile\n"
        "from mimir_megatron.process import setup_process\n"
        "setup_process(configure_logging=False)  # what every entry point does first\n"
        "import mimir_megatron.model, mimir_megatron.train.step, mimir_megatron.inference\n"
        "import mimir_megatron.checkpoint\n"
        "from megatron.core.fusions.fused_bias_swiglu import bias_swiglu\n"
        "from megatron.core.jit import jit_fuser\n"
        "loaded = sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules)\n"
        "assert not loaded, loaded\n"
        "assert torch.compile is real and jit_fuser is not real\n"
        "assert bias_swiglu._torchdynamo_orig_callable.__name__ == 'bias_swiglu'\n"
    )
    run_in_a_fresh_interpreter(code)
