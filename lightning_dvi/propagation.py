r"""How a declared network runs: one typed value, built and checked once at the entry.

A propagation is either **moments** (:class:`MomentPass`: a Gaussian per layer, in ``full``
covariance or ``diag`` storage; DVI and dDVI) or **samples** (:class:`SamplePass`: ``S``
network outputs, each from one draw of the whole weights, or with ``local=True`` from one draw
of each pre-activation given its input, the local reparameterisation trick).

The entry points (``net(x, mode=...)``, :func:`~lightning_dvi.objective.elbo`, the Lightning
modules, the Pyro guide) accept the shorthand strings ``"full"``, ``"diag"``, ``"sample"``,
``"local"`` (with ``num_samples`` for the last two) or a value, and resolve them once with
:func:`propagation`, the one table and the one check of the pair ``(mode, num_samples)``.
Layers then read the value's fields (``mode.samples``, ``mode.local``, ``mode.full``) and never
compare strings.

A value equals its shorthand (``SamplePass(3) == "sample"``), so a user's layer written against
the strings keeps working.

Examples:
    >>> propagation("local", num_samples=4)
    SamplePass(num_samples=4, local=True)
    >>> propagation("diag").full, propagation("sample").closed_form()
    (False, MomentPass(storage='full'))
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, get_args

__all__ = [
    "DIAG",
    "FULL",
    "MODES",
    "Mode",
    "MomentPass",
    "Propagation",
    "SamplePass",
    "moment_propagation",
    "propagation",
    "sample_propagation",
]

Mode = Literal["full", "diag", "sample", "local"]
"""The shorthand strings of the four propagations (the one definition; front-ends import it)."""
MODES: tuple[str, ...] = get_args(Mode)
Storage = Literal["full", "diag"]


class Propagation:
    """A propagation: :class:`MomentPass` or :class:`SamplePass` (frozen, hashable values).

    The flags are read by layers instead of comparing strings: ``samples`` (a tensor
    ``[S, ...]`` flows, not a Gaussian), ``local`` (samples drawn per pre-activation), ``full``
    and ``diag`` (the storage of the moments).
    """

    samples: bool = False
    local: bool = False

    @property
    def full(self) -> bool:
        """Moments with full covariance storage."""
        return False

    @property
    def diag(self) -> bool:
        """Moments with diagonal (variance) storage."""
        return False

    @property
    def name(self) -> Mode:  # pragma: no cover - abstract
        """The shorthand string (``"full"``, ``"diag"``, ``"sample"`` or ``"local"``)."""
        raise NotImplementedError

    def closed_form(self) -> MomentPass:
        """This propagation if it is moments, else full moments (a sampled model's closed form)."""
        return self if isinstance(self, MomentPass) else FULL

    def draws(self, num_samples: int) -> SamplePass:
        """``num_samples`` draws, local if this propagation is local, else of the whole weights."""
        return SamplePass(num_samples, local=self.local)

    def __str__(self) -> str:
        return self.name

    def _fields(self) -> tuple[object, ...]:  # pragma: no cover - abstract
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):  # the shorthand, for layers written against the strings
            return other == self.name
        return (
            isinstance(other, Propagation)
            and type(other) is type(self)
            and other._fields() == self._fields()
        )

    def __hash__(self) -> int:  # equal to its shorthand, so hashed like it
        return hash(self.name)


@dataclass(frozen=True, eq=False)
class MomentPass(Propagation):
    """Closed-form moments: a Gaussian per layer with ``full`` covariance or ``diag`` variances.

    Args:
        storage: ``"full"`` (DVI; a diagonal covariance still travels in diag storage while it
            is exactly diagonal) or ``"diag"`` (dDVI).

    Raises:
        ValueError: on another storage.
    """

    storage: Storage = "full"

    def __post_init__(self) -> None:
        if self.storage not in get_args(Storage):
            raise ValueError(f"storage must be 'full' or 'diag', got {self.storage!r}")

    @property
    def name(self) -> Mode:
        """``"full"`` or ``"diag"``."""
        return self.storage

    @property
    def full(self) -> bool:
        """``storage == "full"``."""
        return self.storage == "full"

    @property
    def diag(self) -> bool:
        """``storage == "diag"``."""
        return self.storage == "diag"

    def _fields(self) -> tuple[object, ...]:
        return (self.storage,)


