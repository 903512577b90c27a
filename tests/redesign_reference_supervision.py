"""Fixed-seed reference of the ELBO step, the compiled path and Adam/L-BFGS fits (issue 40, items 4-5).

Run before and after a change that must not alter behaviour:

    python tests/redesign_reference_supervision.py capture /tmp/ref_before.pt
    python tests/redesign_reference_supervision.py compare /tmp/ref_before.pt

``capture`` records, in float64 wherever the library allows, at fixed seeds and one torch
thread: the ELBO terms and gradients of :class:`~lightning_dvi.DVIRegressor` and
:class:`~lightning_dvi.DVIClassifier` in ``full`` and ``diag`` mode (eager, through a compiled
``compile=`` module, and through :func:`~lightning_dvi.compile.compile_elbo`), a 3-epoch Adam
fit of each, 3-epoch L-BFGS fits (plain, with a KL warm-up that clears the curvature memory,
one poisoned step that is undone, two poisoned steps that raise), the float32 stall that a
restart leaves, and a stalled optimiser that warns. Every fit records its weights, the
optimiser's state, the logged values and the warnings and errors it raised. ``compare``
recomputes everything and reports each entry that is not bit-identical (``torch.equal``).
Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from helpers import PoisonWeight, cpu_trainer
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_dvi import DVIClassifier, DVIRegressor
from lightning_dvi.compile import compile_elbo
from lightning_dvi.optim import LBFGS

F64 = torch.float64


def _trainer(**kwargs: Any) -> Trainer:
    """``helpers.cpu_trainer`` without checkpoints or the sanity validation pass."""
    return cpu_trainer(enable_checkpointing=False, num_sanity_val_steps=0, **kwargs)


def _data(classes: int | None, n: int = 48, dtype: torch.dtype = F64) -> tuple[Any, Any]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 3, generator=gen, dtype=dtype)
    if classes is None:
        y = (x[:, 0] - 0.5 * x[:, 1] ** 2 + 0.1 * torch.randn(n, generator=gen, dtype=dtype)).to(
            dtype
        )
    else:
        y = (x[:, 0] * 2 + x[:, 1]).mul(classes / 4).floor().clamp(0, classes - 1).long()
    return x, y


def _model(kind: str, mode: str = "full", **kwargs: Any) -> Any:
    torch.manual_seed(0)
    if kind == "regressor":
        return DVIRegressor(in_features=3, hidden=[8], mode=mode, num_data=96, **kwargs)
    return DVIClassifier(in_features=3, num_classes=3, hidden=[8], mode=mode, num_data=96, **kwargs)


def _state(model: Any) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _terms(terms: Any) -> dict[str, Any]:
    return {
        "loss": terms.loss.detach().clone(),
        "elbo": terms.elbo.detach().clone(),
        "ell": terms.expected_log_likelihood.detach().clone(),
        "kl": terms.kl.detach().clone(),
        "kl_weight": terms.kl_weight,
    }


def _grads(model: Any) -> dict[str, Any]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def elbo_steps(out: dict[str, Any]) -> None:
    """ELBO terms and gradients, eager and compiled (backend "eager": the traced graph, no codegen)."""
    for kind in ("regressor", "classifier"):
        x, y = _data(None if kind == "regressor" else 3)
        for mode in ("full", "diag"):
            for compiled in (False, True):
                options = {"backend": "eager"} if compiled else False
                model = _model(kind, mode, compile=options).double()
                if kind == "regressor":
                    model.target_loc.fill_(0.25)
                    model.target_scale.fill_(1.5)
                for weight in (1.0, 0.5):
                    model.zero_grad()
                    terms = model._elbo((x, y), weight, "train")
                    terms.loss.backward()
                    key = f"elbo/{kind}/{mode}/compiled={compiled}/w={weight}"
                    out[key] = {"terms": _terms(terms), "grads": _grads(model)}
                with torch.no_grad():
                    out[f"elbo/{kind}/{mode}/compiled={compiled}/val"] = _terms(
                        model._elbo((x, y), 1.0, "val")
                    )
            # the functional compiled ELBO on the same network
            model = _model(kind, mode).double()
            step = compile_elbo(
                model.net, model.likelihood, model.prior, mode=mode, backend="eager"
            )
            yy = y if kind == "classifier" else y.to(F64)
            terms = step(x, yy, num_data=96, kl_weight=0.25)
            terms.loss.backward()
            out[f"compile_elbo/{kind}/{mode}"] = {"terms": _terms(terms), "grads": _grads(model)}


class _Record(Callback):
    def __init__(self) -> None:
        self.losses: list[Any] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach().clone())


def _fit(model: Any, loader: DataLoader, epochs: int, callbacks: list[Any]) -> dict[str, Any]:
    record = _Record()
    trainer = _trainer(max_epochs=epochs, callbacks=[record, *callbacks], precision="64-true")
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, train_dataloaders=loader)
        except FloatingPointError as err:
            error = str(err)
    ours = sorted({str(w.message) for w in caught if "L-BFGS" in str(w.message)})
    return {
        "state": _state(model),
        "optimiser": trainer.optimizers[0].state_dict() if trainer.optimizers else None,
        "losses": record.losses,
        "metrics": {k: v.detach().clone() for k, v in trainer.callback_metrics.items()},
        "global_step": trainer.global_step,
        "warnings": ours,
        "error": error,
    }


def fits(out: dict[str, Any]) -> None:
    """3-epoch fits: Adam for each front end, L-BFGS with its supervision paths."""
    for kind in ("regressor", "classifier"):
        x, y = _data(None if kind == "regressor" else 3)
        loader = DataLoader(TensorDataset(x, y), batch_size=24)
        out[f"adam/{kind}"] = _fit(_model(kind, "diag", lr=0.01), loader, 3, [])
    x, y = _data(None)
    full = DataLoader(TensorDataset(x, y), batch_size=len(x))
    lbfgs = {"optimizer": "lbfgs", "lbfgs_iterations": 4, "lbfgs_history": 3}
    out["lbfgs/regressor"] = _fit(_model("regressor", **lbfgs), full, 3, [])
    out["lbfgs/regressor/kl_warmup"] = _fit(
        _model("regressor", kl_warmup_steps=1, **lbfgs), full, 3, []
    )
    out["lbfgs/regressor/undo"] = _fit(_model("regressor", **lbfgs), full, 3, [PoisonWeight({2})])
    out["lbfgs/regressor/error"] = _fit(
        _model("regressor", **lbfgs), full, 3, [PoisonWeight({1, 2})]
    )
    xc, yc = _data(3)
    out["lbfgs/classifier"] = _fit(
        _model("classifier", "diag", **lbfgs),
        DataLoader(TensorDataset(xc, yc), batch_size=len(xc)),
        3,
        [],
    )


class _StiffStart(DVIRegressor):
    r"""Training loss :math:`\tfrac12(10^8 a^2 + b^2)` from (1e-3, 1) in float32: a stall (tests/test_lbfgs.py)."""

    def __init__(self) -> None:
        super().__init__(hidden=[2], in_features=1, optimizer="lbfgs", lbfgs_iterations=10)
        self.stiff = torch.nn.Parameter(torch.tensor([1e-3, 1.0]))

    def training_step(self, batch, batch_idx):
        a, b = self.stiff
        return 0.5 * (1e8 * a.square() + b.square())


def stalls(out: dict[str, Any]) -> None:
    """The float32 stall a restart leaves, and an optimiser that never moves (a warning)."""
    x, y = _data(None, dtype=torch.float32)
    full = DataLoader(TensorDataset(x[:, :1], y), batch_size=len(x))
    torch.manual_seed(0)
    record = _Record()
    model = _StiffStart()
    trainer = _trainer(max_epochs=4, callbacks=[record])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, train_dataloaders=full)
    out["stall/restart"] = {
        "state": _state(model),
        "optimiser": trainer.optimizers[0].state_dict(),
        "losses": record.losses,
        "warnings": sorted({str(w.message) for w in caught if "L-BFGS" in str(w.message)}),
    }
    original = LBFGS.step

    def stalled_step(self, closure):
        with torch.enable_grad():
            return closure()

    LBFGS.step = stalled_step  # type: ignore[method-assign]
    try:
        x, y = _data(None)
        loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
        out["stall/warning"] = _fit(
            _model("regressor", optimizer="lbfgs", lbfgs_iterations=3), loader, 4, []
        )
    finally:
        LBFGS.step = original  # type: ignore[method-assign]


def capture() -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    elbo_steps(out)
    fits(out)
    stalls(out)
    return out


def _differences(a: Any, b: Any, where: str) -> list[str]:
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return [f"{where}: {a!r} vs {b!r}"]
        if torch.equal(a, b) or (
            a.is_floating_point()
            and torch.equal(a.isnan(), b.isnan())
            and torch.equal(a.nan_to_num(), b.nan_to_num())
        ):
            return []
        diff = (a.double() - b.double()).abs().max()
        return [f"{where}: max |diff| {float(diff):.3g}"]
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            keys = set(a) ^ set(b) if isinstance(b, dict) else "type"
            return [f"{where}: keys differ: {keys}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return [f"{where}: {a!r} vs {b!r}"]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in _differences(x, y, f"{where}[{i}]")
        ]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def main(argv: list[str], capture_fn: Callable[[], dict] | None = None, doc: str = "") -> int:
    """``capture FILE`` or ``compare FILE`` with ``capture_fn`` (this module's :func:`capture`)."""
    if len(argv) != 3 or argv[1] not in ("capture", "compare"):
        print(doc or __doc__)
        return 2
    result = (capture_fn or capture)()
    if argv[1] == "capture":
        torch.save(result, argv[2])
        print(f"captured {len(result)} entries into {argv[2]}")
        return 0
    reference = torch.load(argv[2], weights_only=True)
    diffs = _differences(reference, result, "")
    for line in diffs:
        print(line)
    print(f"{len(reference)} entries compared, {len(diffs)} differences")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
