r"""Execution policy of the moment formulas: which implementation runs where.

The formulas of :mod:`lightning_dvi.moments` are written once: the ReLU covariance and its
closed-form backward elementwise over broadcastable row/column operands with a pluggable scratch
allocator (:mod:`lightning_dvi.moments._relu_cov`), the Heaviside covariance as one whole-tensor
function (:func:`~lightning_dvi.moments.heaviside_cov`). This module only decides *how* they are
executed:

* ``"blocked"``: the ReLU formula on cache-sized blocks of the upper triangle with reused
  scratch buffers (a Python loop over blocks; Heaviside: its formula, unchunked). Fastest on a CPU, where a block stays in cache;
  on a GPU it means tens of thousands of tiny kernel launches.
* ``"whole"``: each formula as a handful of whole-tensor kernels on ``[n, D, D]`` with no host
  synchronisation and no Python loop over batch elements; the batch is cut into chunks only
  when the ``[n, D, D]`` temporaries would exceed the memory budget (:func:`set_memory_budget`).
* ``"compiled"``: the same whole-tensor formulas through :func:`torch.compile` (inductor emits
  fused Triton kernels on CUDA and C++ on a CPU), chunked the same way. If compilation fails
  (no Triton, no C++ compiler, an unsupported op) the call falls back to ``"whole"`` with a
  one-time warning, and stays there.

``"auto"`` (the default) picks ``"blocked"`` on a CPU, ``"compiled"`` on CUDA when Triton is
importable (``"whole"`` otherwise) and ``"whole"`` on any other device. While an outer
:func:`torch.compile` traces the model (a compiled training step) the choice is always
``"whole"``: the outer compiler fuses the formula into its own graph, and a Python loop over
blocks would be unrolled into it.

**Fused Functions or autograd.** A linear formula with a closed-form backward (the dDVI
layer, the narrow full-covariance head fed a diagonal input: :mod:`.linear`) runs in eager mode as one ``torch.autograd.Function`` whose forward calls the
formula and whose backward evaluates its derivatives; :func:`use_fused` decides per call, and
falls back to autograd through the same formula under ``torch.compile``, export, ``torch.func``
transforms and tensor subclasses. (The ReLU moments are always a Function, :mod:`._relu`:
their tail-safe forward selects branches with steep 0/1 weights that autograd must not
differentiate.)

Knobs (each also read once from an environment variable at import):

* :func:`set_fused` / :func:`fused_functions` (context manager), env
  ``LIGHTNING_DVI_FUSED`` = ``0`` to differentiate every formula by autograd;
* :func:`set_kernel_backend` / :func:`kernel_backend` (context manager), env
  ``LIGHTNING_DVI_KERNELS`` = ``auto|blocked|whole|compiled``;
* :func:`set_compile_options`: the :func:`torch.compile` arguments of the ``"compiled"`` path;
* :func:`set_memory_budget` / :func:`memory_budget` (context manager), env
  ``LIGHTNING_DVI_MEMORY_BUDGET`` = bytes (default 2 GiB): the scratch memory the whole-tensor
  paths may use at once, estimated as ``k * n * D * D * itemsize`` with ``k`` =
  :data:`SCRATCH_ARRAYS` per path. It bounds temporaries, not the output nor the inputs. A
  quarter of it bounds what a blocked forward keeps for its backward (:func:`keep_factors`:
  the ReLU covariance's four ``[n, D, D]`` factors); past that the backward recomputes them.

Examples:
    >>> import torch
    >>> from lightning_dvi.moments import policy, relu_full
    >>> policy.select_backend("cpu"), policy.select_backend("cuda:0", has_triton=False)
    ('blocked', 'whole')
    >>> mean, cov = torch.zeros(4, 3), torch.eye(3).expand(4, 3, 3)
    >>> with policy.kernel_backend("whole"), policy.memory_budget(1024):
    ...     out = relu_full(mean, cov)[1]  # whole-tensor kernels, one matrix per chunk
    >>> policy.chunk_size(4, 3, torch.float32, "whole")
    4
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch

from .._tracing import step_trace, tracing
from .special import SHORT_ROW

__all__ = [
    "FLAT_BUFFER_NUMEL",
    "OPAQUE_ERFC_NUMEL",
    "SCRATCH_ARRAYS",
    "Backend",
    "chunk_size",
    "chunks",
    "classes_first",
    "compiled",
    "elementwise",
    "erfc",
    "flat_elementwise",
    "fused_functions",
    "get_fused",
    "get_kernel_backend",
    "get_memory_budget",
    "keep_factors",
    "kernel_backend",
    "memory_budget",
    "reset_compiled",
    "resolve",
    "select_backend",
    "set_compile_options",
    "set_fused",
    "set_kernel_backend",
    "set_memory_budget",
    "step_trace",
    "tracing",
    "use_fused",
]

Backend = Literal["auto", "blocked", "whole", "compiled"]
_BACKENDS = ("auto", "blocked", "whole", "compiled")

SCRATCH_ARRAYS: dict[str, int] = {"whole": 16, "compiled": 4}
"""Estimated live ``[n, D, D]`` temporaries of one forward or backward call, per path.

