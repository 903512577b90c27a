"""Train mode for a fit: Lightning 2.x keeps the modes the modules have when ``fit`` starts.

A network converted by :func:`~lightning_dvi.nn.from_torch` from a torch model in ``eval()``
mode keeps that mode module by module, so its batch normalization would silently train with
the running statistics. :func:`enter_train_mode` puts the network in train mode at the start
of a fit (as a torch training loop's ``model.train()`` does), which leaves a frozen last-layer
backbone in eval mode (:class:`~lightning_dvi.nn.LastLayerNetwork` keeps it there), and names
the batch normalization layers it switched, so the caller can warn.
"""

from __future__ import annotations

from torch import nn

from ..nn.normalization import BatchNorm1d, BatchNorm2d

__all__ = ["enter_train_mode"]

_TORCH_BATCH_NORM = nn.modules.batchnorm._BatchNorm


def _uses_batch_statistics_in_train_mode(module: nn.Module) -> bool:
    if isinstance(module, (BatchNorm1d, BatchNorm2d)):
        return module.track_running_stats and not module.freeze_statistics
    return isinstance(module, _TORCH_BATCH_NORM) and module.track_running_stats


def enter_train_mode(module: nn.Module) -> list[str]:
    """``module.train()``; the batch norms (``"path (Type)"``) that were in eval mode and now train.

    Only layers whose behaviour changes are named: batch normalization with running
    statistics (not one with ``freeze_statistics=True``, which uses them in both modes).
    """
    was_eval = {
        name
        for name, m in module.named_modules()
        if not m.training and _uses_batch_statistics_in_train_mode(m)
    }
    module.train()
    return [
        f"{name} ({type(m).__name__})"
        for name, m in module.named_modules()
        if name in was_eval and m.training
    ]
