"""The inference step's weight products (inference/products.py, the C kernels of
mimir_kernels.cpu_step.small_gemm and packed_gemm) and the loader thread (backend.run_in_own_thread): equal to
F.linear within float rounding, each row's result independent of its neighbours and of the thread
count, remade when a weight changes, and a load that leaves the caller's thread as it was."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.nn.functional as F

from mimir_kernels import cpu_step

from mimir_megatron import backend
from mimir_megatron.inference.products import (
    MklProducts,
    NativeGemmProducts,
    NativeProducts,
    PrepackedProducts,
    Products,
    products_for,
)
from kernel_marks import needs_kernel
from polling import wait_for

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


def _why_no_packed_gemm() -> str | None:
    """Why the packed GEMM cannot run here: the C kernels not built (a failed install: never expected
    under CI), or a CPU without AVX-512 (tests/expected_skips.txt)."""
    lib = cpu_step.library()
    if lib is None:
        return "the C kernels are not built"
    return None if cpu_step.packed_gemm_available(lib) else "the packed GEMM needs AVX-512, this CPU has none"


_NO_PACKED_GEMM = _why_no_packed_gemm()
needs_packed_gemm = pytest.mark.skipif(_NO_PACKED_GEMM is not None, reason=_NO_PACKED_GEMM or "")


def _weight(n: int = 96, k: int = 64) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)))


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 8, 33])
def test_prepacked_products_equal_f_linear(rows):
    products, weight = PrepackedProducts(), _weight()
    x = torch.randn(rows, 64)
    hidden = torch.randn(rows, 96)
    with torch.no_grad():
        torch.testing.assert_close(products.linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(products.add_linear(hidden, x, weight), hidden + F.linear(x, weight),
                                   rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("rows", [2, 8, 64])
def test_the_residual_added_in_the_products_epilogue_is_the_separate_sum_bit_for_bit(rows):
    """oneDNN adds ``hidden`` to the accumulated product and rounds once, as ``hidden + product``."""
    products, weight = PrepackedProducts(), _weight(512, 1536)
    x, hidden = torch.randn(rows, 1536), torch.randn(rows, 512)
    with torch.no_grad():
        assert torch.equal(products.add_linear(hidden, x, weight), hidden + products.linear(x, weight))


@needs_onednn
def test_prepacked_products_use_the_prepacked_copy_from_two_rows_or_for_a_large_weight():
    products, weight = PrepackedProducts(), _weight()
    with torch.no_grad():
        products.linear(torch.randn(1, 64), weight)
        assert not products._packed  # one row, a small weight: F.linear on the weight as stored
        products.linear(torch.randn(2, 64), weight)
        assert len(products._packed) == 1
        large = _weight(2048, 256)  # 2 MiB of fp32: streamed from memory, prepacked even for one row
        large.div_(256 ** 0.5)  # a layer's scale: outputs of order 1, where the tolerance is meant
        x = torch.randn(1, 256, generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(products.linear(x, large), F.linear(x, large), rtol=1e-5, atol=1e-5)
        assert len(products._packed) == 2


@needs_onednn
def test_a_weight_changed_in_place_is_packed_again():
    products, weight = PrepackedProducts(), _weight()
    x = torch.randn(4, 64)
    with torch.no_grad():
        products.linear(x, weight)
        weight.mul_(-2.0)  # an optimizer step, load_state_dict: the same tensor, new values
        torch.testing.assert_close(products.linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
        weight.copy_(torch.zeros_like(weight))
        assert products.add_linear(torch.ones(4, 96), x, weight).eq(1).all()


@needs_onednn
def test_other_dtypes_keep_the_stored_weight_exactly():
    products, weight = PrepackedProducts(), _weight().to(torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(products.linear(x, weight), F.linear(x, weight))
    assert not products._packed


def test_products_as_stored_are_f_linear_and_addmm_exactly():
    products, weight = Products(), _weight()
    x, hidden = torch.randn(8, 64), torch.randn(8, 96)
    with torch.no_grad():
        assert torch.equal(products.linear(x, weight), F.linear(x, weight))
        assert torch.equal(products.add_linear(hidden, x, weight), torch.addmm(hidden, x, weight.t()))


def test_the_cpu_backend_prepacks_where_torch_has_onednn():
    chosen = products_for(torch.device("cpu"))
    assert isinstance(chosen, PrepackedProducts) == torch.backends.mkldnn.is_available()
    assert not backend.prepacks_weights(torch.device("meta"))


def _layer_weight(out: int, width: int, seed: int = 0) -> torch.Tensor:
    """A layer's scale: outputs of order 1, where the tolerances are meant."""
    return torch.randn(out, width, generator=torch.Generator().manual_seed(seed)) / width ** 0.5


