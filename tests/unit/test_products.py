"""The inference step's weight products (inference/products.py) and the loader thread
(backend.run_in_own_thread): equal to F.linear within float rounding, remade when a weight
changes, and a load that leaves the caller's thread as it was."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.nn.functional as F

from mimir_megatron import backend
from mimir_megatron.inference.products import PrepackedProducts, Products, products_for
from polling import wait_for

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


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