@dataclass(frozen=True, eq=False)
class SamplePass(Propagation):
    """Monte Carlo: ``num_samples`` network outputs ``[S, B, ...]``.

    Args:
        num_samples: ``S``, a positive int.
        local: draw each pre-activation from its Gaussian given the input (local
            reparameterisation; layers derive it from their moments) instead of drawing the
            whole weights once per sample.

    Raises:
        ValueError: on a ``num_samples`` that is not a positive int.
    """

    num_samples: int = 1
    local: bool = False
    samples = True

    def __post_init__(self) -> None:
        s = self.num_samples
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ValueError(f"num_samples must be a positive int, got {s!r}")

    @property
    def name(self) -> Mode:
        """``"local"`` or ``"sample"``."""
        return "local" if self.local else "sample"

    def _fields(self) -> tuple[object, ...]:
        return (self.num_samples, self.local)


FULL, DIAG = MomentPass("full"), MomentPass("diag")


def _samples(num_samples: object, local: bool) -> SamplePass:
    if num_samples is None or type(num_samples) is int:
        return _interned(1 if num_samples is None else num_samples, local)
    return SamplePass(num_samples, local=local)  # type: ignore[arg-type]  # raises there


@lru_cache(maxsize=64)
def _interned(num_samples: int, local: bool) -> SamplePass:
    # one object per (S, local): torch.compile, which guards on the object, reuses its graph
    return SamplePass(num_samples, local=local)


_SHORTHANDS = {
    "full": lambda s: FULL,
    "diag": lambda s: DIAG,
    "sample": lambda s: _samples(s, False),
    "local": lambda s: _samples(s, True),
}
"""The one table from a shorthand string and ``num_samples`` to the value."""


def propagation(mode: Mode | Propagation = "full", num_samples: int | None = None) -> Propagation:
    """The propagation of ``mode`` (a shorthand or a value) with ``num_samples``, checked.

    The one check of the pair: ``num_samples`` defaults to 1 in ``sample``/``local``, must be a
    positive int there, and unset in ``full``/``diag`` (and with a value, which carries its own).

    Raises:
        ValueError: on an unknown mode, a bad ``num_samples`` or one given where it has no use.
    """
    if isinstance(mode, Propagation):
        if num_samples is not None and not (
            isinstance(mode, SamplePass) and num_samples == mode.num_samples
        ):
            raise ValueError(f"num_samples is set by the propagation {mode!r}; leave it unset")
        return mode
    build = _SHORTHANDS.get(mode) if isinstance(mode, str) else None
    if build is None:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    if num_samples is not None and mode in get_args(Storage):
        raise ValueError(
            f"num_samples is only used by mode='sample'/'local', not {mode!r}; leave it unset"
        )
    return build(num_samples)


def _resolved(mode: object) -> Propagation | None:
    try:
        return propagation(mode) if isinstance(mode, (str, Propagation)) else None  # type: ignore[arg-type]  # any str: a wrong one raises
    except ValueError:
        return None


def moment_propagation(mode: object, context: str = "") -> MomentPass:
    """``mode`` (a shorthand or a value) resolved by :func:`propagation`, required to be moments.

    For the entry points that propagate moments only (the Pyro guide, a one-pass export).

    Raises:
        ValueError: ``mode must be 'diag' or 'full'{context}, got ...`` otherwise.
    """
    how = _resolved(mode)
    if not isinstance(how, MomentPass):
        raise ValueError(f"mode must be 'diag' or 'full'{context}, got {mode!r}")
    return how


def sample_propagation(mode: object, name: str = "mode") -> SamplePass:
    """``mode`` (``"sample"``, ``"local"`` or a :class:`SamplePass`) resolved by :func:`propagation`.

    Raises:
        ValueError: ``{name} must be 'sample' or 'local', got ...`` otherwise.
    """
    how = _resolved(mode)
    if not isinstance(how, SamplePass):
        raise ValueError(f"{name} must be 'sample' or 'local', got {mode!r}")
    return how
