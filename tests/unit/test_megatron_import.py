"""``megatron_import.lazy_compile``: torch.compile, but the compiler runs at the first call."""

from __future__ import annotations

import torch.nn as nn

from mimir_megatron.megatron_import import lazy_compile


class FakeCompile:
    def __init__(self) -> None:
        self.calls: list[tuple[object, dict]] = []

    def __call__(self, model, **options):
        self.calls.append((model, options))
        return lambda *args, **kwargs: ("compiled", model(*args, **kwargs))


def double(x: int) -> int:
    return 2 * x


def test_compiles_once_at_the_first_call_with_the_same_options():
    real = FakeCompile()
    wrapped = lazy_compile(real)(double, dynamic=False)
    assert real.calls == []  # nothing compiled (or imported) at decoration time
    assert wrapped(3) == ("compiled", 6) and wrapped(4) == ("compiled", 8)
    assert real.calls == [(double, {"dynamic": False})]
    assert wrapped.__name__ == "double" and wrapped._torchdynamo_orig_callable is double


def test_decorator_form_and_modules():
    real = FakeCompile()
    decorator = lazy_compile(real)(mode="max-autotune")
    wrapped = decorator(double)
    assert real.calls == [] and wrapped(1) == ("compiled", 2)
    assert real.calls == [(double, {"mode": "max-autotune"})]
    module = nn.Identity()
    lazy_compile(real)(module)  # not a plain function: compiled as torch.compile would
    assert real.calls[-1] == (module, {})