Eager whole-tensor kernels materialise every intermediate of the formula (the backward's ~16
are the peak); inductor fuses the elementwise chains, leaving a few arrays (the output and
what a reduction reads twice).
"""

_DEFAULT_BUDGET = 2 << 30


def _env_backend() -> str:
    value = os.environ.get("LIGHTNING_DVI_KERNELS", "auto").strip().lower()
    if value not in _BACKENDS:
        raise ValueError(
            f"LIGHTNING_DVI_KERNELS must be one of {', '.join(_BACKENDS)}, got {value!r}"
        )
    return value


def _env_budget() -> int:
    value = os.environ.get("LIGHTNING_DVI_MEMORY_BUDGET")
    if value is None or not value.strip():
        return _DEFAULT_BUDGET
    try:
        budget = int(float(value))
    except ValueError:
        msg = f"LIGHTNING_DVI_MEMORY_BUDGET must be a number of bytes, got {value!r}"
        raise ValueError(msg) from None
    return _check_budget(budget)


def _check_budget(budget: object) -> int:
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"memory budget must be a positive int (bytes), got {budget!r}")
    return budget


_state: dict[str, Any] = {
    "fused": os.environ.get("LIGHTNING_DVI_FUSED", "1").strip() != "0",
    "backend": _env_backend(),
    "budget": _env_budget(),
    "compile_options": {"dynamic": None},
}
_compiled: dict[str, Callable[..., Any] | None] = {}
_failed: set[str] = set()


# ---------------------------------------------------------------------------- knobs
def set_kernel_backend(backend: Backend) -> None:
    """Choose the execution of the full-covariance kernels for this process.

    Args:
        backend: ``"auto"``, ``"blocked"``, ``"whole"`` or ``"compiled"`` (module docstring).

    Raises:
        ValueError: on another value.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"kernel backend must be one of {', '.join(_BACKENDS)}, got {backend!r}")
    _state["backend"] = backend


def get_kernel_backend() -> str:
    """The configured backend (``"auto"`` unless set)."""
    return str(_state["backend"])


@contextlib.contextmanager
def kernel_backend(backend: Backend) -> Iterator[None]:
    """Within the block, use ``backend`` (see :func:`set_kernel_backend`)."""
    previous = _state["backend"]
    set_kernel_backend(backend)
    try:
        yield
    finally:
        _state["backend"] = previous


def set_memory_budget(budget: int) -> None:
    """Bytes of ``[n, D, D]`` scratch the whole-tensor and compiled paths may hold at once.

    The batch of matrices is processed in chunks of :func:`chunk_size` matrices. Chunking
    changes nothing in the results (each matrix is computed independently), only the peak
    memory and the number of kernel launches.

    Raises:
        ValueError: unless ``budget`` is a positive int.
    """
    _state["budget"] = _check_budget(budget)


def get_memory_budget() -> int:
    """The current scratch-memory budget in bytes (default 2 GiB)."""
    return int(_state["budget"])


@contextlib.contextmanager
def memory_budget(budget: int) -> Iterator[None]:
    """Within the block, use ``budget`` bytes (see :func:`set_memory_budget`)."""
    previous = _state["budget"]
    set_memory_budget(budget)
    try:
        yield
    finally:
        _state["budget"] = previous


# ---------------------------------------------------------------------------- fused
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def set_fused(enabled: bool) -> None:
    """Run the moment formulas that have one as fused autograd Functions (default ``True``).

    With ``False`` every formula is differentiated by autograd op by op: the reference the
    tests compare the fused Functions with, and an A/B switch for benchmarks.
    """
    _state["fused"] = bool(enabled)


def get_fused() -> bool:
    """Whether fused autograd Functions are enabled (:func:`set_fused`)."""
    return bool(_state["fused"])