@needs_kernel
@pytest.mark.parametrize(("rows", "width", "out"), [
    (1, 512, 2048),   # mid512's QKV projection, split over the threads
    (2, 1536, 512),   # its down projection
    (3, 37, 5),       # no 8-wide stride, one thread
    (5, 300, 96),     # 32-wide strides, an 8-wide tail and a scalar tail
    (8, 256, 1536),
])
def test_the_small_product_kernel_is_f_linear_and_adds_the_residual_last(rows, width, out):
    lib = cpu_step.library()
    weight = _layer_weight(out, width)
    x, hidden = torch.randn(rows, width), torch.randn(rows, out)
    product = cpu_step.small_gemm(lib, x, weight)
    torch.testing.assert_close(product, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert torch.equal(cpu_step.small_gemm(lib, x, weight, hidden), hidden + product)


@needs_kernel
def test_a_rows_product_does_not_depend_on_the_rows_beside_it_nor_on_the_thread_count():
    """Batch-invariant: a request's tokens are the same whatever else the step decodes."""
    lib = cpu_step.library()
    weight = _layer_weight(1024, 520)  # 520 = 16 strides of 32, one of 8
    x = torch.randn(8, 520)
    alone = torch.cat([cpu_step.small_gemm(lib, x[r:r + 1].contiguous(), weight) for r in range(8)])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            for rows in range(1, 9):
                assert torch.equal(cpu_step.small_gemm(lib, x[:rows], weight), alone[:rows]), (count, rows)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_the_small_product_kernel_refuses_other_inputs_in_one_line():
    lib, weight = cpu_step.library(), torch.randn(16, 8)
    for x, w, add in ((torch.randn(2, 8, dtype=torch.float64), weight, None),
                      (torch.randn(8, 2).t(), weight, None),  # not contiguous
                      (torch.randn(2, 7), weight, None),
                      (torch.randn(2, 8), weight, torch.randn(2, 15))):
        with pytest.raises(ValueError, match="^small_gemm: fp32 contiguous CPU tensors"):
            cpu_step.small_gemm(lib, x, w, add)


def _packed(weight: torch.Tensor) -> torch.Tensor:
    return cpu_step.pack_weight(cpu_step.library(), weight)


@needs_packed_gemm
@pytest.mark.parametrize(("rows", "width", "out"), [
    (1, 64, 96),      # one row, three panels
    (2, 512, 2048),   # mid512's QKV projection at a decoding step's rows
    (7, 300, 100),    # a row block short of 8, a last panel of 4 outputs
    (8, 37, 5),       # fewer outputs than a panel
    (5, 100, 24),     # a panel's second vector of 16 outputs 8 short
    (13, 64, 57),     # ... 7 short in the last panel, row blocks of 8 and 5
    (64, 1536, 512),  # a prompt against mid512's down projection
    (203, 1536, 40),  # three chunks of rows, the last block of 3
    (3, 0, 40),       # no inputs: zeros, the residual as it is
])
def test_the_packed_gemm_is_f_linear_and_adds_the_residual_last(rows, width, out):
    lib = cpu_step.library()
    weight = _layer_weight(out, width)
    x, hidden = torch.randn(rows, width), torch.randn(rows, out)
    product = cpu_step.packed_gemm(lib, x, _packed(weight), out)
    exact = (x.double() @ weight.double().T).float()
    torch.testing.assert_close(product, exact, rtol=1e-5, atol=2e-6 * width ** 0.5)
    assert torch.equal(cpu_step.packed_gemm(lib, x, _packed(weight), out, hidden), hidden + product)


@needs_packed_gemm
def test_a_rows_packed_product_does_not_depend_on_the_rows_beside_it_nor_on_the_thread_count():
    """Each result one chain over the inputs in order: a row alone, among 1-203 others (every row
    block's length, several chunks), on 1-3 threads and read with a row stride, bit for bit."""
    lib = cpu_step.library()
    weight = _layer_weight(200, 1536)
    packed = _packed(weight)
    x = torch.randn(203, 1536)
    alone = torch.cat([cpu_step.packed_gemm(lib, x[r:r + 1], packed, 200) for r in range(203)])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            for rows in (*range(2, 10), 17, 64, 203):
                assert torch.equal(cpu_step.packed_gemm(lib, x[:rows], packed, 200), alone[:rows]), (count, rows)
    finally:
        torch.set_num_threads(threads)
    wide = torch.randn(203, 2000)
    wide[:, 100:1636] = x
    assert torch.equal(cpu_step.packed_gemm(lib, wide[:, 100:1636], packed, 200), alone)


@needs_packed_gemm
def test_the_packed_gemm_refuses_other_inputs_in_one_line():
    lib, weight = cpu_step.library(), torch.randn(16, 8)
    packed = _packed(weight)
    for x, p, add in ((torch.randn(2, 8, dtype=torch.float64), packed, None),
                      (torch.randn(8, 2).t(), packed, None),  # strided columns
                      (torch.randn(2, 7), packed, None),  # packed for another width
                      (torch.randn(2, 8), packed[:-1], None),
                      (torch.randn(2, 8), packed, torch.randn(2, 15))):
        with pytest.raises(ValueError, match="^packed_gemm: fp32 CPU x"):
            cpu_step.packed_gemm(lib, x, p, 16, add)
    with pytest.raises(ValueError, match="^pack_weight: an fp32 contiguous CPU weight"):
        cpu_step.pack_weight(lib, weight.t())


def _route_rows(products) -> None:
    """1, 8, 9 and 33 fp32 rows, each result checked against ``F.linear``; then bf16 rows and
    non-contiguous rows."""
    weight = _layer_weight(96, 64)
    with torch.no_grad():
        for rows in (1, 8, 9, 33):
            x, hidden = torch.randn(rows, 64), torch.randn(rows, 96)
            torch.testing.assert_close(products.linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(products.add_linear(hidden, x, weight), hidden + F.linear(x, weight),
                                       rtol=1e-5, atol=1e-5)
        products.linear(torch.randn(4, 64, dtype=torch.bfloat16), weight.to(torch.bfloat16))
        products.linear(torch.randn(64, 4).t(), weight)  # not contiguous: oneDNN's


@needs_kernel
@needs_onednn
def test_native_products_send_one_to_eight_fp32_rows_to_the_c_loop_and_more_to_onednn(monkeypatch):
    calls = []
    kernel = cpu_step.small_gemm
    monkeypatch.setattr(cpu_step, "small_gemm", lambda *a, **k: calls.append(a[1].shape[0]) or kernel(*a, **k))
    _route_rows(NativeProducts(cpu_step.library(), 8))
    assert calls == [1, 1, 8, 8]


@needs_packed_gemm
def test_native_gemm_products_send_one_row_to_the_c_loop_and_more_to_the_packed_gemm(monkeypatch):
    calls = []
    loop, gemm = cpu_step.small_gemm, cpu_step.packed_gemm
    monkeypatch.setattr(cpu_step, "small_gemm", lambda *a, **k: calls.append(("loop", a[1].shape[0])) or loop(*a, **k))
    monkeypatch.setattr(cpu_step, "packed_gemm",
                        lambda *a, **k: calls.append(("gemm", a[1].shape[0])) or gemm(*a, **k))
    _route_rows(NativeGemmProducts(cpu_step.library()))  # bf16: F.linear's
    assert calls == [("loop", 1), ("loop", 1)] + [("gemm", n) for n in (8, 8, 9, 9, 33, 33, 4)]
    big, x = _layer_weight(1024, 512), torch.randn(3, 512)  # 2 MiB: one row still the C loop's
    calls.clear()
    with torch.no_grad():
        NativeGemmProducts(cpu_step.library()).linear(x[:1], big)
        NativeGemmProducts(cpu_step.library()).linear(x[:2], big)
    assert calls == [("loop", 1), ("gemm", 2)]


@needs_packed_gemm
def test_the_packed_gemm_products_pack_a_weight_again_once_it_changed_in_place():
    products, weight = NativeGemmProducts(cpu_step.library()), _layer_weight(96, 64)
    x = torch.randn(4, 64)
    with torch.no_grad():
        products.linear(x, weight)
        weight.mul_(-2.0)
        torch.testing.assert_close(products.linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
        out = products.linear(x.view(2, 2, 64), weight)  # leading dimensions kept, as F.linear's
        assert out.shape == (2, 2, 96) and torch.equal(out.view(4, 96), products.linear(x, weight))
        repeated = x[:1].expand(3, 64)  # rows that overlap (stride 0): copied before the kernel
        assert torch.equal(products.linear(repeated, weight), products.linear(repeated.contiguous(), weight))


@needs_onednn
def test_mkl_products_send_few_rows_and_small_weights_to_the_weights_as_stored(monkeypatch):
    """The few rows' results are F.linear's and addmm's bit for bit: MKL's sgemm, not oneDNN's;
    more rows too for a weight under 2 MiB; a larger one from 4 rows on oneDNN's."""
    products, weight = MklProducts(3), _layer_weight(96, 64)
    x, hidden = torch.randn(8, 64), torch.randn(8, 96)
    with torch.no_grad():
        assert torch.equal(products.linear(x, weight), F.linear(x, weight))
        assert torch.equal(products.add_linear(hidden, x, weight), torch.addmm(hidden, x, weight.t()))
    calls = []
    linear, add_linear = Products.linear, Products.add_linear
    monkeypatch.setattr(Products, "linear", lambda self, x, w: calls.append(x.shape[0]) or linear(self, x, w))
    monkeypatch.setattr(Products, "add_linear",
                        lambda self, h, x, w: calls.append(x.shape[0]) or add_linear(self, h, x, w))
    _route_rows(products)  # a weight in the caches: every product as stored, bf16 and non-contiguous too
    assert calls == [1, 1, 8, 8, 9, 9, 33, 33, 4, 4]
    calls.clear()
    big, x = _layer_weight(1024, 512), torch.randn(9, 512)  # 2 MiB: streams from memory
    with torch.no_grad():
        for rows in (9, 4, 3):
            torch.testing.assert_close(products.linear(x[:rows], big), F.linear(x[:rows], big),
                                       rtol=1e-5, atol=1e-5)
    assert calls == [3]  # 4 and 9 rows of it: oneDNN's


@needs_kernel
@needs_onednn
def test_native_products_take_a_streamed_weight_up_to_their_limit_and_a_cached_one_at_every_few_row_count(
        monkeypatch):
    """With AVX-512's limit (4 rows) a 2 MiB weight goes to the C loop at 1-4 rows and to oneDNN at
    5 and 8; a weight in the caches to the C loop at 8."""
    calls = []
    kernel = cpu_step.small_gemm
    monkeypatch.setattr(cpu_step, "small_gemm",
                        lambda *a, **k: calls.append((a[1].shape[0], a[2].shape[0])) or kernel(*a, **k))
    products = NativeProducts(cpu_step.library(), 4)
    big, small, x = _layer_weight(1024, 512), _layer_weight(96, 512), torch.randn(8, 512)
    with torch.no_grad():
        for rows in (1, 4, 5, 8):
            torch.testing.assert_close(products.linear(x[:rows], big), F.linear(x[:rows], big),
                                       rtol=1e-5, atol=1e-5)
        products.linear(x, small)
    assert calls == [(1, 1024), (4, 1024), (8, 96)]


@needs_onednn
@pytest.mark.parametrize(("vendor", "isa", "kernels", "chosen", "streamed"), [
    ("GenuineIntel", "AVX512", "", MklProducts, 3),
    ("AuthenticAMD", "AVX2", "", NativeProducts, 8),
    ("AuthenticAMD", "AVX512", "", NativeGemmProducts, 1),  # the packed GEMM from two rows
    ("", "AVX2", "", NativeProducts, 8),  # /proc/cpuinfo silent
    ("AuthenticAMD", "AVX2", "torch", PrepackedProducts, None),  # the C kernels turned off
])
def test_the_few_rows_kernel_is_picked_by_the_cpus_vendor_and_its_limit_by_the_isa(
        monkeypatch, vendor, isa, kernels, chosen, streamed):
    monkeypatch.setattr(backend, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: isa)
    monkeypatch.setenv("MIMIR_CPU_KERNELS", kernels)
    cpu_step.library.cache_clear()
    try:
        if chosen in (NativeProducts, NativeGemmProducts) and cpu_step.library() is None:
            pytest.skip("the C kernels are not built")
        if chosen is NativeGemmProducts and not cpu_step.packed_gemm_available(cpu_step.library()):
            chosen, streamed = NativeProducts, 4  # the library checks the CPU itself
        if chosen is MklProducts and not torch.backends.mkl.is_available():
            pytest.skip("torch without MKL")
        products = products_for(torch.device("cpu"))
        assert type(products) is chosen
        assert getattr(products, "streamed_max_rows", None) == streamed
    finally:
        cpu_step.library.cache_clear()
    assert backend.few_row_products(torch.device("meta")) is None


def test_cpu_vendor_reads_proc_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\n")
    assert backend.cpu_vendor(cpuinfo) == "GenuineIntel"
    cpuinfo.write_text("processor\t: 0\nisa\t\t: rv64imafdc\n")  # no vendor_id (RISC-V, some ARM)
    assert backend.cpu_vendor(cpuinfo) == ""
    assert backend.cpu_vendor(tmp_path / "missing") == ""


@pytest.mark.skipif(backend.has_gpu(), reason="on a GPU the work runs in the caller's thread")
def test_run_in_own_thread_runs_elsewhere_and_passes_results_and_errors_back():
    caller = threading.get_ident()
    assert backend.run_in_own_thread(threading.get_ident) != caller
    with pytest.raises(KeyError, match="missing"):
        backend.run_in_own_thread(lambda: {}["missing"])


@pytest.mark.skipif(backend.has_gpu(), reason="on a GPU the work runs in the caller's thread")
def test_load_engine_loads_on_a_thread_of_its_own(monkeypatch):
    from mimir_megatron.inference import loading

    monkeypatch.setattr(loading, "_load", lambda **kwargs: (threading.get_ident(), kwargs["max_batch_size"]))
    loader, batch = loading.load_engine(hf="unused", max_batch_size=3)
    assert loader != threading.get_ident() and batch == 3


@pytest.mark.skipif(backend._libgomp() is None, reason="torch's OpenMP is not a loaded libgomp")
def test_release_cpu_thread_pool_ends_the_calling_threads_workers():
    """The OS threads of the process: a parallel region gives a fresh thread a pool of
    (threads - 1) workers; releasing it ends them; the next region makes them again."""
    def tasks() -> int:
        return len(os.listdir("/proc/self/task"))

    seen: dict[str, object] = {}

    def work() -> None:
        torch.ones(1 << 22).sum()  # parallel: this thread's own pool
        seen["with_pool"] = with_pool = tasks()
        seen["released"] = backend.release_cpu_thread_pool()
        wait_for(lambda: tasks() <= with_pool - 1, "the released workers to end", timeout=10)
        torch.ones(1 << 22).sum()
        seen["again"] = tasks()

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(threads)
    assert seen["released"] is True and seen["again"] == seen["with_pool"]


def test_serving_in_a_thread_releases_the_callers_pool_before_the_server_starts(monkeypatch):
    """serve_in_thread (the evaluation during training, tests, notebooks) frees the waiting
    thread's workers before the server's scheduler decodes."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI

    from mimir_megatron.inference.server import serve_app_in_thread

    calls: list[str] = []
    monkeypatch.setattr(backend, "release_cpu_thread_pool", lambda: calls.append("released") or True)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        calls.append("server started")
        yield

    with serve_app_in_thread(FastAPI(lifespan=lifespan)):
        assert calls == ["released", "server started"]
