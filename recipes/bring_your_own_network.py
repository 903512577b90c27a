"""Bring your own network: train a torch MLP, convert it to DVI, fine-tune, export, serve.

1. trains a plain torch MLP (GELU/SiLU, dropout) on scikit-learn's bundled diabetes data;
2. converts it with ``lightning_dvi.nn.from_torch`` (posterior means = the trained weights,
   posterior std = 10 % of |w|, MOPED-style);
3. fine-tunes it with full DVI through ``DVIRegressor(net=...)`` and a Lightning ``Trainer``;
4. exports the one-pass predictive (raw features in, mean and variance of y out) with
   ``torch.export`` (``.pt2``) and, if ``onnx``/``onnxruntime`` are installed, ONNX;
5. loads the exported files back and serves predictions, checking they match the library.

Run (a few minutes on 2 shared cores; ``--quick`` is the smoke test's few-epoch version):

    .venv/bin/python recipes/bring_your_own_network.py --output-dir outputs/byo
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from lightning.pytorch import Trainer
from sklearn.datasets import load_diabetes
from sklearn.model_selection import train_test_split
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dvi import DVIRegressor
from lightning_dvi.nn import export_predictive, from_torch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch-epochs", type=int, default=50, help="plain torch training")
    parser.add_argument("--dvi-epochs", type=int, default=30, help="DVI fine-tuning epochs")
    parser.add_argument("--scale-fraction", type=float, default=0.1, help="posterior std / |w|")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/byo"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a few epochs (smoke test)")
    parser.add_argument(
        "--no-onnx", action="store_true", help="skip the ONNX file even if onnx is installed"
    )
    return parser.parse_args()


def load_data(seed: int) -> dict[str, Tensor]:
    x, y = load_diabetes(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed)
    out = {"x_train": x_tr, "x_test": x_te, "y_train": y_tr, "y_test": y_te}
    return {k: torch.tensor(v, dtype=torch.float32) for k, v in out.items()}


def train_torch_mlp(x: Tensor, y: Tensor, epochs: int) -> nn.Sequential:
    """An ordinary torch regression MLP, trained with MSE on standardised data."""
    net = nn.Sequential(
        nn.Linear(x.shape[1], 64), nn.GELU(), nn.Dropout(0.1),
        nn.Linear(64, 64), nn.SiLU(),
        nn.Linear(64, 1),
    )  # fmt: skip
    opt = torch.optim.Adam(net.parameters(), lr=3e-3, weight_decay=1e-4)
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
    for _ in range(epochs):
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.mse_loss(net(xb).squeeze(-1), yb).backward()
            opt.step()
    return net.eval()


def gaussian_nll(mean: Tensor, var: Tensor, y: Tensor) -> float:
    return float(0.5 * (torch.log(2 * math.pi * var) + (y - mean) ** 2 / var).mean())


def main() -> None:
    args = parse_args()
    if args.quick:
        args.torch_epochs, args.dvi_epochs = 5, 2
    torch.manual_seed(args.seed)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    d = load_data(args.seed)
    x_loc, x_scale = d["x_train"].mean(0), d["x_train"].std(0)
    y_loc, y_scale = float(d["y_train"].mean()), float(d["y_train"].std())
    xs_tr, xs_te = (d["x_train"] - x_loc) / x_scale, (d["x_test"] - x_loc) / x_scale
    ys_tr = (d["y_train"] - y_loc) / y_scale

    # 1. the user's own network, trained the usual way
    start = time.perf_counter()
    torch_net = train_torch_mlp(xs_tr, ys_tr, args.torch_epochs)
    with torch.no_grad():
        resid_var = float((torch_net(xs_tr).squeeze(-1) - ys_tr).var())
        torch_mean = torch_net(xs_te).squeeze(-1) * y_scale + y_loc
    torch_var = torch.full_like(torch_mean, resid_var * y_scale**2)

    # 2. convert: posterior means from the trained weights, std = scale_fraction * |w|
    net = from_torch(torch_net, scale_fraction=args.scale_fraction)

    # 3. fine-tune with full DVI; the noise starts at the torch net's residual variance
    model = DVIRegressor(
        net=net,
        likelihood="homoscedastic",
        init_log_noise=math.log(resid_var),
        mode="full",
        num_data=len(ys_tr),
        target_loc=y_loc,
        target_scale=y_scale,
        lr=1e-3,
    )
    trainer = Trainer(
        max_epochs=args.dvi_epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(TensorDataset(xs_tr, ys_tr), batch_size=64, shuffle=True)
    trainer.fit(model, loader)
    model.eval()
    with torch.no_grad():
        dvi_mean, dvi_var = model.predictive(xs_te)

    # 4. export: raw features in, predictive mean and variance of y out, one pass
    predictive = export_predictive(model, mode="full", input_loc=x_loc, input_scale=x_scale)
    pt2 = args.output_dir / "diabetes_dvi.pt2"
    predictive.save(pt2, d["x_test"][:8])
    files = [pt2]
    try:
        import onnxruntime as ort
    except ImportError:
        ort = None
    if args.no_onnx:
        ort = None
    if ort is not None:
        onnx_path = args.output_dir / "diabetes_dvi.onnx"
        predictive.save(onnx_path, d["x_test"][:8])
        files.append(onnx_path)

    # 5. serve: load the file (torch only) and predict on raw features
    served = torch.export.load(pt2).module()
    batch = d["x_test"][:8]  # full mode fixes the traced batch size of 8
    served_mean, served_var = served(batch)
    gap = (served_mean - dvi_mean[:8]).abs().max().item()
    if ort is not None:
        session = ort.InferenceSession(str(files[-1]))
        onnx_mean, _ = session.run(None, {session.get_inputs()[0].name: batch.numpy()})
        gap = max(gap, float(abs(onnx_mean - dvi_mean[:8].numpy()).max()))

    y_te = d["y_test"]
    rows = [
        ("torch MLP (MSE + residual noise)", torch_mean, torch_var),
        ("DVI fine-tuned (full)", dvi_mean, dvi_var),
    ]
    print(f"{'model':34s} {'test RMSE':>10s} {'test NLL':>9s}")
    for name, mean, var in rows:
        rmse = float((mean - y_te).square().mean().sqrt())
        print(f"{name:34s} {rmse:10.2f} {gaussian_nll(mean, var, y_te):9.3f}")
    print(f"exported: {', '.join(str(f) for f in files)}")
    print(f"served predictions (first 3): mean {served_mean[:3].tolist()}")
    print(f"            std {served_var[:3].sqrt().tolist()}")
    print(f"max |served - library| mean gap: {gap:.2e}")
    print(f"total time {time.perf_counter() - start:.1f} s")
    if gap > 1e-3:
        raise SystemExit(f"served predictions differ from the library's by {gap:.2e}")


if __name__ == "__main__":
    main()