@contextlib.contextmanager
def fused_functions(enabled: bool) -> Iterator[None]:
    """Within the block, enable or disable the fused Functions (see :func:`set_fused`)."""
    previous = _state["fused"]
    set_fused(enabled)
    try:
        yield
    finally:
        _state["fused"] = previous


OPAQUE_ERFC_NUMEL = 1 << 14
"""From this many elements a traced CPU ``erfc`` is an opaque ATen call (:func:`erfc`)."""


@torch.library.custom_op("lightning_dvi::erfc", mutates_args=())
def _erfc_op(x: torch.Tensor) -> torch.Tensor:
    return torch.erfc(x)


@_erfc_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _erfc_backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    (x,) = ctx.saved_tensors
    return grad * torch.exp(-x * x) * (-2.0 / math.sqrt(math.pi))


def _erfc_setup(ctx: Any, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0])


_erfc_op.register_autograd(_erfc_backward, setup_context=_erfc_setup)


def _opaque_here(x: torch.Tensor, numel: int) -> bool:
    """Whether a traced CPU graph takes an opaque custom op for ``x`` (of ``numel`` or more elements).

    Only while traced for a CPU (:func:`tracing`), and never in an export, whose file must run
    without this package.
    """
    return (
        x.device.type == "cpu"
        and x.numel() >= numel
        and tracing()
        and not torch.compiler.is_exporting()
    )


FLAT_BUFFER_NUMEL = 1 << 10
"""From this many elements a traced CPU elementwise formula runs on flat buffers (:func:`flat_elementwise`)."""


@torch.library.custom_op("lightning_dvi::flat_buffer", mutates_args=())
def _flat_buffer_op(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).clone()


@_flat_buffer_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.numel())


def _flat_buffer_backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    return grad.view(ctx.shape)


