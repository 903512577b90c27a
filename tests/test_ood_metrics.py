"""OOD and selective-prediction metrics against independent references (sklearn, by hand)."""

import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from sklearn.metrics import average_precision_score, roc_auc_score

from lightning_dvi import Gaussian
from lightning_dvi.metrics import (
    AURC,
    OODAUPR,
    OODAUROC,
    accuracy_rejection_curve,
    aurc,
    class_probability_samples,
    mutual_information,
    predictive_entropy,
)


def _scores(seed=0, n=300, ties=False):
    gen = torch.Generator().manual_seed(seed)
    label = (torch.rand(n, generator=gen) < 0.4).long()
    score = torch.randn(n, generator=gen, dtype=torch.float64) + 0.8 * label
    if ties:
        score = (score * 2).round() / 2  # many tied scores
    return score, label


@pytest.mark.parametrize("ties", [False, True])
def test_auroc_and_aupr_match_sklearn_over_batches(ties):
    score, label = _scores(ties=ties)
    auroc, aupr = OODAUROC(), OODAUPR()
    for chunk_s, chunk_l in zip(score.split(70), label.split(70), strict=True):
        auroc.update(chunk_s, chunk_l)
        aupr.update(chunk_s, chunk_l.bool())
    np.testing.assert_allclose(auroc.compute().item(), roc_auc_score(label, score), rtol=1e-6)
    np.testing.assert_allclose(
        aupr.compute().item(), average_precision_score(label, score), rtol=1e-6
    )


def test_ood_metrics_reject_bad_input():
    with pytest.raises(ValueError, match="needs both in-distribution"):
        m = OODAUROC()
        m.update(torch.rand(4), torch.zeros(4, dtype=torch.long))
        m.compute()
    with pytest.raises(ValueError, match="0/1"):
        OODAUROC().update(torch.rand(3), torch.tensor([0, 2, 1]))
    with pytest.raises(ValueError, match="same length"):
        OODAUPR().update(torch.rand(3), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="finite"):
        OODAUPR().update(torch.tensor([0.0, float("nan")]), torch.tensor([0, 1]))


def test_aurc_and_rejection_curve_by_hand():
    gen = torch.Generator().manual_seed(1)
    probs = torch.softmax(2 * torch.randn(50, 4, generator=gen), -1)
    target = torch.randint(0, 4, (50,), generator=gen)
    metric = AURC()
    metric.update(probs[:20], target[:20])
    metric.update(probs[20:], target[20:])
    # by hand: a Python loop over coverage levels
    conf, pred = probs.max(-1)
    order = sorted(range(50), key=lambda i: -conf[i].item())
    wrong = [float(pred[i] != target[i]) for i in order]
    risks = [sum(wrong[:n]) / n for n in range(1, 51)]
    assert metric.compute().item() == pytest.approx(sum(risks) / 50, rel=1e-12)
    rejection, accuracy = metric.curve()
    assert rejection[0] == 0 and accuracy[0] == pytest.approx(1 - risks[-1])
    assert accuracy[-1] == pytest.approx(1 - risks[0])
    assert rejection[10].item() == pytest.approx(10 / 50)
    assert accuracy[10].item() == pytest.approx(1 - risks[39])
    # a perfect ranking (all errors least confident) has the smallest AURC
    correct = torch.tensor([1, 1, 1, 0, 0])
    best = aurc(torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5]), correct)
    worst = aurc(torch.tensor([0.5, 0.6, 0.7, 0.8, 0.9]), correct)
    assert best < worst
    rejection, a = accuracy_rejection_curve(torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5]), correct)
    torch.testing.assert_close(a, torch.tensor([0.6, 0.75, 1.0, 1.0, 1.0], dtype=torch.float64))
    torch.testing.assert_close(
        rejection, torch.tensor([0.0, 0.2, 0.4, 0.6, 0.8], dtype=torch.float64)
    )


def test_entropy_and_mutual_information():
    uniform = torch.full((2, 4), 0.25)
    torch.testing.assert_close(predictive_entropy(uniform), torch.full((2,), float(np.log(4.0))))
    # two confident, disagreeing samples: H(mean) = log 2, mean H = 0, so I = log 2
    samples = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])
    torch.testing.assert_close(
        mutual_information(samples), torch.tensor([np.log(2.0)], dtype=torch.float32)
    )
    # agreeing samples carry no epistemic uncertainty
    torch.testing.assert_close(mutual_information(uniform.expand(3, 2, 4)), torch.zeros(2))
    # samples from a logit Gaussian: a wider Gaussian has more mutual information
    mean = torch.zeros(1, 3)
    narrow = class_probability_samples(Gaussian(mean, var=torch.full((1, 3), 0.01)), 500)
    wide = class_probability_samples(Gaussian(mean, cov=4 * torch.eye(3).unsqueeze(0)), 500)
    assert narrow.shape == (500, 1, 3)
    assert mutual_information(wide) > 10 * mutual_information(narrow)


def _ddp_worker(rank, world, port, path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    score, label = _scores(seed=3)
    probs = torch.softmax(torch.randn(300, 3, generator=torch.Generator().manual_seed(4)), -1)
    target = torch.arange(300) % 3
    metrics = [OODAUROC(), OODAUPR(), AURC()]
    part = slice(rank, None, world)
    metrics[0].update(score[part], label[part])
    metrics[1].update(score[part], label[part])
    metrics[2].update(probs[part], target[part])
    values = [m.compute().item() for m in metrics]
    if rank == 0:
        torch.save(values, path)
    dist.destroy_process_group()


def test_metrics_sync_across_two_processes(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "values.pt"
    # Two real processes and a real gloo all-gather, started by fork: a spawned worker first
    # re-imports torch, scikit-learn and the library (~8 s of CPU each), to run a few ms of work.
    mp.start_processes(
        _ddp_worker, args=(2, port, str(path)), nprocs=2, join=True, start_method="fork"
    )
    score, label = _scores(seed=3)
    probs = torch.softmax(torch.randn(300, 3, generator=torch.Generator().manual_seed(4)), -1)
    target = torch.arange(300) % 3
    conf, pred = probs.max(-1)
    expected = [
        roc_auc_score(label, score),
        average_precision_score(label, score),
        aurc(conf, pred == target).item(),
    ]
    np.testing.assert_allclose(torch.load(path), expected, rtol=1e-6)  # AUROC in float32
