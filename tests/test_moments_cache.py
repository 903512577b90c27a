"""moments._cache.cached: the one guard of the per-process constant caches (linear, quadrature)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_dvi.moments import _quadrature, linear
from lightning_dvi.moments._cache import cached


def test_plain_tensors_are_built_once_and_kept() -> None:
    cache: dict[str, torch.Tensor] = {}
    calls = []

    def build() -> torch.Tensor:
        calls.append(1)
        return torch.arange(3.0)

    first = cached(cache, "k", build)
    assert cached(cache, "k", build) is first
    assert len(calls) == 1 and cache["k"] is first


def test_a_fake_tensor_is_returned_but_never_cached() -> None:
    cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    with FakeTensorMode():
        fake = cached(cache, "k", lambda: (torch.zeros(2), torch.ones(2)))
    assert type(fake[0]) is not torch.Tensor
    assert cache == {}
    real = cached(cache, "k", lambda: (torch.zeros(2), torch.ones(2)))
    assert type(real[0]) is torch.Tensor and cache["k"] is real


def test_built_outside_inference_mode() -> None:
    cache: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        value = cached(cache, "k", lambda: torch.ones(2))
    assert not value.is_inference()
    # autograd may save it afterwards
    w = torch.ones(2, requires_grad=True)
    (w * value).sum().backward()
    assert w.grad is not None and w.grad.tolist() == [1.0, 1.0]


def test_built_fresh_while_compiling(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    cache: dict[str, torch.Tensor] = {}
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    a, b = cached(cache, "k", lambda: torch.ones(1)), cached(cache, "k", lambda: torch.ones(1))
    assert a is not b and cache == {}


def test_both_caches_use_it(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    seen = []

    def spy(cache, key, build):  # type: ignore[no-untyped-def]
        seen.append(key)
        return build()

    monkeypatch.setattr(linear, "cached", spy)
    monkeypatch.setattr(_quadrature, "cached", spy)
    rows, cols, spread = linear._pair_index(3, torch.device("cpu"))
    nodes = _quadrature.constant((0.5, 1.5), torch.float64, torch.device("cpu"))
    assert len(seen) == 2
    assert rows.tolist() == [0, 0, 0, 1, 1, 2] and cols.tolist() == [0, 1, 2, 1, 2, 2]
    assert spread.tolist() == [0, 1, 2, 1, 3, 4, 2, 4, 5]
    assert nodes.tolist() == [0.5, 1.5] and nodes.dtype == torch.float64
