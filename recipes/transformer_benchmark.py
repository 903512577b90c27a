r"""Transformers trained elsewhere, made Bayesian (issue 42 item 4): ViT-tiny-shaped digits and a sequence task.

Usage::

    python recipes/transformer_benchmark.py [--seeds 3] [--task digits|sequence|both] [--quick]
        [--rows deterministic,posthoc_ivon,ivon_mc32] [--json results.json] [--markdown table.md]
    python recipes/transformer_benchmark.py --task digits --module-times [--json times.json]

Two small pre-norm transformers in plain torch: a ViT-tiny-shaped classifier over scikit-learn's
8x8 digits cut into 16 patches of 2x2 pixels (nine classes; the tenth, digit 9, is the OOD
set), and a classifier of generated 12-token sequences (the majority group of three, 20 %
label noise; OOD: sequences with half their tokens from symbols never seen in training). Rows:
the deterministic network, temperature scaling, last-layer DVI, a whole-network dDVI
fine-tune, post-hoc DVI from the deterministic weights (prior standard deviations, one
calibrated factor), post-hoc DVI from an IVON posterior (as it is, calibrated, and with the
cheaper moment rules: LayerNorm's first-order form, and that with SUQ's attention rule), and the
Monte Carlo predictive of that same posterior with 8 and 32 samples; named with ``--rows``
only, ``posthoc_ivon_suq_compiled`` and ``deterministic_compiled`` run SUQ's predictive and the
torch network through ``torch.compile`` (tens of CPU seconds of compilation). Columns: accuracy, NLL,
ECE and its noise floor, OOD AUROC of the predictive entropy, the predictive's CPU time per
example relative to one deterministic forward pass (one thread), and the training CPU seconds.
The tables print per task, followed by issue 42's acceptance check (post-hoc DVI from IVON
against the 32-sample Monte Carlo predictive on NLL and ECE, and a cost of at most 3 forward
passes). ``--module-times`` prints instead the CPU milliseconds of every module of the IVON
posterior's diag moment pass under each rule set, against the torch forward pass. The machinery is :mod:`lightning_dvi_benchmarks.transformer`; results and the
command that made them: docs/transformer_benchmark.md. Run it with ``nice -n 5``.
"""

from __future__ import annotations

import sys

from lightning_dvi_benchmarks.transformer import main

if __name__ == "__main__":
    main(sys.argv[1:])
