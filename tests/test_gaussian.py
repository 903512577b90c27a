import pytest
import torch

from lightning_dvi import Gaussian


def test_var_always_available_and_cov_none_in_diag():
    g = Gaussian(torch.zeros(2, 3), var=torch.ones(2, 3))
    assert g.cov is None and g.var.shape == (2, 3) and g.kind == "diag"
    f = g.to_full()
    assert f.cov.shape == (2, 3, 3) and f.is_full
    torch.testing.assert_close(f.var, g.var)
    torch.testing.assert_close(f.to_diag().var, g.var)


def test_sampling_moments():
    cov = torch.tensor([[1.0, 0.8], [0.8, 1.0]], dtype=torch.float64)
    g = Gaussian(torch.tensor([1.0, -1.0], dtype=torch.float64), cov=cov)
    s = g.sample((200_000,))
    torch.testing.assert_close(torch.cov(s.T), cov, atol=0.02, rtol=0)
    assert isinstance(g.to_distribution(), torch.distributions.MultivariateNormal)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mean": torch.zeros(2, 3)}, "exactly one"),
        ({"mean": torch.zeros(2, 3), "var": torch.ones(2, 4)}, "does not match"),
        ({"mean": torch.zeros(2, 3), "cov": torch.ones(2, 3, 2)}, "does not match"),
        ({"mean": torch.zeros(2, 3), "var": -torch.ones(2, 3)}, "negative"),
        ({"mean": torch.zeros(2, 3), "var": torch.ones(2, 3, dtype=torch.float64)}, "dtype"),
        ({"mean": torch.tensor([float("nan")]), "var": torch.ones(1)}, "NaN"),
        ({"mean": torch.zeros(1), "var": torch.tensor([float("inf")])}, "NaN or Inf"),
        ({"mean": torch.zeros(2, dtype=torch.long), "var": torch.ones(2)}, "floating"),
    ],
)
def test_validation_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Gaussian(**kwargs)
