"""Likelihoods chosen at the front ends: the one table of shorthand names, and configurations.

``DVIRegressor(likelihood=...)`` and ``DVIClassifier(likelihood=...)`` take a
:class:`~lightning_dvi.likelihoods.Likelihood` object, a shorthand name from :data:`SHORTHANDS`
(for the command line and configuration files), or a configuration ``{"class_path": ...,
"init_args": {...}}`` as a checkpoint records an object. A checkpoint is data: a configuration
is built only for this library's likelihood classes and classes registered with
:func:`register_likelihood`, found by name in a table (no module the file names is imported),
from plain arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeVar

from ..configurable import AllowList
from .base import Likelihood
from .bernoulli import Bernoulli
from .categorical import Categorical
from .gaussian import HeteroscedasticGaussian, HomoscedasticGaussian
from .poisson import Poisson

__all__ = [
    "SHORTHANDS",
    "Shorthand",
    "likelihood_class",
    "likelihood_config",
    "register_likelihood",
    "resolve_likelihood",
]

_L = TypeVar("_L", bound=type[Likelihood])


class Shorthand(NamedTuple):
    """A shorthand name's likelihood: its class and how a front end's arguments build it."""

    cls: type[Likelihood]
    build: Callable[[Mapping[str, Any]], Likelihood]


SHORTHANDS: dict[str, Shorthand] = {
    "heteroscedastic": Shorthand(
        HeteroscedasticGaussian, lambda o: HeteroscedasticGaussian(noise_bound=o["noise_bound"])
    ),
    "homoscedastic": Shorthand(
        HomoscedasticGaussian,
        lambda o: HomoscedasticGaussian(init_log_variance=o["init_log_noise"]),
    ),
    "poisson": Shorthand(Poisson, lambda o: Poisson()),
    "categorical": Shorthand(
        Categorical,
        lambda o: Categorical(o["num_classes"], o["method"], o["mc_samples"]),
    ),
    "bernoulli": Shorthand(Bernoulli, lambda o: Bernoulli()),
}
"""The shorthand names the front ends accept, the one table (what the CLI and configs write).

Options read by the builders: ``noise_bound`` and ``init_log_noise`` (``DVIRegressor``),
``num_classes``, ``method`` and ``mc_samples`` (``DVIClassifier``)."""


def shorthands(task: str) -> tuple[str, ...]:
    """The shorthand names of ``task``'s likelihoods (``"regression"``/``"classification"``), in table order."""
    return tuple(name for name, entry in SHORTHANDS.items() if entry.cls.task == task)


def _library() -> tuple[type[Likelihood], ...]:
    return _LIBRARY


#: The library's likelihood classes (those ``lightning_dvi.likelihoods`` exports), buildable from a
#: configuration without registration; ``tests/test_user_likelihood.py`` checks the list.
_LIBRARY: tuple[type[Likelihood], ...] = (
    Bernoulli,
    Categorical,
    HeteroscedasticGaussian,
    HomoscedasticGaussian,
    Likelihood,
    Poisson,
)

_ALLOWED: AllowList[Likelihood] = AllowList(
    "likelihood", Likelihood, _library, "lightning_dvi.likelihoods", "register_likelihood"
)


def register_likelihood(cls: _L) -> _L:
    """Allow ``cls`` to be rebuilt from a checkpoint's or configuration's ``class_path``.

    Register your own :class:`~lightning_dvi.likelihoods.Likelihood` subclass where it is
    defined (it works as a class decorator), so that a checkpoint of a model trained with it
    loads (``weights_only``, nothing imported from the file).

    Args:
        cls: a ``Likelihood`` subclass whose constructor takes plain values.

    Returns:
        ``cls``, unchanged.

    Raises:
        ValueError: if ``cls`` is not a ``Likelihood`` subclass.
    """
    return _ALLOWED.register(cls)


def likelihood_class(class_path: object, where: str) -> type[Likelihood]:
    """The allowed likelihood class named ``class_path``, looked up by name (nothing is imported).

    Raises:
        ValueError: naming ``class_path`` when it is not one of this library's likelihoods or a
            class registered with :func:`register_likelihood`.
    """
    return _ALLOWED.lookup(class_path, where)


def likelihood_config(likelihood: Likelihood) -> dict[str, Any]:
    """``{"class_path", "init_args"}``: the plain record of a likelihood object's construction.

    The arguments are those its constructor was called with (:attr:`Likelihood.init_args`);
    learned parameters and buffers travel in the state dict.

    Raises:
        ValueError: for an argument that is not plain data.
    """
    return _ALLOWED.record(likelihood)


def check_likelihood_config(config: object, where: str) -> None:
    """Check, without building anything, that a recorded likelihood configuration is allowed.

    A string (a shorthand) and ``None`` pass; a mapping needs an allowed ``class_path``.

    Raises:
        ValueError: as :func:`likelihood_class`.
    """
    _ALLOWED.check(config, where)


class Resolved(NamedTuple):
    """A front end's likelihood: the object, and what the hyper-parameters record of it."""

    likelihood: Likelihood
    record: str | dict[str, Any]
    shorthand: str | None


def resolve_likelihood(
    value: str | Likelihood | Mapping[str, Any],
    task: str,
    options: Mapping[str, Any],
    owner: str,
) -> Resolved:
    """The likelihood a front end was given: an object, a shorthand, or a recorded configuration.

    Args:
        value: a :class:`Likelihood`, a name in :data:`SHORTHANDS` for ``task``, or
            ``{"class_path", "init_args"}``.
        task: ``"regression"`` or ``"classification"``.
        options: the front end's arguments the shorthands read.
        owner: the front end's name, for messages.

    Returns:
        The likelihood, its plain record (the shorthand, or :func:`likelihood_config`) and the
        shorthand name (``None`` for an object or a configuration).

    Raises:
        ValueError: for an unknown name, a likelihood of another task, or a refused
            configuration.
    """
    names = shorthands(task)
    if isinstance(value, str):
        if value not in names:  # the front ends' message for a bad choice
            raise ValueError(f"likelihood must be {' or '.join(map(repr, names))}, got {value!r}")
        return Resolved(SHORTHANDS[value].build(options), value, value)
    likelihood = _ALLOWED.instance(value, owner, names)
    if likelihood.task != task:
        raise ValueError(
            f"{owner}: {type(likelihood).__name__} is a {likelihood.task} likelihood, not a "
            f"{task} one"
        )
    return Resolved(likelihood, likelihood_config(likelihood), None)
