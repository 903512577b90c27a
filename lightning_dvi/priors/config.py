"""Priors chosen at the front ends: the one table of shorthand names, and configurations.

``DVIRegressor(prior=...)`` and ``DVIClassifier(prior=...)`` take a
:class:`~lightning_dvi.priors.Prior` object, a shorthand name from :data:`SHORTHANDS` (for the
command line and configuration files), or a configuration ``{"class_path": ..., "init_args":
{...}}`` as a checkpoint records an object. As for likelihoods
(:mod:`lightning_dvi.likelihoods.config`), a configuration is built only for this library's
prior classes and classes registered with :func:`register_prior`, found by name in a table,
from plain arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeVar

from ..configurable import AllowList
from .base import GaussianPrior, Prior
from .empirical_bayes import EmpiricalBayes

__all__ = [
    "SHORTHANDS",
    "check_prior_config",
    "prior_config",
    "register_prior",
    "resolve_prior",
]

_P = TypeVar("_P", bound=type[Prior])

SHORTHANDS: dict[str, Callable[[Mapping[str, Any]], Prior]] = {
    "empirical_bayes": lambda o: EmpiricalBayes(
        alpha=o["prior_alpha"], beta=o["prior_beta"], mode=o["eb_mode"]
    ),
    "gaussian": lambda o: GaussianPrior(o["prior_variance"]),
}
"""The shorthand names the front ends accept and how each is built from the front end's
``prior_alpha``, ``prior_beta``, ``eb_mode`` and ``prior_variance`` (the one table)."""

#: The library's prior classes, buildable from a configuration without registration.
_LIBRARY: tuple[type[Prior], ...] = (EmpiricalBayes, GaussianPrior)

_ALLOWED: AllowList[Prior] = AllowList(
    "prior", Prior, lambda: _LIBRARY, "lightning_dvi.priors", "register_prior"
)


def register_prior(cls: _P) -> _P:
    """Allow ``cls`` to be rebuilt from a checkpoint's or configuration's ``class_path``.

    Register your own :class:`~lightning_dvi.priors.Prior` subclass where it is defined (it
    works as a class decorator), so that a checkpoint of a model trained with it loads
    (``weights_only``, nothing imported from the file).

    Args:
        cls: a ``Prior`` subclass whose constructor takes plain values.

    Returns:
        ``cls``, unchanged.

    Raises:
        ValueError: if ``cls`` is not a ``Prior`` subclass.
    """
    return _ALLOWED.register(cls)


def prior_config(prior: Prior) -> dict[str, Any]:
    """``{"class_path", "init_args"}``: the plain record of a prior object's construction.

    Raises:
        ValueError: for a constructor argument that is not plain data.
    """
    return _ALLOWED.record(prior)


def check_prior_config(config: object, where: str) -> None:
    """Check, without building anything, that a recorded prior configuration is allowed.

    Raises:
        ValueError: naming the class path when it is neither a library prior nor registered.
    """
    _ALLOWED.check(config, where)


class ResolvedPrior(NamedTuple):
    """A front end's prior: the object, and what the hyper-parameters record of it."""

    prior: Prior
    record: str | dict[str, Any]
    shorthand: str | None


def resolve_prior(
    value: str | Prior | Mapping[str, Any], options: Mapping[str, Any], owner: str
) -> ResolvedPrior:
    """The prior a front end was given: an object, a shorthand, or a recorded configuration.

    Args:
        value: a :class:`Prior`, a name in :data:`SHORTHANDS`, or ``{"class_path", "init_args"}``.
        options: the front end's arguments the shorthands read (``prior_alpha``, ``prior_beta``,
            ``eb_mode``, ``prior_variance``).
        owner: the front end's name, for messages.

    Returns:
        The prior, its plain record (the shorthand, or :func:`prior_config`) and the shorthand
        name (``None`` for an object or a configuration).

    Raises:
        ValueError: for an unknown name or a refused configuration.
    """
    if isinstance(value, str):
        if value not in SHORTHANDS:
            names = " or ".join(map(repr, SHORTHANDS))
            raise ValueError(f"prior must be {names}, got {value!r}")
        return ResolvedPrior(SHORTHANDS[value](options), value, value)
    prior = _ALLOWED.instance(value, owner, SHORTHANDS)
    return ResolvedPrior(prior, prior_config(prior), None)
