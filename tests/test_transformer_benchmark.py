"""lightning_dvi_benchmarks.transformer: the generated data, and the recipe's ``--quick`` run.

Only the quick mode runs here (tiny data, seconds); its results are checked for structure and
sense (every row, valid probabilities, accuracy above chance), never its timings. The figures
themselves come from the full command in docs/transformer_benchmark.md.
"""

from __future__ import annotations

import json
import math
import runpy
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lightning_dvi_benchmarks import transformer as tb

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "transformer_benchmark.py"


def test_patches_cut_images_into_row_major_square_blocks() -> None:
    images = torch.arange(2 * 64.0).reshape(2, 8, 8)
    out = tb.patches(images)
    assert out.shape == (2, 16, 4)
    # patch (r, c) holds pixels [2r:2r+2, 2c:2c+2]
    for r in range(4):
        for c in range(4):
            block = images[:, 2 * r : 2 * r + 2, 2 * c : 2 * c + 2].reshape(2, 4)
            torch.testing.assert_close(out[:, 4 * r + c], block)


def test_sequence_labels_follow_the_majority_rule_up_to_the_label_noise() -> None:
    config = tb.Config(sequence_rows=(4000, 10, 10, 500))
    task = tb.sequence_task(config)
    x, y = task.split.x_train, task.split.y_train
    assert int(x.max()) < tb.SEQUENCE_SYMBOLS  # in-distribution symbols only
    counts = torch.stack([((x // 4) == g).sum(-1) for g in range(3)], -1)
    top = counts.topk(2, dim=-1).values
    assert bool((top[:, 0] > top[:, 1]).all())  # no ties
    agree = float((counts.argmax(-1) == y).double().mean())
    # Binomial(4000, 0.8): standard deviation 0.0063
    assert abs(agree - (1 - config.label_noise)) < 0.03
    unseen = float((task.ood >= tb.SEQUENCE_SYMBOLS).double().mean())
    assert abs(unseen - 0.5) < 0.03
    # the data depend on data_seed only
    torch.testing.assert_close(tb.sequence_task(config).split.x_test, task.split.x_test)


def test_digits_task_holds_out_one_class_as_the_ood_set() -> None:
    task = tb.digits_task(tb.Config(held_out=3))
    split = task.split
    assert split.num_classes == 9 and int(split.y_train.max()) == 8
    assert split.x_train.shape[1:] == (16, 4) and task.ood.shape[1:] == (16, 4)
    assert len(task.ood) == 183  # every image of digit 3
    # one global standardisation fitted on the training rows
    assert abs(float(split.x_train.mean())) < 1e-5
    assert abs(float(split.x_train.std()) - 1) < 1e-3


def test_quick_recipe_run_writes_every_row_with_valid_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", [str(RECIPE), "--quick", "--json", str(out)])
    runpy.run_path(str(RECIPE), run_name="__main__")
    document = json.loads(out.read_text())
    assert set(document["runs"]) == set(tb.TASKS)
    chance = {"digits": 1 / 9, "sequence": 1 / 3}
    for task, rows in document["runs"].items():
        assert list(rows) == list(tb.ROWS)
        for name, runs in rows.items():
            (metrics,) = runs  # one seed
            assert 0 <= metrics["ece"] <= 1 and 0 <= metrics["ood_auroc"] <= 1
            assert math.isfinite(metrics["nll"]) and metrics["nll"] > 0
            assert metrics["cost"] > 0 and metrics["train_s"] >= 0
            assert metrics["acc"] > chance[task], (task, name, metrics["acc"])
        accept = document["acceptance"][task]["posthoc_ivon"]
        assert set(accept["checks"]) == {"nll", "ece", "cost"}


def test_one_pass_and_monte_carlo_predictives_are_probabilities() -> None:
    config = tb.Config.quick()
    task = tb.digits_task(config)
    fit = tb.fit_ivon(task, config, seed=0)
    x = task.split.x_test[:16]
    one_pass = tb.fit_posthoc_ivon(task, fit, config, calibrate=False).predict(x)
    monte_carlo = tb.ivon_mc_row(task, fit, 8).predict(x)
    fast = tb.fit_posthoc_ivon_rules(fit, "posthoc_ivon_fast").predict(x)
    closed = tb.fit_posthoc_ivon_rules(fit, "posthoc_ivon_closed").predict(x)
    indep = tb.fit_posthoc_ivon_rules(fit, "posthoc_ivon_indep").predict(x)
    slope = tb.fit_posthoc_ivon_rules(fit, "posthoc_ivon_slope").predict(x)
    suq = tb.fit_posthoc_ivon_rules(fit, "posthoc_ivon_suq").predict(x)
    for probs in (one_pass, monte_carlo, fast, closed, slope, suq):
        assert probs.shape == (16, 9)
        assert bool((probs >= 0).all())
        torch.testing.assert_close(probs.sum(-1), torch.ones(16), atol=1e-5, rtol=0)
    # the same posterior: the one-pass and 8-draw predictives agree far better than chance
    assert float((one_pass - monte_carlo).abs().sum(-1).mean()) < 0.5
    assert float((fast - monte_carlo).abs().sum(-1).mean()) < 0.5
    # GELU's closed form stands in for its quadrature: the same predictive to float32 rounding
    torch.testing.assert_close(closed, fast, atol=1e-5, rtol=0)
    # GELU's slope rule and the probit part left out within its 0.03 bound (at this small
    # posterior scale the variance's quadratic part is far below it); SUQ's predictive too
    assert float(0.5 * (slope - indep).abs().sum(-1).max()) <= 0.03
    assert float(0.5 * (suq - indep).abs().sum(-1).max()) <= 0.03
    with pytest.raises(ValueError, match="unknown predictive"):
        tb.categorical_from_moments("nope")  # type: ignore[arg-type]


def test_module_times_cover_every_module_and_leave_the_network_as_it_was() -> None:
    from lightning_dvi.nn import BayesModule, posthoc

    torch.manual_seed(0)
    net = tb.TinyViT(tokens=4, patch_dim=4, width=8, heads=2, layers=1, classes=3)
    converted = posthoc.from_torch_posterior(net, 0.01, layer_norm_route="first_order").eval()
    x = torch.randn(2, 4, 4)
    with torch.no_grad():
        before = converted(x, mode="diag")
    times = tb.module_times(converted, x, repeats=2)
    labels = {
        f"{n} ({type(m).__name__})"
        for n, m in converted.named_modules()
        if isinstance(m, BayesModule)
    }
    assert "total" in times
    assert {k.removesuffix(" cross") for k in times} - {"total"} <= labels
    kinds = {k.removesuffix(" cross").split(" (")[1] for k in times if k != "total"}
    assert {"LayerNorm)", "MultiheadAttention)", "GELU)", "BayesLinear)", "Residual)"} <= kinds
    assert any(key.endswith(" cross") for key in times)  # the skip connections' rules
    assert all(v >= 0 for v in times.values())
    for module in converted.modules():
        assert "propagate" not in vars(module) and "propagate_cross" not in vars(module)
    with torch.no_grad():
        after = converted(x, mode="diag")
    torch.testing.assert_close(after.mean, before.mean)
    torch.testing.assert_close(after.var, before.var)
    report = {"forward_ms": 2.0, "rules": {"a": {"m (X)": 4.0, "total": 8.0}, "b": {"total": 1.0}}}
    table = tb.module_table(report)
    assert "| m (X) | 4.0 (2.0) | 0.0 (0.0) |" in table
    assert "| total | 8.0 (4.0) | 1.0 (0.5) |" in table


def test_compiled_rows_give_the_eager_rows_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    # the wiring of the opt-in compiled rows; Dynamo only (inductor's code generation takes
    # tens of seconds a graph), so the numbers equal the eager rows' to float rounding
    import functools

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    rows = ("deterministic", "posthoc_ivon_suq", *tb.COMPILED_ROWS)
    config = replace(tb.Config.quick(), tasks=("digits",), rows=rows)
    (runs,) = tb.run(config, progress=lambda _: None).values()
    assert list(runs) == list(rows)
    for compiled, eager in (("posthoc_ivon_suq_compiled", "posthoc_ivon_suq"),
                            ("deterministic_compiled", "deterministic")):  # fmt: skip
        (got,), (want,) = runs[compiled], runs[eager]
        assert got["nll"] == pytest.approx(want["nll"], rel=1e-5)
        assert got["acc"] == want["acc"]
        assert got["details"]["graphs"] == 3  # test, OOD and timing rows
        assert got["train_s"] == got["details"]["compile_cpu_s"] > 0


def test_unknown_rows_and_tasks_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown rows"):
        tb.run(tb.Config(rows=("nope",)), progress=lambda _: None)
    with pytest.raises(ValueError, match="unknown task"):
        tb.run(tb.Config(tasks=("images",)), progress=lambda _: None)  # type: ignore[arg-type]
