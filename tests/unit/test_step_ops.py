"""The inference step's operations besides the products (inference/step_ops.py): the C kernels
(mimir_kernels/cpu_step.py) against torch's operations, the same step fed to both: the same
cached keys and values bit for bit, the same gated contexts and norms within float rounding, for
decoding rows of equal and of different lengths, with and without joining prompts; the kernels
picked where they apply and built by the install; bad input refused in one line."""

from __future__ import annotations

import pytest
import torch
from mimir_kernels import cpu_step as kernel

from mimir_megatron.inference.kv_cache import KVCache
from mimir_megatron.inference.step_ops import NativeOps, Prompts, StepTokens, TorchOps, ops_for
from mimir_megatron.model.rope import RotaryTable, rotary_angles
from kernel_marks import needs_kernel


@pytest.fixture
def fresh_library():
    """mimir_kernels.cpu_step, its loaded library forgotten before and after the test."""
    kernel.library.cache_clear()
    yield kernel
    kernel.library.cache_clear()


def _step(lengths: list[int], prompt_lengths: list[int], heads: int, head_dim: int, seed: int):
    """A cache whose rows ``0 .. len(lengths) - 1`` hold ``lengths`` random tokens, a step that
    decodes one token for each and prefills ``prompt_lengths`` (runs of equal lengths grouped as
    the engine groups them), and that step's fused q / gate / k / v projection output."""
    g = torch.Generator().manual_seed(seed)
    cache = KVCache()
    decoding = len(lengths)
    cache.reserve(decoding + len(prompt_lengths), max([n + 1 for n in lengths] + prompt_lengths + [1]))
    keys, values = cache.buffers((0, 1), torch.empty(1, heads, head_dim))
    keys.copy_(torch.randn(keys.shape, generator=g))
    values.copy_(torch.randn(values.shape, generator=g))
    cache.add_rows(lengths)
    decode = cache.decode_rows(decoding) if decoding else None
    prompts: list[Prompts] = []
    offset, row = decoding, decoding
    for n in prompt_lengths:
        if prompts and prompts[-1].length == n:
            prompts[-1].count += 1
        else:
            prompts.append(Prompts(row, 1, n, offset))
        offset, row = offset + n, row + 1
    positions = lengths + [p for n in prompt_lengths for p in range(n)]
    rotary = RotaryTable(rotary_angles(torch.tensor(positions)[None], head_dim, 10000.0))
    mixed = torch.randn(len(positions), heads, 4, head_dim, generator=g)
    return StepTokens.of(decode, prompts, rotary), mixed, keys, values


def _both(lengths, prompt_lengths, heads=4, head_dim=32, seed=0, scale=None):
    step, mixed, keys, values = _step(lengths, prompt_lengths, heads, head_dim, seed)
    torch_keys, torch_values = keys.clone(), values.clone()
    expected = TorchOps().attend(mixed, torch_keys, torch_values, step, scale, torch.float32)
    ops = NativeOps(kernel.library())
    ops.prepare(step)
    got = ops.attend(mixed, keys, values, step, scale, torch.float32)
    return (expected, torch_keys, torch_values), (got, keys, values)


@needs_kernel
@pytest.mark.parametrize(("lengths", "prompt_lengths"), [
    ([5], []),  # one decoding row
    ([7, 7, 7], []),  # equal lengths: torch writes at one position, no mask
    ([1, 9, 4, 30, 2], []),  # different lengths: torch pads to the longest under a mask
    ([3, 12], [6, 6, 2]),  # decoding rows and joining prompts in one step
    ([], [4, 9]),  # prompts alone: the prompts' kernel
    ([2], [300, 7]),  # 300 x 32 over NativeOps.PROMPT_KERNEL_MAX: RoPE, the writes and the gate in C around SDPA
])
def test_the_kernel_caches_torchs_keys_bit_for_bit_and_attends_as_sdpa_does(lengths, prompt_lengths):
    (expected, torch_keys, torch_values), (got, keys, values) = _both(lengths, prompt_lengths)
    assert torch.equal(keys, torch_keys) and torch.equal(values, torch_values)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize(("heads", "head_dim", "scale", "atol"), [
    (1, 2, None, 1e-6), (8, 64, None, 1e-6), (2, 512, None, 1e-6),
    # scores of +-15: SDPA and the kernels each land up to ~4e-6 from the float64 attention
    (3, 128, 0.3, 8e-6),
])
def test_the_kernel_attends_as_sdpa_does_at_any_head_shape_and_scale(heads, head_dim, scale, atol):
    (expected, torch_keys, _), (got, keys, _) = _both([2, 17, 40], [5], heads, head_dim, seed=head_dim, scale=scale)
    assert torch.equal(keys, torch_keys)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=atol)