def _flat_buffer_setup(ctx: Any, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:
    ctx.shape = inputs[0].shape


_flat_buffer_op.register_autograd(_flat_buffer_backward, setup_context=_flat_buffer_setup)


def flat_elementwise(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor | None:
    r"""``fn(*args)`` of an elementwise formula run on flat buffers, where that is how it runs.

    While a graph is traced (:func:`tracing`) for a CPU, from :data:`FLAT_BUFFER_NUMEL`
    elements of an input with 2 or more dimensions: each argument (all of one shape, e.g.
    after ``torch.broadcast_tensors``) becomes a 1-D buffer of its own, the custom op
    ``lightning_dvi::flat_buffer`` (a copy, opaque to inductor), ``fn`` runs on those and the
    result takes the shape back. Elsewhere (eager, other devices, an export) it returns
    ``None`` and the caller computes ``fn(*args)`` itself; the values are the same either way,
    element by element.

    Why: inductor's C++ code vectorises along the innermost dimension. On the ``[N, 10]``
    logits of a classifier head each vector op runs 10 of its 16 lanes behind a mask, and
    inputs that are gathers (the diagonal of a covariance, a label's row) are loaded one
    element at a time; flattened *within* the fused kernel the index becomes ``i % 10`` and
    the loop is not vectorised at all. Contiguous buffers of their own make it one
    full-width loop: :func:`lightning_dvi.likelihoods.functional.softplus_normal_bound` on
    ``[1401, 10]``, value and gradient compiled, took 8.3 ms before and 1.3 ms after this and
    the opaque :func:`erfc` (``recipes/traced_objective.py``, docs/speed_current.md). The
    copies and a custom op's Python dispatch (about 45 µs a call) are why small tensors keep
    the fused form.
    """
    x = args[0]
    if x.dim() < 2 or not _opaque_here(x, FLAT_BUFFER_NUMEL):
        return None
    flat = [torch.ops.lightning_dvi.flat_buffer(a) for a in args]
    return fn(*flat).view(x.shape)


def classes_first(x: torch.Tensor) -> torch.Tensor | None:
    r"""A ``[K, N]`` copy of ``[N, K]`` rows with a short last dimension, where that is how they run.

    While a graph is traced (:func:`tracing`) for a CPU, for a 2-D ``x`` of at least
    :data:`FLAT_BUFFER_NUMEL` elements whose rows are shorter than
    :data:`~lightning_dvi.moments.special.SHORT_ROW` (16, the classes of a head):
    the transposed copy, a buffer of its own (``lightning_dvi::flat_buffer``), so that a loop
    of per-row reductions over it (``dim=0``) runs along ``N``, vectorised, instead of along
    the ``K`` classes of each row (10 of 16 lanes, a horizontal reduction per row). Elsewhere
    ``None``: the caller reduces over ``dim=-1``. The same arithmetic either way, row by row.
    Used by the Bouchard shift's Newton steps
    (:func:`lightning_dvi.likelihoods.functional.categorical_tight_expected_log_prob`): the
    compiled objective on ``[1401, 10]``, 5.6 → 5.2 ms (docs/speed_current.md).
    """
    if x.dim() != 2 or x.shape[-1] >= SHORT_ROW or not _opaque_here(x, FLAT_BUFFER_NUMEL):
        return None
    rows: torch.Tensor = torch.ops.lightning_dvi.flat_buffer(x.mT).view(x.shape[1], x.shape[0])
    return rows


def erfc(x: torch.Tensor) -> torch.Tensor:
    r""":math:`\operatorname{erfc}(x)`: ``torch.special.erfc``, kept one opaque op while traced on a CPU.

    Inductor's C++ code for ``erfc`` is about 4.5x slower than ATen's vectorised kernel (a
    ``[512, 128]`` float32 call: 239 against 54 us on a 2-core Intel Xeon), and inside a fused
    kernel it is evaluated again wherever the value is read. So while a graph is traced
    (:func:`tracing`) for a CPU, ``erfc`` goes into the graph as the custom op
    ``lightning_dvi::erfc``, which inductor calls as an external kernel (ATen's) and stores
    once. A custom op call costs about 45 us of Python dispatch, so only tensors of at least
    :data:`OPAQUE_ERFC_NUMEL` elements take it (the break-even at about 3 ns saved per element).
    The values are ATen's either way; elsewhere (eager, CUDA, and an export, whose file must
    run without this package) it is ``torch.special.erfc``.
    """
    if _opaque_here(x, OPAQUE_ERFC_NUMEL):
        return torch.ops.lightning_dvi.erfc(x)  # type: ignore[no-any-return]  # a registered op
    return torch.erfc(x)


def use_fused(*tensors: torch.Tensor | None) -> bool:
    """Whether this call of a moment formula runs as its fused autograd Function.

    A fused Function computes the formula's outputs in one node with no graph inside and
    evaluates its closed-form derivatives in the backward: a few whole-tensor kernels where
    autograd would dispatch a node, a saved tensor and a gradient accumulation per op. It is
    the eager path. The formula itself is differentiated by autograd instead

    * while ``torch.compile`` traces (the compiler fuses the formula and derives its backward
      itself) or an exporter does (the exported graph needs plain aten ops);
    * under ``torch.func`` transforms (``vmap``, ``grad``, ``jvp``: the Functions define no
      ``vmap``/``jvp`` rule and their backward is not differentiable again);
    * for tensor subclasses (a front-end's tensor that carries its own dispatch);
    * when :func:`set_fused` turned the Functions off.

    Args:
        tensors: the call's tensor arguments (``None`` for an absent bias is allowed).
    """
    if not _state["fused"]:
        return False
    if tracing() or torch.compiler.is_exporting():
        return False
    if torch._C._are_functorch_transforms_active():
        return False
    return all(t is None or type(t) in _PLAIN for t in tensors)


# ---------------------------------------------------------------------------- selection
def _has_triton() -> bool:
    try:
        from torch.utils._triton import has_triton
    except ImportError:  # pragma: no cover - very old torch
        return False
    return bool(has_triton())


def select_backend(
    device: torch.device | str,
    *,
    backend: str | None = None,
    tracing: bool = False,
    has_triton: bool | None = None,
) -> str:
    """The path a kernel takes for tensors on ``device``: ``"blocked"``, ``"whole"`` or ``"compiled"``.

    Args:
        device: where the tensors live (a string such as ``"cuda:0"`` is enough).
        backend: the configured choice (default: :func:`get_kernel_backend`).
        tracing: whether an outer ``torch.compile`` is tracing the call (then ``"whole"``).
        has_triton: whether Triton can be imported (default: checked).
    """
    backend = get_kernel_backend() if backend is None else backend
    if tracing:
        return "whole"
    if backend != "auto":
        return backend
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    if kind == "cpu":
        return "blocked"
    if kind == "cuda":
        return "compiled" if (_has_triton() if has_triton is None else has_triton) else "whole"
    return "whole"


def resolve(device: torch.device) -> str:
    """:func:`select_backend` for a live call, with failed compilations falling back."""
    path = select_backend(device, tracing=tracing())
    if path == "compiled" and _failed:
        return "whole"
    return path


def chunk_size(n: int, d: int, dtype: torch.dtype, path: str) -> int:
    """Matrices per chunk so that ``SCRATCH_ARRAYS[path]`` ``[chunk, d, d]`` arrays fit the budget.

    At least one matrix per chunk (a single matrix larger than the budget still runs), at most
    ``n``.
    """
    per_matrix = SCRATCH_ARRAYS.get(path, SCRATCH_ARRAYS["whole"]) * d * d
    per_matrix *= dtype.itemsize
    return max(1, min(n, get_memory_budget() // max(per_matrix, 1)))


def keep_factors(numel: int, dtype: torch.dtype) -> bool:
    """Whether a forward may keep ``numel`` elements of factors for its backward.

    A Function whose backward needs intermediates of its forward either keeps them (the
    backward only combines them with the output gradient) or computes them again in the
    backward (less memory, more time). Kept when they fit in a quarter of the memory budget
    (:func:`set_memory_budget`); ``memory_budget(1)`` forces the recomputation.

    Examples:
        >>> import torch
        >>> keep_factors(1 << 20, torch.float32), keep_factors(1 << 30, torch.float32)
        (True, False)
    """
    return numel * dtype.itemsize <= get_memory_budget() // 4


def chunks(n: int, size: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` covering ``range(n)`` in pieces of ``size``."""
    return [(i, min(n, i + size)) for i in range(0, n, size)]


# ---------------------------------------------------------------------------- compile
def compiled(name: str, fn: Callable[..., Any], dynamic: bool | None = None) -> Callable[..., Any]:
    """``fn`` through :func:`torch.compile`, created once per ``name``, with eager fallback.

    The returned callable runs the compiled function; if compiling or running it raises, it
    warns once, marks compilation as failed for the rest of the process (so :func:`resolve`
    answers ``"whole"``) and returns ``fn``'s eager result instead. ``dynamic`` (unless the
    compile options set it) is passed to :func:`torch.compile`.
    """
    if name not in _compiled:
        try:
            options = dict(_state["compile_options"])
            if dynamic is not None:
                options.setdefault("dynamic", dynamic)
            _compiled[name] = torch.compile(fn, **options)
        except Exception as err:  # pragma: no cover - torch.compile itself unavailable
            _fail(name, err)
            _compiled[name] = None
    fast = _compiled[name]

    def call(*args: Any) -> Any:
        if fast is None or _failed:
            return fn(*args)
        try:
            return fast(*args)
        except Exception as err:
            _fail(name, err)
            return fn(*args)

    return call


def elementwise(name: str, fn: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    """A fused Function's forward or backward body, compiled where :func:`resolve` says so.

    On CUDA with Triton (``"compiled"``) the tens of elementwise kernels of a moment formula
    become one or a few; elsewhere ``fn`` runs eagerly. The same formula either way. Compiled
    with dynamic shapes from the start: one compilation serves every layer's shape and a last,
    smaller batch (automatic dynamic shapes would recompile for each dimension that changes,
    e.g. the batch size of an epoch's last batch, inside a timed epoch).
    """
    return compiled(name, fn, dynamic=True) if resolve(device) == "compiled" else fn


def _fail(name: str, err: BaseException) -> None:
    if not _failed:  # one warning per process, whichever kernel failed first
        warnings.warn(
            f"lightning_dvi.moments: torch.compile of {name} failed ({type(err).__name__}: "
            f"{err}); using the eager whole-tensor kernels instead",
            RuntimeWarning,
            stacklevel=3,
        )
    _failed.add(name)


def set_compile_options(**options: Any) -> None:
    """Keyword arguments of :func:`torch.compile` for the ``"compiled"`` path.

    Default ``dynamic=None`` (inductor, static shapes until a second shape is seen). Tests use
    ``backend="aot_eager"`` (traced and functionalised, no code generation: seconds instead of
    the ~45 s inductor takes to build the ReLU kernels on a small CPU). Forgets kernels
    compiled with the previous options.
    """
    _state["compile_options"] = {"dynamic": None, **options}
    reset_compiled()


def reset_compiled() -> None:
    """Forget compiled kernels and failures (e.g. after changing torch.compile settings)."""
    _compiled.clear()
    _failed.clear()
