r"""The moment rules a declared module carries, as plain data that travels with its architecture.

Some modules choose *how* their moments are computed after they are built:
:func:`~lightning_dvi.nn.posthoc.set_rules` sets a LayerNorm's ``route``, a GELU's ``rule``, an
attention layer's ``rule`` and a transformer block's ``skip_rule`` on a converted network. These
choices change the numbers a network gives, so they belong to its architecture: a network rebuilt
from :meth:`~lightning_dvi.nn.GraphNetwork.architecture` must compute what the saved one computed.
This module is the one table of those attributes, and reads and writes them as plain data.

Safe by construction: :func:`apply_rules` sets only the attributes of the table, on the module
classes of the table, to values the class accepts; anything else in the data is refused with the
path that carries it.

Examples:
    >>> from lightning_dvi.nn import LayerNorm
    >>> from lightning_dvi.nn.rules import apply_rules, module_rules
    >>> norm = LayerNorm(4)
    >>> norm.route = "first_order"
    >>> module_rules(norm)
    {'': {'route': 'first_order'}}
    >>> fresh = LayerNorm(4)
    >>> apply_rules(fresh, module_rules(norm), "layer"); fresh.route
    'first_order'
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

__all__ = ["apply_rules", "module_rules", "rule_attributes", "rule_keywords"]

#: ``(module class, attribute, check, keyword)``: ``check(module, value)`` returns the value or
#: raises ``ValueError``; ``keyword`` is :func:`~lightning_dvi.nn.posthoc.set_rules`'s argument
#: that sets it. Built on first use (the module classes import this package).
_Entry = tuple[type, str, Callable[[nn.Module, Any], Any], str]
_TABLE: list[_Entry] = []


def _table() -> list[_Entry]:
    if not _TABLE:
        from ..moments.attention import ATTENTION_RULES
        from ..moments.layer_norm import ROUTES
        from ..moments.skip import check_skip_rule
        from .activations import GELU, check_gelu_rule
        from .attention import MultiheadAttention, TransformerEncoderLayer
        from .layer_norm import LayerNorm

        def one_of(allowed: tuple[Any, ...]) -> Callable[[nn.Module, Any], Any]:
            def check(module: nn.Module, value: Any) -> Any:
                if value not in allowed:
                    raise ValueError(f"expected one of {allowed}, got {value!r}")
                return value

            return check

        _TABLE.extend(
            [
                (LayerNorm, "route", one_of(ROUTES), "layer_norm_route"),
                (
                    GELU,
                    "rule",
                    lambda m, v: check_gelu_rule(v, str(m.approximate)),
                    "gelu_rule",
                ),
                (
                    MultiheadAttention,
                    "rule",
                    one_of((None, *ATTENTION_RULES)),
                    "attention_rule",
                ),
                (
                    TransformerEncoderLayer,
                    "skip_rule",
                    lambda m, v: check_skip_rule(v),
                    "skip_rule",
                ),
            ]
        )
    return _TABLE


def rule_attributes(module: nn.Module) -> tuple[str, ...]:
    """The rule attributes of ``module``'s class (empty for a module without any)."""
    return tuple(attr for cls, attr, _, _ in _table() if isinstance(module, cls))


def rule_keywords() -> dict[str, tuple[type, str]]:
    """``{keyword: (module class, attribute)}``: what :func:`~lightning_dvi.nn.posthoc.set_rules` sets.

    The same table :func:`module_rules` reads, so every rule ``set_rules`` can change is one a
    checkpoint records.
    """
    return {keyword: (cls, attr) for cls, attr, _, keyword in _table()}


def module_rules(module: nn.Module) -> dict[str, dict[str, Any]]:
    """``{submodule path: {attribute: value}}`` for ``module`` and every submodule with rules.

    The path is the one of ``module.named_modules()`` (``""`` for ``module`` itself); values
    are strings or ``None``, plain data for a checkpoint or a JSON file.
    """
    out: dict[str, dict[str, Any]] = {}
    for path, sub in module.named_modules():
        attrs = rule_attributes(sub)
        if attrs:
            out[path] = {attr: getattr(sub, attr) for attr in attrs}
    return out


def apply_rules(module: nn.Module, rules: Any, where: str) -> None:
    """Set the rules :func:`module_rules` recorded on ``module`` (built afresh from the same data).

    Args:
        module: the module to change in place.
        rules: ``{submodule path: {attribute: value}}``.
        where: a name for error messages.

    Raises:
        ValueError: for data that is not such a mapping, a path ``module`` does not have, an
            attribute that is not a rule of that submodule's class, or a value the class
            refuses.
    """
    if not isinstance(rules, Mapping):
        raise ValueError(f"{where}.rules: expected a mapping of submodule paths, got {rules!r}")
    for path, values in rules.items():
        at = f"{where}.rules[{path!r}]"
        if not isinstance(path, str) or not isinstance(values, Mapping):
            raise ValueError(f"{at}: expected a path and a mapping of attributes")
        try:
            sub = module.get_submodule(path)
        except AttributeError as err:
            raise ValueError(f"{at}: the module has no submodule {path!r}") from err
        for attr, value in values.items():
            checks = [c for cls, a, c, _ in _table() if a == attr and isinstance(sub, cls)]
            if not checks:
                raise ValueError(
                    f"{at}: {attr!r} is not a rule of {type(sub).__name__} "
                    f"(rules: {rule_attributes(sub) or 'none'})"
                )
            try:
                setattr(sub, attr, checks[0](sub, value))
            except ValueError as err:
                raise ValueError(f"{at}.{attr}: {err}") from err