@needs_kernel
def test_the_kernels_result_does_not_depend_on_the_thread_count():
    """Each (token, head) is one thread's work from start to end: any count sums in one order."""
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(_both([3, 50, 21, 8], [], heads=5, head_dim=64)[1][0])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@needs_kernel
@pytest.mark.parametrize(("rows", "width"), [(1, 512), (3, 7), (32, 1536), (200, 256)])
def test_the_norm_kernel_is_torchs_rms_norm(rows, width):
    """Every row's scale within float rounding; 200 x 256 is split over the threads."""
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows)) * 3 + 0.5
    got = NativeOps(kernel.library()).norm(x, 1e-5)
    torch.testing.assert_close(got, TorchOps().norm(x, 1e-5), rtol=2e-6, atol=1e-6)
    tiny = torch.full((2, 16), 1e-4)  # the eps inside the root, not added outside it
    torch.testing.assert_close(NativeOps(kernel.library()).norm(tiny, 1e-5), TorchOps().norm(tiny, 1e-5))
    with pytest.raises(ValueError, match="fp32 contiguous"):
        kernel.rms_norm(kernel.library(), x.double(), 1e-5)


@needs_kernel
def test_the_kernel_refuses_what_would_write_outside_the_cache_in_one_line():
    step, mixed, keys, values = _step([4, 6], [], heads=2, head_dim=8, seed=1)
    lib = kernel.library()
    rows, positions, attended = torch.arange(2), torch.tensor([4, keys.shape[2]]), torch.tensor([5, 7])
    with pytest.raises(ValueError, match="outside the cache's buffers"):
        kernel.cache_attention(lib, mixed, step.cos, step.sin_signed, keys, values, rows, positions, attended, 0.3)
    with pytest.raises(ValueError, match="outside the cache's buffers"):
        kernel.cache_attention(lib, mixed, step.cos, step.sin_signed, keys, values, torch.tensor([0, 9]),
                               torch.tensor([4, 6]), attended, 0.3)
    with pytest.raises(ValueError, match="fp32 contiguous CPU tensors"):
        kernel.cache_attention(lib, mixed.double(), step.cos, step.sin_signed, keys, values, rows,
                               torch.tensor([4, 6]), attended, 0.3)
    with pytest.raises(ValueError, match="^rope_store: a row, position or attended length outside"):
        kernel.rope_store(lib, mixed, step.cos, step.sin_signed, keys, values, rows, positions)
    with pytest.raises(ValueError, match="^rope_store: fp32 contiguous CPU tensors"):
        kernel.rope_store(lib, mixed, step.cos, step.sin_signed, keys, values, rows, torch.tensor([4.0, 6.0]))
    with pytest.raises(ValueError, match="^gate: fp32 contiguous CPU tensors"):
        kernel.gate(lib, torch.zeros(2, 15), mixed)
    wide = torch.zeros(1, 1, 4, kernel.MAX_HEAD_DIM + 2)
    table = torch.zeros(1, kernel.MAX_HEAD_DIM + 2)
    cache = torch.zeros(1, 1, 4, kernel.MAX_HEAD_DIM + 2)
    with pytest.raises(ValueError, match="head width over 512"):
        kernel.cache_attention(lib, wide, table, table, cache, cache.clone(), torch.tensor([0]), torch.tensor([0]),
                               torch.tensor([1]), 0.3)
    with pytest.raises(ValueError, match="head width over 512"):
        kernel.rope_store(lib, wide, table, table, cache, cache.clone(), torch.tensor([0]), torch.tensor([0]))


@needs_kernel
def test_the_install_built_the_kernel_and_fp32_cpu_steps_use_it(fresh_library):
    """The test environment installs the package with a C compiler (tests/run.sh): its CPU step
    attends through the built kernel, never a silent fall back to torch's operations."""
    assert fresh_library.library_path() is not None, (
        "the install built no mimir_kernels/_cpu_step: install a C compiler (apt-get install gcc) "
        "and pip install -e . again")
    assert type(ops_for(torch.device("cpu"), torch.float32)) is NativeOps
    assert type(ops_for(torch.device("cpu"), torch.bfloat16)) is TorchOps
    assert type(ops_for(torch.device("meta"), torch.float32)) is TorchOps


def test_without_the_built_kernel_the_step_uses_torch_and_says_so_once(fresh_library, tmp_path, monkeypatch,
                                                                      caplog):
    broken = tmp_path / "_cpu_step.so"
    broken.write_bytes(b"not a shared library")
    for where, cause in ((None, "were not built at install time"), (broken, "do not load")):
        monkeypatch.setattr(fresh_library, "library_path", lambda where=where: where)
        fresh_library.library.cache_clear()
        caplog.clear()
        with caplog.at_level("INFO", logger="mimir_kernels.cpu_step"):
            for _ in range(2):
                assert type(ops_for(torch.device("cpu"), torch.float32)) is TorchOps
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and cause in lines[0] and "torch's operations" in lines[0], lines
    monkeypatch.undo()
    monkeypatch.setenv("MIMIR_CPU_KERNELS", "torch")
    fresh_library.library.cache_clear()
    caplog.clear()
    with caplog.at_level("INFO", logger="mimir_kernels.cpu_step"):
        assert type(ops_for(torch.device("cpu"), torch.float32)) is TorchOps
    assert not caplog.records


