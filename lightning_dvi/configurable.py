"""Objects the front ends take, recorded as plain configurations and rebuilt from an allow-list.

A front end (``DVIRegressor(likelihood=..., prior=...)``) takes an object, a shorthand name, or a
configuration ``{"class_path": ..., "init_args": {...}}``, which is what a checkpoint records of
an object. A checkpoint is data, so a configuration is rebuilt only for classes on an
:class:`AllowList` (the library's own classes and those its users register), looked up by name
in a table: nothing the file names is imported or called, and the arguments must be plain data.

:class:`RecordsInitArgs` gives every subclass an ``init_args`` attribute with the arguments its
constructor was called with, which is what the configuration records.

This module imports nothing from the rest of the package (a leaf of the import graph).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar

__all__ = ["AllowList", "RecordsInitArgs", "plain"]

_T = TypeVar("_T")
_C = TypeVar("_C", bound=type)

_PLAIN = (bool, int, float, str, type(None))


def plain(value: Any, where: str) -> Any:
    """``value`` checked to be plain data: numbers, strings, booleans, ``None``, lists and dicts of them.

    Tuples become lists (what a checkpoint's YAML or ``weights_only`` load gives back).

    Raises:
        ValueError: naming ``where`` for anything else (a tensor, a module, a callable).
    """
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v, where) for v in value]
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {k: plain(v, where) for k, v in value.items()}
    raise ValueError(
        f"{where}: arguments must be plain values (numbers, strings, booleans, None, and lists "
        f"or dicts of them) to be recorded in a checkpoint, got a {type(value).__name__}"
    )


class RecordsInitArgs:
    """Mixin: every subclass records the arguments its constructor was called with.

    After ``obj = Cls(*args, **kwargs)``, ``obj.init_args`` maps each parameter name to its
    value, defaults applied (``**kwargs`` merged in, ``*args`` dropped); when a constructor calls
    its parent's, the outermost call's arguments are the ones kept.

    Attributes:
        init_args: the recorded arguments.
    """

    init_args: dict[str, Any]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Wrap the subclass's own ``__init__`` (when it defines one) so that it records its arguments."""
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            cls.__init__ = _recording(cls.__init__)  # type: ignore[method-assign]  # wraps the constructor


def _recording(init: Callable[..., None]) -> Callable[..., None]:
    """``init`` that also records its arguments as ``self.init_args`` (the outermost call's last)."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def recording_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        recorded: dict[str, Any] = {}
        for name, value in list(bound.arguments.items())[1:]:
            kind = signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                recorded.update(value)
            elif kind is not inspect.Parameter.VAR_POSITIONAL:
                recorded[name] = value
        self.__dict__["init_args"] = recorded

    return recording_init


class AllowList(Generic[_T]):
    """The classes of one kind (likelihoods, priors) that a configuration may name, by class path.

    Args:
        noun: what the objects are called in messages (``"likelihood"``).
        base: the base class every allowed class derives from.
        library: the library's own classes of this kind (allowed without registration); a
            callable, so that the table is read when a configuration is built.
        public: the public package(s) whose name may stand for the defining module
            (``"lightning_dvi.likelihoods"``: ``lightning_dvi.likelihoods.Poisson``); with
            several, the first that contains the module gives the alias, and the first names
            the register function in messages.
        register_hint: the name of the public function that registers a class (for messages).
        refusal: the message for a refused class path, a format string of ``class_path`` and
            ``where`` (``None``: the configuration message of likelihoods and priors).
        base_name: how messages name :attr:`base` (default: its class name).
    """

    def __init__(
        self,
        noun: str,
        base: type[_T],
        library: Callable[[], Iterable[type[_T]]],
        public: str | tuple[str, ...],
        register_hint: str,
        refusal: str | None = None,
        base_name: str | None = None,
    ) -> None:
        self.noun = noun
        self.base = base
        self.library = library
        self.publics = (public,) if isinstance(public, str) else tuple(public)
        self.public = self.publics[0]
        self.register_hint = register_hint
        self.refusal = refusal
        self.base_name = base_name or base.__name__
        self.registered: dict[str, type[_T]] = {}

    def paths(self, cls: type) -> tuple[str, ...]:
        """The class paths naming ``cls``: where it is defined, and its alias in a public package."""
        paths = [f"{cls.__module__}.{cls.__qualname__}"]
        for public in self.publics:
            if cls.__module__.startswith(f"{public}.") and "." not in cls.__qualname__:
                paths.append(f"{public}.{cls.__qualname__}")
                break
        return tuple(paths)

    def register(self, cls: _C) -> _C:
        """Allow ``cls`` to be rebuilt from a configuration's ``class_path`` (returns it unchanged).

        Raises:
            ValueError: if ``cls`` is not a subclass of :attr:`base`.
        """
        given = cls  # returned as given (the check below narrows ``cls``)
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise ValueError(f"{self.register_hint} takes a {self.base_name} subclass, got {cls!r}")
        for path in self.paths(cls):
            self.registered[path] = cls
        return given

    def lookup(self, class_path: object, where: str) -> type[_T]:
        """The allowed class named ``class_path``, looked up by name (nothing is imported).

        Raises:
            ValueError: naming ``class_path`` when it is neither a library class nor registered.
        """
        library = {path: obj for obj in self.library() for path in self.paths(obj)}
        cls = {**library, **self.registered}.get(str(class_path))
        if cls is None and self.refusal is not None:
            raise ValueError(self.refusal.format(class_path=class_path, where=where))
        if cls is None:
            raise ValueError(
                f"refusing to build the {self.noun} {class_path!r} named by {where}: only "
                f"lightning_dvi's {self.noun}s and classes registered with "
                f"{self.public}.{self.register_hint} are built from a configuration "
                "(nothing it names is imported or called)"
            )
        return cls

    def record(self, obj: object) -> dict[str, Any]:
        """``{"class_path", "init_args"}``: the plain record of ``obj``'s construction.

        The arguments are those its constructor was called with (:class:`RecordsInitArgs`);
        learned parameters and buffers travel in the state dict.

        Raises:
            ValueError: for an argument that is not plain data.
        """
        cls = type(obj)
        where = f"the {self.noun} {cls.__name__}"
        init_args = getattr(obj, "init_args", {})
        return {
            "class_path": self.paths(cls)[-1],
            "init_args": {str(k): plain(v, f"{where} ({k})") for k, v in init_args.items()},
        }

    def build(self, config: Mapping[str, Any], where: str) -> _T:
        """The object a configuration describes, built from plain arguments.

        Raises:
            ValueError: for unexpected keys, a class that is not allowed, arguments that are not
                plain data, or arguments its constructor refuses.
        """
        extra = set(config) - {"class_path", "init_args", "dict_kwargs"}
        if extra:
            raise ValueError(f"{where} has unexpected keys {sorted(extra)} next to class_path")
        cls = self.lookup(config.get("class_path"), where)
        arguments: dict[str, Any] = {}
        for key in ("init_args", "dict_kwargs"):
            given = config.get(key) or {}
            if not isinstance(given, Mapping):
                raise ValueError(f"{where}: {key} must be a mapping, got {type(given).__name__}")
            arguments.update({str(k): plain(v, f"{where} ({k})") for k, v in given.items()})
        try:
            return cls(**arguments)
        except TypeError as err:
            raise ValueError(f"{where}: cannot build {config.get('class_path')}: {err}") from err

    def instance(self, value: object, owner: str, shorthands: Iterable[str]) -> _T:
        """A front end's non-shorthand value as an allowed object: itself, or built from its configuration.

        Args:
            value: an instance of :attr:`base`, or ``{"class_path", "init_args"}``.
            owner: the front end's name (``"DVIRegressor"``), for messages.
            shorthands: the shorthand names the front end also accepts, for messages.

        Raises:
            ValueError: for anything else, naming what is accepted; as :meth:`build` for a
                refused configuration.
        """
        if isinstance(value, Mapping):
            return self.build(value, f"{owner}'s {self.noun} configuration")
        if isinstance(value, self.base):
            return value
        raise ValueError(
            f"{self.noun} must be {' or '.join(map(repr, shorthands))}, a {self.base.__name__} "
            f"or a {{'class_path', 'init_args'}} configuration, got {value!r}"
        )

    def check(self, config: object, where: str) -> None:
        """Check, without building anything, that a recorded configuration is allowed.

        A string (a shorthand) and ``None`` pass; a mapping needs an allowed ``class_path``.

        Raises:
            ValueError: as :meth:`lookup`.
        """
        if isinstance(config, Mapping):
            self.lookup(config.get("class_path"), where)
