"""from_torch by graph: in-place operations and the ``view(-1, N)`` flattening idiom, against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dvi.nn import GraphNetwork, from_torch

F64 = torch.float64


class InPlace(nn.Module):
    """``l3(g)`` where ``g`` names the tensor that the in-place operations modified.

    ``kind`` picks the in-place spelling; in torch the later read of ``h`` (or of its alias
    ``g``) sees the modified value, which fx records as the node *before* the operation.
    """

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.l1, self.l2, self.l3 = nn.Linear(3, 5), nn.Linear(5, 5), nn.Linear(5, 2)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.l1(x)
        g = h
        if self.kind == "method":
            h.relu_()
        elif self.kind == "function":
            F.relu_(h)
        elif self.kind == "inplace_kwarg":
            F.relu(h, inplace=True)
        elif self.kind == "module":
            self.act(h)
        elif self.kind == "add_":
            h.add_(torch.tanh(self.l2(h)))
        return self.l3(g)


@pytest.mark.parametrize("kind", ["method", "function", "inplace_kwarg", "module", "add_"])
@pytest.mark.parametrize("mode", ["diag", "sample"])
def test_in_place_operations_convert_and_later_reads_see_the_result(kind, mode):
    torch.manual_seed(0)
    torch_net = InPlace(kind).to(F64)
    x = torch.randn(6, 3, dtype=F64)
    net = from_torch(torch_net, scale_fraction=0.0)
    assert isinstance(net, GraphNetwork)
    with torch.no_grad():
        want = torch_net(x.clone())
        plain = torch_net.l3(torch_net.l1(x))
        assert (want - plain).abs().max() > 1e-3  # the in-place operation matters
        if mode == "diag":
            got = net(x, mode="diag").mean
        else:
            got = net(x, mode="sample", num_samples=2)[1]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_in_place_moments_equal_the_out_of_place_network():
    """The same weights written out of place give the same moments (not only the same mean)."""

    class OutOfPlace(nn.Module):
        def __init__(self, twin: InPlace) -> None:
            super().__init__()
            self.l1, self.l2, self.l3 = twin.l1, twin.l2, twin.l3

        def forward(self, x):
            h = self.l1(x)
            return self.l3(h + torch.tanh(self.l2(h)))

    torch.manual_seed(0)
    twin = InPlace("add_").to(F64)
    x = torch.randn(4, 3, dtype=F64)
    torch.manual_seed(1)
    a = from_torch(twin, scale_fraction=0.3)
    b = from_torch(OutOfPlace(twin), scale_fraction=0.3)
    with torch.no_grad():
        for mode in ("full", "diag"):
            got, want = a(x, mode=mode), b(x, mode=mode)
            torch.testing.assert_close(got.mean, want.mean)
            torch.testing.assert_close(got.var, want.var)


def test_an_augmented_add_whose_old_name_is_read_again_is_refused_not_mistranslated():
    """fx records ``h += y`` as ``operator.add`` (out of place): ``g = h`` keeps the old node.

    Torch changes ``g`` too, fx's own graph does not; the converted graph then computes a sum
    that nothing reads, which is refused rather than silently mistranslated.
    """

    class Augmented(InPlace):
        def forward(self, x):
            h = self.l1(x)
            g = h
            h += torch.tanh(self.l2(h))
            return self.l3(g)

    with pytest.raises(NotImplementedError, match=r"nodes \['add'\] are computed but never used"):
        from_torch(Augmented("iadd"))


def test_an_in_place_operation_on_a_viewed_tensor_is_refused():
    class Viewed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.fc = nn.Conv2d(1, 2, 3, padding=1), nn.Linear(32, 2)

        def forward(self, x):
            h = self.conv(x)
            flat = torch.flatten(h, 1)  # shares memory with h
            h.relu_()  # so this changes flat too
            return self.fc(flat)

    with pytest.raises(NotImplementedError, match="shares memory with a view of it"):
        from_torch(Viewed())


class Viewing(nn.Module):
    """A CNN flattened by ``x.view(-1, N)`` (or another spelling) before its output layer."""

    def __init__(self, spelling: str, features: int = 32) -> None:
        super().__init__()
        self.spelling, self.features = spelling, features
        self.conv, self.fc = nn.Conv2d(1, 2, 3, padding=1), nn.Linear(32, 3)

    def forward(self, x):
        h = F.relu(self.conv(x))
        if self.spelling == "view":
            h = h.view(-1, self.features)
        elif self.spelling == "reshape":
            h = h.reshape(-1, self.features)
        elif self.spelling == "size":
            h = h.reshape(h.size(0), self.features)
        else:
            h = h.view(h.shape[0], -1)
        return self.fc(h)


@pytest.mark.parametrize("spelling", ["view", "reshape", "size", "shape"])
@pytest.mark.parametrize("mode", ["full", "diag", "local"])
def test_flattening_views_with_the_batch_inferred_match_torch(spelling, mode):
    torch.manual_seed(0)
    torch_net = Viewing(spelling).to(F64)
    x = torch.randn(5, 1, 4, 4, dtype=F64)
    net = from_torch(torch_net, scale_fraction=0.0)
    with torch.no_grad():
        want = torch_net(x)
        got = net(x, mode=mode)
        got = got.mean if mode != "local" else got[0]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_view_that_would_change_the_batch_size_is_refused_at_run_time():
    torch.manual_seed(0)
    net = from_torch(Viewing("view", features=16), scale_fraction=0.0)  # 32 values per row
    with pytest.raises(ValueError, match=r"x.view\(-1, 16\) of a batch of 5 rows of 32 values"):
        net(torch.randn(5, 1, 4, 4), mode="diag")


def test_other_reshapes_are_still_refused():
    class Unflatten(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x).view(-1, 2, 2)

    with pytest.raises(NotImplementedError, match=r"reshape other than .*x.view\(-1, N\)"):
        from_torch(Unflatten())
