"""The fused paths as PyTorch custom operators (``torch.library``), so that ``torch.compile`` keeps them.

Dynamo cannot trace into a fused path: its autograd function calls a compiled kernel through ``ctypes``. Each path
therefore runs under ``torch.compile`` as two custom operators in the ``gatedformer::`` namespace, its forward and
its backward pass, which dynamo records as opaque nodes (no graph break) and Inductor calls as they are, compiling
only the glue around them. Eager code keeps calling the autograd functions themselves: an operator's dispatch would
only add to every step, and the eager numbers stay those of the functions.

:class:`FunctionOperator` makes the two operators of one autograd function. The forward operator runs the
function's ``forward`` with a stand-in context; what that context keeps for the backward pass (saved tensors, the
function's own attributes) stays with it in Python, out of the graph, and the operator returns the function's outputs
and a *handle*: a one-element tensor whose storage carries the context as an attribute, so that the context travels
with the forward operator's output and lives exactly as long as some view of the handle does (autograd, or the
compiled graph, keeps it for the backward pass and drops it after); nothing outside the handle refers to it.
The backward operator takes the handle, the outputs' gradients, and the forward pass's tensor inputs and outputs,
runs the function's ``backward`` on the kept context and returns the gradients of the inputs that want one. Passing
it every input and output is what keeps them alive and unchanged until then: Inductor reuses a buffer once no node
reads it, and the context may still point at it. Each operator's fake (shape) function says what it returns, so the
graph's shapes are known without running a kernel; :func:`torch.library.opcheck` checks them against the real ones.
Everything is defined through torch's public ``torch.library`` API (``Library.define``/``impl``, ``register_fake``,
``register_autograd``), so that every torch release the package declares runs it alike.

Operator arguments are tensors, ints, floats, bools, strings and lists of them: the tuples the functions take (the
dropout masks' ``(seed, keep_below)``) are flattened, and each function's :class:`FunctionOperator` puts them back
together. :func:`call` picks the autograd function in eager code and the operator under ``torch.compile``.

Dropout masks come, as in eager mode, from 64-bit seeds drawn from torch's generator before the fused call, one per
mask in the order the eager path draws them. Under ``torch.compile`` the draw is an operator of its own,
``gatedformer::draw_seeds``, tagged non-deterministic so that no pass merges, drops or recomputes it, and ordered
after the tensors the fused call reads (which the fused calls before it made); the fused operator takes the seeds as a
tensor and reads them as ints. (Drawn as an int outside the operator, as the eager path does, the seed would be
``int()`` of a tensor: a graph break, or an unbacked symbolic int.) A compiled step therefore draws the same masks
in the same order as the eager one.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from gatedformer.kernels.build import constant_under_compile

__all__ = ["NAMESPACE", "REGISTERED", "TRACED_SEED", "FunctionOperator", "call", "define", "native", "runs_native"]

NAMESPACE = "gatedformer"
_INT32_VALUES = 2 ** 32
_CPU = torch.device("cpu")


# ---- what the fused paths ask of the kernels, asked once while dynamo traces ----------------------------------

def native(kernel: Any) -> bool:
    """Whether ``kernel`` (a :class:`~gatedformer.kernels.build.NativeKernel`) runs natively on the CPU. Under
    ``torch.compile`` the answer is taken once, while dynamo traces, as a constant of the graph (building the kernel
    if need be): the check itself is Python that dynamo should not trace into."""
    if torch.compiler.is_compiling():
        # A constant function's arguments must be constants on every declared torch (before 2.5 a kernel object
        # is not one): the kernel goes by its name.
        return _native_named(kernel.name)
    return kernel.pick_backend(_CPU) == "native"


@constant_under_compile
def _native_named(name: str) -> bool:
    return _kernel_named(name).pick_backend(_CPU) == "native"


def _kernel_named(name: str) -> Any:
    """The package's kernel called ``name``: the ``KERNEL``-like module attributes of the loaded
    ``gatedformer.kernels`` modules (each kernel is one, made when its module is imported)."""
    from gatedformer.kernels.build import NativeKernel

    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("gatedformer.kernels."):
            continue
        for value in vars(module).values():
            if isinstance(value, NativeKernel) and value.name == name:
                return value
    raise LookupError(f"no gatedformer kernel is called {name!r}")


def runs_native(kernel: Any, device: torch.device) -> bool:
    """``kernel.pick_backend(device) == "native"``, asked through :func:`native` under ``torch.compile``."""
    if torch.compiler.is_compiling():
        return device.type == "cpu" and native(kernel)
    return kernel.pick_backend(device) == "native"


# ---- seeds ---------------------------------------------------------------------------------------------------

_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")
"""Where the operators are defined. Through :class:`torch.library.Library` rather than ``torch.library.custom_op``:
the same schema, kernel, fake function and autograd formula, without the checks and wrappers ``custom_op`` adds to
every call, which a compiled step pays a dozen to two dozen times (benchmarks/README.md)."""


def define(name: str, schema: str, kernel: Callable[..., Any], fake: Callable[..., Any],
           tags: Sequence[torch.Tag] = ()) -> Callable[..., Any]:
    """The operator ``gatedformer::name`` of ``schema`` (``"(Tensor x, int k) -> Tensor[]"``), computed by
    ``kernel`` on every device and described by ``fake`` (its outputs' shapes, for tracing)."""
    _LIBRARY.define(f"{name}{schema}", tags=tuple(tags))
    _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIBRARY)
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def _draw_seeds(after: list[Tensor], count: int) -> Tensor:
    """``count`` seeds from torch's default generator, as ``count`` draws of the eager paths' ``_draw_seed`` give
    them; ``after`` only orders the draw (the tensors the fused call that uses the seeds reads)."""
    return torch.randint(0, 2 ** 63 - 1, (count,), dtype=torch.int64)