@needs_kernel
def test_the_exp_kernel_is_libms_expf_bit_for_bit_on_vector_lanes(fresh_library):
    """csrc/exp.c: every 64th float bit pattern (every exponent and sign, inf and nan among them)
    gives libm's expf bit for bit, and where torch sees AVX2 (which it takes with FMA) through the
    vector lanes, not a fall back to expf one value at a time."""
    lib = fresh_library.library()
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert lib.mimir_exp_uses_lanes() == 1
    chunk = 1 << 22
    for start in range(0, 1 << 32, chunk * 64):
        patterns = torch.arange(start, start + chunk * 64, 64, dtype=torch.int64)
        values = (patterns - (patterns >= 1 << 31).long() * (1 << 32)).to(torch.int32).view(torch.float32)
        got, expected = values.clone(), values.clone()
        lib.mimir_exp(got.data_ptr(), got.numel())
        lib.mimir_exp_libm(expected.data_ptr(), expected.numel())
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), hex(start)


@needs_kernel
def test_the_gate_kernel_is_the_sigmoid_formula_with_libms_expf(fresh_library):
    """The output gate: context * (1 / (1 + expf(-gate))), each operation rounded on its own."""
    lib = fresh_library.library()
    g = torch.Generator().manual_seed(4)
    for head_dim in (40, 1200):  # wider than the kernels' scratch of 512: in pieces
        mixed = torch.randn(37, 3, 4, head_dim, generator=g) * 6
        context = torch.randn(37, 3 * head_dim, generator=g)
        e = (-mixed[:, :, 1]).contiguous()
        lib.mimir_exp_libm(e.data_ptr(), e.numel())
        expected = (1.0 / (1.0 + e)).view(37, -1) * context
        got = kernel.gate(lib, context.clone(), mixed)
        assert torch.equal(got, expected)


def _prompt_step(prompt_lengths: list[int], heads: int = 3, head_dim: int = 48, seed: int = 0):
    """A step of joining prompts alone, prepared for the prompts' kernel."""
    step, mixed, keys, values = _step([], prompt_lengths, heads, head_dim, seed)
    NativeOps(kernel.library()).prepare(step)
    return step, mixed, keys, values


def _prompt_contexts(step, mixed, keys, values, scale=0.2):
    return kernel.prompt_attention(kernel.library(), mixed, step.cos, step.sin_signed, keys, values,
                                   *step.prompt_index, step.prompt_table, scale)


@needs_kernel
def test_the_prompt_kernels_result_depends_on_neither_threads_nor_the_prompts_beside_it():
    """Each score and context element is summed in one fixed order, whoever computes it: any
    thread count, and a prompt alone or among others (lengths that fill no vector, and over the
    64-key tile), gives the same bits."""
    lengths = [5, 70, 13, 64]
    step, mixed, keys, values = _prompt_step(lengths)
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(_prompt_contexts(step, mixed, keys.clone(), values.clone()))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    offset = 0
    for n in lengths:
        alone_step, _, alone_keys, alone_values = _prompt_step([n])
        alone = _prompt_contexts(alone_step, mixed[offset:offset + n].contiguous(), alone_keys, alone_values)
        assert torch.equal(alone, results[0][offset:offset + n]), n
        offset += n


@needs_kernel
def test_prompts_up_to_the_kernels_limit_take_it_and_longer_ones_sdpa(monkeypatch):
    calls = []
    monkeypatch.setattr(kernel, "prompt_attention", lambda *a, real=kernel.prompt_attention: calls.append(1) or real(*a))
    limit = NativeOps.PROMPT_KERNEL_MAX // 32
    for prompts, expected in (([limit, 3], 1), ([limit + 1, 3], 0)):
        calls.clear()
        (reference, _, _), (got, _, _) = _both([], prompts)
        torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-6)
        assert len(calls) == expected, prompts


@needs_kernel
def test_the_prompt_kernel_refuses_a_prompt_outside_the_step_or_the_cache_in_one_line():
    step, mixed, keys, values = _prompt_step([4, 6], heads=2, head_dim=8)
    lib = kernel.library()
    args = (lib, mixed, step.cos, step.sin_signed, keys, values, *step.prompt_index)
    for table in ([[0, 0, 4], [1, 4, 7]],  # past the step's last token
                  [[0, 0, 4], [9, 4, 6]],  # a row outside the cache
                  [[0, 0, 0], [1, 4, 6]]):  # an empty prompt
        with pytest.raises(ValueError, match="^prompt_attention: a row, position or attended length outside"):
            kernel.prompt_attention(*args, torch.tensor(table), 0.3)
    with pytest.raises(ValueError, match="^prompt_attention: prompts is a contiguous"):
        kernel.prompt_attention(*args, torch.tensor([0, 0, 4]), 0.3)
