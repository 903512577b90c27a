"""lightning_dvi_benchmarks.resnet_digits: the quick mode's structure, the Laplace adapter, errors.

Only the ``--quick`` smoke test runs here (a tiny subset, seconds); the results themselves are
measured by the full command and recorded in docs/benchmarks.md, never asserted.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lightning_dvi_benchmarks import resnet_digits
from lightning_dvi_benchmarks.baselines import Fitted
from lightning_dvi_benchmarks.classification import fit_dvi
from lightning_dvi_benchmarks.data import Budget, ClassificationSplit, digits_split, plain_cnn
from lightning_dvi_benchmarks.resnet_digits import COLUMNS, Config, as_sequential, main, run
from lightning_dvi_benchmarks.torch_resnet import ResNet


def test_as_sequential_is_the_same_function_and_shares_the_modules() -> None:
    torch.manual_seed(0)
    net = resnet_digits.make_resnet(Config(width=4))
    net.train()
    net(torch.randn(16, 1, 8, 8))  # non-trivial BatchNorm running statistics
    net.eval()
    seq = as_sequential(net)
    x = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(seq(x), net(x))
    assert seq[-1] is net.fc
    assert {id(p) for p in seq.parameters()} == {id(p) for p in net.parameters()}


def test_quick_mode_writes_every_row_with_finite_metrics_in_range(tmp_path: Path) -> None:
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    threads = torch.get_num_threads()
    returned = main(["--quick", "--json", str(out_json), "--markdown", str(out_md)])
    assert torch.get_num_threads() == threads  # restored
    doc = json.loads(out_json.read_text())
    assert doc == json.loads(json.dumps(returned))
    rows = ["deterministic", *resnet_digits.ROWS]
    assert list(doc["runs"]) == rows and list(doc["summary"]) == rows
    assert doc["config"]["seeds"] == [0] and doc["machine"]["threads"] == 1
    for name in rows:
        (one,) = doc["runs"][name]
        for key in COLUMNS:
            assert math.isfinite(one[key]), (name, key)
        for key in ("acc", "ece", "ood_auroc"):
            assert 0.0 <= one[key] <= 1.0, (name, key)
        assert one["nll"] > 0 and one["train_s"] >= 0
    det, temp = doc["runs"]["deterministic"][0], doc["runs"]["temperature"][0]
    assert temp["acc"] == det["acc"]  # a temperature keeps the arg-max
    assert temp["details"]["temperature"] > 0
    assert doc["runs"]["laplace"][0]["details"]["prior_precision"] in (1.0, 100.0)
    dvi = doc["runs"]["dvi_last1"][0]["details"]
    assert dvi["prior_variance"] in (0.1, 1.0) and len(dvi["val_nll_per_prior_variance"]) == 2
    table = out_md.read_text().splitlines()
    assert table[0].startswith("| model | acc | nll | ece | ood_auroc | train_s |")
    assert [line.split(" | ")[0] for line in table[2:]] == [f"| {r}" for r in rows]


def test_a_row_that_changes_the_network_does_not_change_the_next_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def vandal(split: ClassificationSplit, base: Fitted, config: Config, seed: int) -> Fitted:
        assert isinstance(base.net, ResNet)
        with torch.no_grad():
            base.net.fc.weight.zero_()
        return base

    monkeypatch.setitem(resnet_digits.ROWS, "vandal", vandal)
    quiet = {"progress": lambda _: None}
    alone = run(replace(Config.quick(), rows=("deterministic",)), **quiet)
    after = run(replace(Config.quick(), rows=("vandal", "deterministic")), **quiet)
    assert after["vandal"][0]["nll"] == pytest.approx(math.log(10), abs=0.05)  # it did change it
    assert after["deterministic"][0]["nll"] == alone["deterministic"][0]["nll"]


def test_bad_rows_and_options_are_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown rows.*Config\.rows"):
        run(replace(Config.quick(), rows=("deterministic", "nope")), progress=lambda _: None)
    with pytest.raises(ValueError, match="--seeds"):
        main(["--quick", "--seeds", "0"])
    with pytest.raises(ValueError, match="--threads"):
        main(["--quick", "--threads", "0"])


def test_fit_dvi_trains_the_declared_network_it_is_given() -> None:
    from lightning_dvi.nn import from_torch

    split = digits_split("global", images=True, num_train=60)
    net = from_torch(plain_cnn(split.num_classes, channels=(4,), hidden=(8,)))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    fitted = fit_dvi(split, Budget(epochs=1, batch_size=32), 0, mc_eval=4, net=net)
    assert fitted.net is not None and fitted.net.net is net  # trained in place, not rebuilt
    assert any(not torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert fitted.predict(split.x_test[:3]).shape == (3, split.num_classes)


def test_whole_network_row_keeps_the_trained_batch_norm_statistics() -> None:
    from lightning_dvi.nn import BatchNorm2d

    torch.manual_seed(0)
    net = resnet_digits.make_resnet(Config(width=4))
    net.train()
    net(torch.randn(16, 1, 8, 8))
    net.eval()
    converted = resnet_digits._whole(net)
    norms = [m for m in converted.modules() if isinstance(m, BatchNorm2d)]
    assert len(norms) == 20 and all(m.freeze_statistics and m.training for m in norms)
    before = [m.running_mean.clone() for m in norms]
    out = converted(torch.randn(8, 1, 8, 8), mode="diag")  # a training-mode pass
    assert all(torch.equal(b, m.running_mean) for b, m in zip(before, norms, strict=True))
    assert out.var.min() > 0  # every weight layer is Bayesian


def test_step_time_command_reports_both_steps(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_dvi_benchmarks import resnet_step

    out = resnet_step.main(["--width", "4", "--size", "8", "--batch", "4", "--steps", "1"])
    times = out["times"]
    assert isinstance(times, dict) and set(times) == {"deterministic", "ddvi"}
    assert all(len(v) == 1 and v[0] > 0 for v in times.values())
    assert "dDVI" in capsys.readouterr().out
    with pytest.raises(ValueError, match="steps"):
        resnet_step.step_seconds(steps=0)


def test_step_counts_cover_both_steps_and_both_optimisers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from lightning_dvi_benchmarks import resnet_step

    out = resnet_step.main(
        ["--width", "2", "--size", "4", "--batch", "2", "--steps", "1", "--count-ops"]
    )
    counts = out["counts"]
    assert isinstance(counts, dict)
    assert set(counts) == {"deterministic", "ddvi", "deterministic foreach", "ddvi foreach"}
    for name in ("deterministic", "ddvi"):
        # one Adam update per parameter tensor in a loop, or a few foreach ops for all of them
        assert counts[name]["aten ops"] > counts[name + " foreach"]["aten ops"] > 0
    # the moment pass dispatches more than the plain network's forward
    assert counts["ddvi foreach"]["aten ops"] > counts["deterministic foreach"]["aten ops"]
    assert "aten ops" in capsys.readouterr().out