def _no_seeds_yet(after: list[Tensor], count: int) -> Tensor:
    return torch.empty(count, dtype=torch.int64)


_draw_seeds_op = define("draw_seeds", "(Tensor[] after, int count) -> Tensor", _draw_seeds, _no_seeds_yet,
                        tags=(torch.Tag.nondeterministic_seeded,))


# ---- the stand-in context and the handle that keeps it ---------------------------------------------------------

class _Context:
    """What an autograd function's ``forward`` and ``backward`` read and write of their ``ctx``, outside autograd."""

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad
        self.materialize_grads = True
        self.saved_tensors: tuple[Tensor | None, ...] = ()

    def save_for_backward(self, *tensors: Tensor | None) -> None:
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors: Tensor) -> None:
        pass  # the operator's own autograd registration says which outputs take no gradient

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value


_CONTEXT_ATTRIBUTE = "gatedformer_context"


def _handle(context: _Context) -> Tensor:
    """A one-element tensor whose storage carries ``context``: every view of the handle (the one autograd saves,
    the one a compiled graph passes on) shares that storage, and the context goes with the storage's last view. Its
    value is the same for every call, so that a forward operator's outputs depend on its inputs alone, as
    :func:`torch.library.opcheck` checks."""
    handle = torch.zeros(1, dtype=torch.int64)
    setattr(handle.untyped_storage(), _CONTEXT_ATTRIBUTE, context)
    return handle


def _kept_context(handle: Tensor) -> _Context:
    context = getattr(handle.untyped_storage(), _CONTEXT_ATTRIBUTE, None)
    if context is None:
        raise RuntimeError("a gatedformer operator's backward pass found no forward pass to go with it (its handle "
                           "was copied, or its forward pass ran in another process)")
    return context


