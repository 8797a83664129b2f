"""Parameters whose values are away on NVMe, read from outside the step.

Between its uses a unit at home on NVMe points its parameters at placeholders: right shape, dtype
and device, no memory. So that a callback reading one (a weight-norm logger iterating
``named_parameters()``, an EMA, ``BaseFinetuning`` comparing parameters with ``torch.equal``)
never computes with a placeholder, a parameter's class is :class:`OffloadedParameter` while it
points at one. Any operation that reads its values first asks the engine to lend the unit: between
steps the unit is read into host memory, where what the caller writes is kept and goes home at the
next step, so the caller sees and changes exactly what plain training would. Where no lending is
possible (inside a step, for a unit the step is not using) the operation raises
:class:`OffloadedParameterError`, naming the parameter and what to do. Metadata (shape, dtype,
``requires_grad``, ``.grad``) stays readable without lending, and ``requires_grad_`` works.

Swapping the class only while a placeholder is bound keeps the compute path free of any Python
dispatch: a resident parameter is a plain ``nn.Parameter``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

# Operations that read no values: what Lightning, optimizers and the engine ask of any parameter.
_METADATA_CALLS = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "element_size", "stride", "is_contiguous",
    "is_floating_point", "is_complex", "get_device", "requires_grad_", "register_hook",
    "register_post_accumulate_grad_hook", "__hash__", "__format__", "_is_view", "is_shared", "is_pinned",
    "untyped_storage", "data_ptr", "storage_offset",  # addresses, used to tell tensors apart
    "_has_compatible_shallow_copy_type",  # module.to() asks before rebinding .data
})
_METADATA_ATTRIBUTES = frozenset({
    "shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "ndim", "layout", "names", "grad_fn",
    "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_nested", "is_mps", "is_xla", "itemsize",
    "nbytes", "_version", "_backward_hooks", "_post_accumulate_grad_hooks", "retains_grad", "_base",
})


class OffloadedParameterError(RuntimeError):
    """A parameter's value was read while it is away on NVMe."""


class OffloadedParameter(nn.Parameter):
    """The class of a parameter while its unit is away on NVMe (see the module docstring). Each
    engine makes its own subclass (:func:`offloaded_class`), which knows how to lend and the
    parameters' names, so that nothing of the engine lands in a parameter's ``__dict__`` (which
    copies and pickles of the module would carry)."""

    lend: Callable[[torch.Tensor, bool], bool] = staticmethod(lambda p, hands_out: False)
    names: dict[int, str] = {}

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "__repr__" and isinstance(args[0], OffloadedParameter) and not cls.lend(args[0], False):
            return f"OffloadedParameter({cls.names.get(id(args[0]))}, shape={tuple(args[0].shape)}, dtype={args[0].dtype}: at home on NVMe)"
        if not _reads_no_values(func):
            hands_out = _hands_out_memory(func)
            for p in _offloaded_in((*args, *kwargs.values())):
                if isinstance(p, OffloadedParameter) and not type(p).lend(p, hands_out):
                    raise OffloadedParameterError(_message(func, type(p).names.get(id(p), "?")))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        self.data  # noqa: B018 -- lends the unit (or raises): the copy holds the true value
        return self.__deepcopy__(memo)


def offloaded_class(lend: Callable[[torch.Tensor, bool], bool]) -> type[OffloadedParameter]:
    """The class an engine gives parameters at placeholders; ``lend(p, hands_out)`` gives ``p`` its
    true value, or says it cannot (``hands_out``: the caller gets the value's memory as a tensor
    with its own version counter, ``p.data``, so its writes leave no trace on ``p``)."""
    return type("OffloadedParameter", (OffloadedParameter,), {"lend": staticmethod(lend), "names": {}})


def mark_offloaded(p: torch.Tensor, cls: type[OffloadedParameter], name: str) -> None:
    """``p`` now points at a placeholder."""
    if type(p) is nn.Parameter:
        cls.names[id(p)] = name
        p.__class__ = cls


def mark_present(p: torch.Tensor) -> None:
    """``p`` holds its true value again."""
    if isinstance(p, OffloadedParameter):
        p.__class__ = nn.Parameter  # type: ignore[assignment]  # the class swapped back is what marks it present


def _reads_no_values(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        owner = getattr(func, "__self__", None)
        attribute = getattr(owner, "__name__", "")
        # `.grad` is its own tensor; `.data` and everything else would hand out the placeholder
        return attribute in _METADATA_ATTRIBUTES or (name == "__set__" and attribute in ("grad", "requires_grad"))
    return name in _METADATA_CALLS


def _hands_out_memory(func: Any) -> bool:
    return getattr(func, "__name__", "") == "__get__" and getattr(getattr(func, "__self__", None), "__name__", "") == "data"


def _offloaded_in(values: tuple) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, OffloadedParameter):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(_offloaded_in(tuple(value)))
    return found


def _message(func: Any, name: str) -> str:
    what = getattr(func, "__name__", str(func))
    if what in ("__get__", "__set__"):
        what = f"{'reading' if what == '__get__' else 'writing'} .{getattr(getattr(func, '__self__', None), '__name__', '?')}"
    return (
        f"{what} on parameter {name!r}: its unit is at home on NVMe and nothing can fetch it now (the strategy's "
        f"engine is closed, after a failed set-up or read-back), so the parameter holds no value in memory. Read "
        f"parameters while the strategy runs (between steps they hold their true values), or inside "
        f"`with trainer.strategy.gathered_parameters(writeback=...):`."
    )