def _view(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.view_as(t)


def _without_grad(function: Callable[..., Any], *args: object) -> Any:
    """``function(*args)`` with gradients off: the compiled graphs that call the operators have turned them off
    already, and entering ``torch.no_grad`` costs a tenth of what an operator adds to a call."""
    if not torch.is_grad_enabled():
        return function(*args)
    with torch.no_grad():
        return function(*args)


def _fresh(tensors: Sequence[Tensor], taken: Sequence[Tensor | None],
           like: Sequence[Tensor | None] = ()) -> list[Tensor]:
    """``tensors`` as an operator may return them: none sharing memory with ``taken`` (its inputs) or with another,
    each contiguous from the start of its storage or with the strides of ``torch.empty_like`` of its ``like`` (what
    the fake function gives)."""
    # Storages told apart by address (a few dozen a call: weak references to them cost more than the checks)
    seen = {t.untyped_storage().data_ptr() for t in taken if t is not None}
    out = []
    for i, t in enumerate(tensors):
        reference = like[i] if i < len(like) else None
        if reference is not None and reference.shape == t.shape:
            # empty_like keeps a dense tensor's strides, a contiguous one's among them
            wanted = reference.stride() if reference.is_contiguous() else torch.empty_like(reference).stride()
            misplaced = t.stride() != wanted or t.storage_offset() != 0
        else:
            reference, misplaced = None, not t.is_contiguous() or t.storage_offset() != 0
        address = t.untyped_storage().data_ptr()
        if misplaced or address in seen:
            t = (torch.empty_like(reference) if reference is not None else torch.empty_like(
                t, memory_format=torch.contiguous_format)).copy_(t)
            address = t.untyped_storage().data_ptr()
        seen.add(address)
        out.append(t)
    return out


_SINGLE = ("Tensor", "Tensor?")
_LIST = ("Tensor[]", "Tensor?[]")


def _tensor_kinds(schema: str) -> list[str | None]:
    """For each argument of an operator's schema (``"(Tensor x, int k, Tensor?[] w) -> ..."``): ``"one"`` for a
    tensor (optional or not), ``"list"`` for a list of them, ``None`` for anything else."""
    # The schemas are the ones this module writes: "(type name, type name, ...) -> returns", no defaults
    types = [argument.split()[0] for argument in schema[1:schema.index(")")].split(",")]
    return ["one" if kind in _SINGLE else "list" if kind in _LIST else None for kind in types]


def _leaves(kinds: Sequence[str | None], values: Sequence[object]) -> list[Tensor | None]:
    """The tensor arguments of an operator call, lists flattened (``None`` kept in place), in schema order."""
    leaves: list[Tensor | None] = []
    count = min(len(kinds), len(values))  # dynamo before 2.5 cannot trace a zip of unequal lengths
    for kind, value in zip(kinds[:count], values[:count], strict=True):
        if kind == "one":
            leaves.append(value)  # type: ignore[arg-type]
        elif kind == "list":
            leaves += list(value)  # type: ignore[call-overload]
    return leaves


class _TracedSeed:
    """The seed of a dropout mask drawn under ``torch.compile``: a stand-in that :class:`FunctionOperator` replaces by
    a draw of ``gatedformer::draw_seeds``."""

    def __repr__(self) -> str:
        return "TRACED_SEED"


TRACED_SEED = _TracedSeed()
"""What the eager paths' seed draw (``ops.dropout._draw_seed``) gives under ``torch.compile``: ``int()`` of a drawn
tensor would break the graph, so the draw is left to the operator that takes the seed."""


def _parameters(declared: str) -> list[tuple[str, str]]:
    """``"Tensor x, Mask mask, ..."`` as ``[(type, name), ...]``."""
    return [tuple(part.split()) for part in declared.split(",")]  # type: ignore[misc]


def _flatten(parameters: Sequence[tuple[str, str]], args: Sequence[object]) -> tuple[list[object], list[object]]:
    """A function's arguments as its operator's (seeds and keep counts apart) and the seeds, in order."""
    flat: list[object] = []
    seeds: list[object] = []
    for (kind, _), value in zip(parameters, args, strict=True):
        if kind == "Seed":
            seeds.append(value)
        elif kind == "Blas":  # found again where the function runs (see _unflatten)
            continue
        elif kind == "Mask":  # (seed, keep_below): no seed when every element is kept
            seed, keep = value  # type: ignore[misc]
            if keep < _INT32_VALUES:
                seeds.append(seed)
            flat.append(keep)
        elif kind == "Mask?":  # (seed, keep_below, scale) or None: a keep count of 2**32 stands for None
            if value is None:
                flat.append(_INT32_VALUES)
            else:
                seeds.append(value[0])  # type: ignore[index]
                flat.append(value[1])  # type: ignore[index]
        elif kind == "Mask[]":  # a list of (seed, keep_below) pairs: their keep counts
            seeds += [seed for seed, keep in value if keep < _INT32_VALUES]  # type: ignore[union-attr]
            flat.append([keep for _, keep in value])  # type: ignore[union-attr]
        elif kind == _TRAILING:  # the tensors, then which places have one
            flat += [[t for t in value if t is not None], [t is not None for t in value]]  # type: ignore[union-attr]
        else:
            flat.append(value)
    return flat, seeds


def _unflatten(parameters: Sequence[tuple[str, str]], flat: Sequence[object], seeds: Iterable[int]) -> list[object]:
    drawn, values, args = iter(seeds), iter(flat), []
    for kind, _ in parameters:
        if kind == "Seed":
            args.append(next(drawn))
        elif kind == "Blas":
            from gatedformer.kernels.blas import packed_gemm

            args.append(packed_gemm())
        elif kind == "Mask":
            keep = next(values)
            args.append((next(drawn) if keep < _INT32_VALUES else 0, keep))  # type: ignore[operator]
        elif kind == "Mask?":
            keep = next(values)
            args.append(None if keep >= _INT32_VALUES else (next(drawn), keep, _INT32_VALUES / keep))  # type: ignore[operator]
        elif kind == "Mask[]":
            args.append([(next(drawn) if keep < _INT32_VALUES else 0, keep) for keep in next(values)])  # type: ignore[attr-defined]
        elif kind == _TRAILING:
            tensors, present = iter(next(values)), next(values)  # type: ignore[call-overload]
            args += [next(tensors) if there else None for there in present]  # type: ignore[union-attr]
        else:
            args.append(next(values))
    return args


_TRAILING = "Tensor?..."
"""The kind of a function's trailing ``*tensors``, ``None`` among them: the operator takes the tensors as a list and
where they are as another (``Tensor?[]`` would do, but autograd gives a list with a ``None`` in it no gradients)."""


_REBUILT = ("Seed", "Blas", "Mask", "Mask?", "Mask[]", _TRAILING)
"""The parameter kinds whose function argument is not the operator's argument as it comes (see :func:`_unflatten`)."""

_SCHEMA_TYPES = {"Mask": "int", "Mask?": "int", "Mask[]": "int[]", "int": "SymInt"}
"""The operator's type for each parameter kind that is not one already."""


def _schema_arguments(kind: str, name: str) -> str:
    if kind == _TRAILING:
        return f"Tensor[] {name}, bool[] {name}_present"
    return f"{_SCHEMA_TYPES.get(kind, kind)} {name}"


REGISTERED: list[FunctionOperator] = []
"""Every :class:`FunctionOperator` made so far (the tests check each with :func:`torch.library.opcheck`)."""


# ---- one autograd function as two operators ----------------------------------------------------------------------

class FunctionOperator:
    """An autograd function as a forward and a backward custom operator (see the module).

    ``name``: the forward operator's (``gatedformer::name``; the backward's is ``name_backward``); ``function``: the
    :class:`torch.autograd.Function`; ``parameters``: its ``forward``'s parameters after ``ctx``, in an operator
    schema's words (``"Tensor x, Tensor? bias, float eps, str tail"``), and two more: ``Seed`` for a mask's seed and
    ``Mask`` for a ``(seed, keep_below)`` pair (``Mask?``: a ``(seed, keep_below, scale)`` triple or ``None``;
    ``Mask[]``: a list of pairs); the operator takes the seeds as one tensor after the other arguments, and a mask as
    its ``keep_below``. ``Tensor?...``, last: the function's trailing ``*tensors``, a list to the operator. ``Blas``:
    MKL's packed products (:func:`~gatedformer.kernels.blas.packed_gemm`), which the operator does not take but
    looks up where it runs. ``fake``:
    the function's outputs from its arguments (as the function takes them, seeds 0) as empty tensors, contiguous,
    as the operator returns them; ``tuple_output``: whether the function returns a tuple (else one tensor);
    ``non_differentiable``: the outputs that take no gradient (by position, or a slice of them).

    Every tensor argument (optional or not) gets the gradient the function's ``backward`` returns for it. Calling
    the object with the function's own arguments (seeds as ints, or :data:`TRACED_SEED` under ``torch.compile``) runs
    the forward operator and returns what ``function.apply`` would. It is meant for code that ``torch.compile``
    traces (eager code calls ``function.apply``: :func:`call`); outside it, it computes the same, with the
    operators' dispatch added."""

    def __init__(self, name: str, function: type[torch.autograd.Function], parameters: str,
                 fake: Callable[..., Sequence[Tensor]], *, tuple_output: bool = False,
                 non_differentiable: Sequence[int] | slice = ()) -> None:
        self.name, self.function, self.tuple_output = name, function, tuple_output
        self.non_differentiable = non_differentiable if isinstance(non_differentiable, slice) else tuple(
            non_differentiable)
        self.parameters = _parameters(parameters)
        self._fake_outputs = fake
        arguments = ", ".join(_schema_arguments(kind, name) for kind, name in self.parameters
                              if kind not in ("Seed", "Blas"))
        schema = f"({arguments}, Tensor seeds, bool[] needs) -> Tensor[]"
        self._kinds = _tensor_kinds(schema)
        self._plain = all(kind not in _REBUILT for kind, _ in self.parameters)
        self._leaf_places = self._static_leaf_places()
        self.forward_op = define(name, schema, self._forward, self._fake_forward)
        self.backward_op = define(
            f"{name}_backward",
            "(Tensor handle, Tensor?[] grads, Tensor?[] inputs, Tensor[] outputs, bool[] wanted) -> Tensor[]",
            self._backward, self._fake_backward)
        torch.library.register_autograd(f"{NAMESPACE}::{name}", self._autograd_backward,
                                        setup_context=self._setup_context, lib=_LIBRARY)
        REGISTERED.append(self)

    def operator_arguments(self, *args: object) -> list[object]:
        """The forward operator's arguments for the function's ``args`` (seeds as ints), ``needs`` left out; with
        :data:`TRACED_SEED` seeds, drawn by ``gatedformer::draw_seeds`` once its tensor arguments are computed."""
        if self.parameters[-1][0] == _TRAILING:
            fixed = len(self.parameters) - 1
            args = (*args[:fixed], args[fixed:])
        flat, seeds = _flatten(self.parameters, args)
        traced = sum(seed is TRACED_SEED for seed in seeds)
        if traced and traced != len(seeds):
            raise ValueError(f"{self.name}: seeds must be all drawn or all traced")
        if traced:
            seed_tensor = _draw_seeds_op([t for t in _leaves(self._kinds, flat) if t is not None], traced)
        else:
            seed_tensor = torch.tensor(seeds, dtype=torch.int64)
        return [*flat, seed_tensor]

    def __call__(self, *args: object) -> Tensor | tuple[Tensor, ...]:
        arguments = self.operator_arguments(*args)
        needs = [t is not None and t.requires_grad for t in _leaves(self._kinds, arguments)]
        outputs = self.forward_op(*arguments, needs)[:-1]
        return tuple(outputs) if self.tuple_output else outputs[0]

    def _function_arguments(self, args: Sequence[object], seeds: Tensor | None) -> list[object]:
        """The function's arguments from the operator's (``seeds`` ``None``: every seed 0, for the fake function)."""
        return _unflatten(self.parameters, args, itertools.repeat(0) if seeds is None else seeds.tolist())

    # -- the forward operator

    def _forward(self, *args: object) -> list[Tensor]:
        *args, seeds, needs = args
        leaves = _leaves(self._kinds, [*args, seeds])
        present = [id(t) for t in leaves if t is not None]
        if len(set(present)) < len(present):
            # one tensor in two places: each place gets a view of its own, and so a gradient of its own
            args = [_view(a) if kind == "one" else [_view(t) for t in a] if kind == "list" else a  # type: ignore[union-attr]
                    for kind, a in zip(self._kinds, args, strict=False)]
            leaves = _leaves(self._kinds, [*args, seeds])
        unpacked = list(args) if self._plain else self._function_arguments(args, seeds)
        leaf_places = self._leaf_places
        if leaf_places is None:  # tensor lists: where each tensor landed is known once they are unpacked
            places = {id(a): j for j, a in enumerate(unpacked) if isinstance(a, Tensor)}
            leaf_places = [-1 if t is None else places.get(id(t), -1) for t in leaves]
        needs_input_grad = [False] * len(unpacked)
        for place, need in zip(leaf_places, needs, strict=True):
            if need and place >= 0:
                needs_input_grad[place] = True
        context = _Context(tuple(needs_input_grad))
        result = _without_grad(self.function.forward, context, *unpacked)  # as Function.apply runs forward
        context.leaf_places = leaf_places  # type: ignore[attr-defined]
        outputs = list(result) if isinstance(result, tuple) else [result]
        return [*_fresh(outputs, leaves), _handle(context)]

    def _static_leaf_places(self) -> list[int] | None:
        """For each tensor argument of the forward operator, the function's argument it becomes (-1: the seeds),
        where that is fixed: without tensor lists, the operator takes one argument for each of the function's
        parameters but the seeds and ``Blas``, in order. ``None`` where there are tensor lists."""
        if "list" in self._kinds:
            return None
        parameter_of = [j for j, (kind, _) in enumerate(self.parameters) if kind not in ("Seed", "Blas")] + [-1]
        return [parameter_of[i] for i, kind in enumerate(self._kinds) if kind == "one"]

    def _fake_forward(self, *args: object) -> list[Tensor]:
        *args, seeds, _ = args
        return [*self._fake_outputs(*self._function_arguments(args, None)), torch.empty(1, dtype=torch.int64)]

    def _setup_context(self, ctx: Any, inputs: tuple[object, ...], output: list[Tensor]) -> None:
        leaves = _leaves(self._kinds, inputs[:-1])
        ctx.present = [t is not None for t in leaves]
        ctx.wanted = [bool(need) and t is not None for need, t in zip(inputs[-1], leaves, strict=True)]
        # autograd takes a list of tensors as many inputs (and wants a list of gradients back for it), but a list
        # with a None in it as one input that takes none
        ctx.lists = [(len(value), any(t is None for t in value)) if kind == "list" else None  # type: ignore[arg-type]
                     for kind, value in zip(self._kinds, inputs, strict=True)]
        ctx.save_for_backward(*(t for t in leaves if t is not None), *output)
        results = output[:-1]
        ctx.mark_non_differentiable(output[-1], *(results[self.non_differentiable] if isinstance(
            self.non_differentiable, slice) else (results[i] for i in self.non_differentiable)))
        ctx.set_materialize_grads(False)

    def _autograd_backward(self, ctx: Any, grads: list[Tensor | None]) -> tuple[object, ...]:
        saved = list(ctx.saved_tensors)
        count = sum(ctx.present)
        kept, outputs = iter(saved[:count]), saved[count:]
        leaves = [next(kept) if there else None for there in ctx.present]
        computed = iter(self.backward_op(outputs[-1], list(grads[:-1]), leaves, outputs[:-1], ctx.wanted)
                        if any(ctx.wanted) else [])
        flat = iter([next(computed) if want else None for want in ctx.wanted])
        returned: list[object] = []  # one entry for each of the forward operator's arguments
        for kind, listed in zip(self._kinds, ctx.lists, strict=True):
            if kind == "one":
                returned.append(next(flat))
            elif kind == "list":
                length, has_none = listed
                of_list = [next(flat) for _ in range(length)]
                returned.append(None if has_none else of_list)
            else:
                returned.append(None)
        return tuple(returned)

    # -- the backward operator

    def _backward(self, handle: Tensor, grads: list[Tensor | None], inputs: list[Tensor | None],
                  outputs: list[Tensor], wanted: list[bool]) -> list[Tensor]:
        context = _kept_context(handle)
        if context.materialize_grads:
            grads = [torch.zeros_like(o) if g is None else g for g, o in zip(grads, outputs, strict=True)]
        result = _without_grad(self.function.backward, context, *grads)
        result = result if isinstance(result, tuple) else (result,)
        out, like = [], []
        for place, want, reference in zip(context.leaf_places, wanted, inputs, strict=True):  # type: ignore[attr-defined]
            if want:
                grad = result[place] if place >= 0 else None
                out.append(torch.zeros_like(reference) if grad is None else grad)
                like.append(reference)
        return _fresh(out, [*grads, *inputs, *outputs], like)

    def _fake_backward(self, handle: Tensor, grads: list[Tensor | None], inputs: list[Tensor | None],
                       outputs: list[Tensor], wanted: list[bool]) -> list[Tensor]:
        return [torch.empty_like(t) for t, w in zip(inputs, wanted, strict=True) if w]


def call(operator: FunctionOperator, *args: object) -> Tensor | tuple[Tensor, ...]:
    """``operator.function.apply(*args)`` in eager code, the operator under ``torch.compile``: the eager numbers and
    speed stay those of the autograd function, and a compiled graph keeps the fused path as one node each way."""
    if torch.compiler.is_compiling():
        return operator(*args)
    return operator.function.apply(*args)
