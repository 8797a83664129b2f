"""Models built without memory: under ``tiered``, building a model (``configure_model``,
``trainer.init_module()``) records how each parameter's value is made instead of keeping it, and
each value is computed later straight into the parameter's home, one parameter at a time
(docs/architecture.md, "Construction"). A model whose parameters do not fit in host memory can so
be built and placed.

The record is exact. A parameter made by a factory (``torch.empty``, ``torch.ones``, ...) and
registered in a module gives up its memory at registration and points at a placeholder; every
in-place operation on it (``reset_parameters``, ``nn.init.normal_``, a Hugging Face
``_init_weights``, ``weight[padding_idx].zero_()``, the user's own initialisation) is recorded with
the random generator's state before it, and still run once on a scratch tensor so that the
generator advances exactly as in plain construction. Replaying the record later, with those
generator states, gives bit for bit the values plain construction would have given, while
everything else drawn from the generator (dropout, data order) is unchanged. This is deferred
initialisation as in torchdistx's ``deferred_init``, restricted to what models do to parameters
while they are built.

Anything else that reads a parameter's values (a forward pass during construction, ``clone``,
copying one parameter into another) materializes that parameter first, by the same replay: exact,
at the cost of its memory. So does any read after construction, through the parameter's class
(as for parameters away on NVMe, ``runtime/params/offloaded.py``).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.multiprocessing.reductions import StorageWeakRef

from ..runtime.params.offloaded import OffloadedParameter, _reads_no_values, mark_offloaded, mark_present
from ..runtime.state import nan_placeholder

# Factories whose result may become a parameter; the random ones consume the generator.
_FACTORIES = frozenset({"empty", "zeros", "ones", "full", "rand", "randn", "normal", "randint", "empty_strided"})
_RANDOM_FACTORIES = frozenset({"rand", "randn", "normal", "randint"})
# In-place operations that draw nothing from the generator: replayed without a scratch run.
_DETERMINISTIC_WRITES = frozenset({
    "copy_", "zero_", "fill_", "zeros_", "ones_", "constant_", "eye_", "dirac_", "__setitem__", "mul_", "add_",
    "sub_", "div_", "clamp_", "fill_diagonal_", "masked_fill_", "index_fill_", "__imul__", "__iadd__", "__isub__",
    "__itruediv__",
})
# New tensors that take only the shape, dtype and device of a parameter
_FROM_METADATA = frozenset({
    "new_tensor", "new_empty", "new_zeros", "new_ones", "new_full", "empty_like", "zeros_like", "ones_like", "full_like",
    "rand_like", "randn_like", "randint_like",
})
_ALIASES = frozenset({"detach"})  # same values, same storage: tracked as the parameter itself


def _name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        return f"{getattr(getattr(func, '__self__', None), '__name__', '?')}.{name}"
    return name


def _writes_in_place(name: str) -> bool:
    if name in ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__"):
        return True
    return name.endswith("_") and not name.startswith("_") and name != "requires_grad_"


@dataclass
class _Step:
    """One recorded operation: ``func(view, *args, **kwargs)`` where ``view`` is the parameter
    seen through ``chain`` (the view operations between the parameter and the written tensor)."""

    func: Any
    args: tuple
    kwargs: dict
    chain: tuple = ()
    rng: Optional[torch.Tensor] = None  # the state before it of the default generator of the device it draws on
    generators: tuple = ()  # (generator, state) for generators passed explicitly
    draws_on: torch.device = torch.device("cpu")


@dataclass
class Recipe:
    """How one parameter's value is made: a factory, then in-place steps; or read from a file."""

    shape: torch.Size
    dtype: torch.dtype
    create: Optional[_Step] = None  # None: torch.empty
    steps: list[_Step] = field(default_factory=list)
    source: Optional[Callable[[], torch.Tensor]] = None  # a loaded weight, read when needed
    # where plain construction would have made it: on a GPU root, Lightning builds under
    # ``torch.device("cuda")``, so initialisation draws from the GPU's generator, with its kernels
    device: torch.device = torch.device("cpu")

    def compute_into(self, target: torch.Tensor) -> None:
        """Write the value into ``target`` (any device and dtype; converted as ``copy_`` does)."""
        if self.source is not None:
            target.copy_(self.source())
            return
        direct = target.device == self.device and target.dtype == self.dtype and target.is_contiguous()
        value = target if direct else torch.empty(self.shape, dtype=self.dtype, device=self.device)
        with _generator_kept(self.device):
            if self.create is not None:
                value.copy_(_replay(self.create, None))
            for step in self.steps:
                _replay(step, _through(value, step.chain))
        if not direct:
            target.copy_(value)


def _rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.random.get_rng_state()


def _set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.random.set_rng_state(state)


@contextlib.contextmanager
def _generator_kept(device: torch.device) -> Iterator[None]:
    """A replay sets the generators back to each recorded state; afterwards they are where they were."""
    devices = [_HOST] if device.type == "cpu" else [_HOST, device]
    saved = [_rng_state(d) for d in devices]
    try:
        yield
    finally:
        for d, state in zip(devices, saved):
            _set_rng_state(d, state)


def _replay(step: _Step, view: Optional[torch.Tensor]) -> Any:
    if step.rng is not None:
        _set_rng_state(step.draws_on, step.rng)
    for generator, state in step.generators:
        generator.set_state(state)
    with torch._C.DisableTorchFunctionSubclass():
        return step.func(*step.args, **step.kwargs) if view is None else step.func(view, *step.args, **step.kwargs)


def _through(tensor: torch.Tensor, chain: tuple) -> torch.Tensor:
    for func, args, kwargs in chain:
        tensor = func(tensor, *args, **kwargs)
    return tensor


_HOST = torch.device("cpu")


class DeferredParameter(OffloadedParameter):
    """The class of a parameter whose value is recorded, not held: any read computes it first
    (``lend``). Moving it where and as it already is (``module.to(device)``, a precision's
    ``convert_module``) changes nothing and computes nothing."""

    registry: "DeferredParameters"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        name = _name(func)
        if name in ("to", "cpu") and args and isinstance(args[0], DeferredParameter):
            with torch._C.DisableTorchFunctionSubclass():
                moved = func(*args, **(kwargs or {}))  # the placeholder: host memory, the parameter's dtype
            if moved is args[0]:
                return moved
        if name == "data.__set__" and len(args) == 2 and args[1] is args[0]:
            return None
        return super().__torch_function__(func, types, args, kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """A pickle (``torch.save`` of the module) holds a plain ``nn.Parameter`` with the value,
        computed or read for the pickle alone: this parameter stays deferred (one left on NVMe
        after training is not brought into memory), and the pickle loads where this package was
        never imported."""
        registry = type(self).registry
        if self not in registry:
            return super().__reduce_ex__(protocol)
        value = registry.value(self)
        state = torch._utils._get_obj_state(self)  # attributes set on the parameter, as nn.Parameter pickles them
        if not state:
            return (torch._utils._rebuild_parameter, (value, self.requires_grad, OrderedDict()))
        return (torch._utils._rebuild_parameter_with_state, (value, self.requires_grad, OrderedDict(), state))


class DeferredParameters:
    """The parameters of one strategy's models whose values are recorded, not held."""

    def __init__(self) -> None:
        self.recipes: dict[int, Recipe] = {}
        self.params: dict[int, nn.Parameter] = {}
        self.twins: dict[int, torch.Tensor] = {}  # id(param) -> a meta tensor standing for its values
        self.parameter_class: type[DeferredParameter] = type(
            "DeferredParameter", (DeferredParameter,), {"lend": staticmethod(self._lend), "names": {}, "registry": self},
        )
        self._recording = False

    def __len__(self) -> int:
        return len(self.recipes)

    def __contains__(self, p: object) -> bool:
        return id(p) in self.recipes

    def deferred_bytes(self) -> int:
        return sum(r.shape.numel() * r.dtype.itemsize for r in self.recipes.values())

    @contextlib.contextmanager
    def recording(self, draw: torch.device = _HOST) -> Iterator[None]:
        """Parameters registered inside are deferred (see the module docstring). ``draw``: the device
        plain construction would build on, whose generator and kernels initialisation uses."""
        if self._recording:
            yield
            return
        recorder = _Recorder(self, draw)
        original = nn.Module.register_parameter

        def register_parameter(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
            original(module, name, param)
            if param is not None:
                recorder.defer(param, name)

        self._recording = True
        nn.Module.register_parameter = register_parameter  # type: ignore[method-assign, assignment]  # on the class while recording
        try:
            with recorder:
                yield
        finally:
            nn.Module.register_parameter = original  # type: ignore[method-assign]  # put back
            self._recording = False

    def adopt(self, model: nn.Module) -> None:
        """The model is whole: full names for messages, and parameters it no longer holds (an
        output layer's own weight before it was tied to the embedding) forgotten."""
        held = set()
        for name, p in model.named_parameters(remove_duplicate=True):
            if id(p) in self.recipes:
                self.parameter_class.names[id(p)] = name
                held.add(id(p))
        for key in [k for k in self.recipes if k not in held]:
            self._forget(self.params[key])

    def fill(self, p: torch.Tensor, target: torch.Tensor) -> bool:
        """Compute a deferred parameter's value into ``target`` (its home); False if ``p`` holds its value."""
        recipe = self.recipes.get(id(p))
        if recipe is None:
            return False
        recipe.compute_into(target)
        self._forget(p)
        return True

    def written_elsewhere(self, p: torch.Tensor) -> bool:
        """Another process writes a deferred parameter's value into the home it is bound to (the
        host homes a machine's ranks share: its first rank writes them): nothing is computed or
        read for it here, and it is no longer deferred; False if ``p`` holds its value. Left
        deferred, ``materialize_all`` would give it a tensor of its own, off its home."""
        if id(p) not in self.recipes:
            return False
        self._forget(p)
        return True

    def defer_read(self, p: nn.Parameter, name: str, read: Callable[[], torch.Tensor]) -> None:
        """``p`` (holding a value of its own, or a placeholder) gives up its memory: its value is read
        by ``read`` when needed."""
        with torch.no_grad():
            p.data = nan_placeholder(p, _HOST)
        self.recipes[id(p)] = Recipe(p.shape, p.dtype, source=read)
        self.params[id(p)] = p
        mark_offloaded(p, self.parameter_class, name)

    def set_source(self, p: torch.Tensor, read: Callable[[], torch.Tensor]) -> None:
        """The parameter's value is read by ``read`` when needed, instead of computed."""
        self.recipes[id(p)].source = read

    @torch.no_grad()
    def value(self, p: torch.Tensor, device: Optional[torch.device] = None) -> torch.Tensor:
        """A deferred parameter's value in a new tensor; the parameter stays deferred."""
        recipe = self.recipes[id(p)]
        value = torch.empty(recipe.shape, dtype=recipe.dtype, device=device)
        recipe.compute_into(value)
        return value

    @torch.no_grad()
    def materialize(self, p: torch.Tensor, device: Optional[torch.device] = None) -> None:
        """The parameter holds its value in a tensor of its own again."""
        value = self.value(p, device)
        mark_present(p)
        p.data = value
        self._forget(p)

    def materialize_all(self, device: Optional[torch.device] = None) -> None:
        for p in list(self.params.values()):
            self.materialize(p, device)

    def _lend(self, p: torch.Tensor, hands_out: bool = False) -> bool:
        if id(p) not in self.recipes:
            return False
        self.materialize(p)
        return True

    def _forget(self, p: torch.Tensor) -> None:
        self.recipes.pop(id(p), None)
        self.params.pop(id(p), None)
        self.twins.pop(id(p), None)
        self.parameter_class.names.pop(id(p), None)

    def twin(self, p: torch.Tensor) -> torch.Tensor:
        if id(p) not in self.twins:
            recipe = self.recipes[id(p)]
            self.twins[id(p)] = torch.empty(recipe.shape, dtype=recipe.dtype, device="meta")
        return self.twins[id(p)]


@dataclass
class _Creation:
    step: _Step
    storage: StorageWeakRef  # the memory it made, while alive (an address alone may be reused)
    shape: torch.Size
    dtype: torch.dtype
    version: int


class _Recorder(TorchFunctionMode):
    """Sees every torch call while a model is built: notes what factories made, records writes
    to deferred parameters, tracks views of them, and materializes any that are read."""

    def __init__(self, registry: DeferredParameters, draw: torch.device = _HOST) -> None:
        super().__init__()
        self.registry = registry
        self.draw = draw
        self.creations: dict[int, _Creation] = {}  # data_ptr -> how that tensor was made
        self.views: dict[int, tuple[torch.Tensor, torch.Tensor, tuple]] = {}  # id(meta view) -> (view, param, chain)
        self.scratch = torch.empty(0, dtype=torch.uint8, device=draw)

    def __exit__(self, *exc: Any) -> Any:
        self.creations.clear()
        self.views.clear()
        self.scratch = torch.empty(0, dtype=torch.uint8, device=self.draw)
        return super().__exit__(*exc)

    # -- parameters registered ----------------------------------------------------------------------

    def defer(self, param: nn.Parameter, name: str) -> None:
        registry = self.registry
        if type(param) is not nn.Parameter or param.device.type != "cpu" or param.numel() == 0 or id(param) in registry.recipes:
            return
        creation = self.creations.pop(param.data_ptr(), None)
        # a factory's own result, unchanged since: otherwise its value is kept as it is
        if creation is None or creation.storage.expired() or creation.storage != StorageWeakRef(param.untyped_storage()):
            return
        if (creation.shape, creation.dtype, creation.version) != (param.shape, param.dtype, param._version):
            return
        create = None if creation.step.func is torch.empty else creation.step
        recipe = Recipe(param.shape, param.dtype, create, device=self.draw)
        with torch.no_grad():
            param.data = nan_placeholder(param, _HOST)  # its memory goes, before it is tracked
        registry.recipes[id(param)] = recipe
        registry.params[id(param)] = param
        mark_offloaded(param, registry.parameter_class, name)

    # -- every torch call ---------------------------------------------------------------------------

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = dict(kwargs or {})
        if not args and isinstance(kwargs.get("tensor"), torch.Tensor):
            args = (kwargs.pop("tensor"),)  # torch.nn.init hands its tensor by keyword
        tracked = [t for t in tree_flatten((args, kwargs))[0] if self._root(t) is not None]
        if not tracked:
            return self._untracked(func, args, kwargs)
        name = _name(func)
        if _reads_no_values(func):
            with torch._C.DisableTorchFunctionSubclass():  # placeholders and meta views carry the metadata
                return func(*args, **kwargs)
        if name in _FROM_METADATA:
            stand_in = tree_map(lambda a: nan_placeholder(a, _HOST) if self._root(a) is not None else a, (args, kwargs))
            return func(*stand_in[0], **stand_in[1])
        if args and _writes_in_place(name) and self._root(args[0]) is not None and len(tracked) == 1:
            self._record(func, args, kwargs)
            return args[0]
        if name == "data.__set__":
            return self._set_data(func, args)
        view = self._view(func, name, args, kwargs)
        if view is not None:
            return view
        return self._read(func, args, kwargs)

    def _untracked(self, func: Any, args: tuple, kwargs: dict) -> Any:
        name = getattr(func, "__name__", "")
        factory = name in _FACTORIES and getattr(func, "__module__", "") == "torch"
        random = factory and name in _RANDOM_FACTORIES
        draws_on = _HOST
        if random and self.draw.type != "cpu" and "device" not in kwargs and "generator" not in kwargs:
            # drawn where plain construction draws, kept in host memory like every other factory's result
            kwargs, draws_on = {**kwargs, "device": self.draw}, self.draw
        rng = _rng_state(draws_on) if random else None
        out = func(*args, **kwargs)
        if draws_on.type != "cpu":
            out = out.cpu()
        if factory and isinstance(out, torch.Tensor) and out.device.type == "cpu" and out.numel() > 0:
            step = _Step(func, args, kwargs, rng=rng, generators=_generator_states(kwargs), draws_on=draws_on)
            self.creations[out.data_ptr()] = _Creation(step, StorageWeakRef(out.untyped_storage()), out.shape, out.dtype, out._version)
        return out

    def _root(self, t: Any) -> Optional[torch.Tensor]:
        """The deferred parameter ``t`` is, or is a view of."""
        if not isinstance(t, torch.Tensor):
            return None
        if id(t) in self.registry.recipes and self.registry.params.get(id(t)) is t:
            return t
        view = self.views.get(id(t))
        return view[1] if view is not None and view[0] is t and id(view[1]) in self.registry.recipes else None

    def _chain(self, t: torch.Tensor) -> tuple:
        view = self.views.get(id(t))
        return view[2] if view is not None and view[0] is t else ()

    def _record(self, func: Any, args: tuple, kwargs: dict) -> None:
        target = args[0]
        root = self._root(target)
        chain = self._chain(target)
        name = _name(func)
        rng = None if name in _DETERMINISTIC_WRITES else _rng_state(self.draw)
        recipe = self.registry.recipes[id(root)]
        recipe.steps.append(_Step(func, tuple(args[1:]), dict(kwargs), chain, rng, _generator_states(kwargs), self.draw))
        if rng is not None:  # draw from the generator exactly as plain construction does
            with torch._C.DisableTorchFunctionSubclass():
                func(_through(self._scratch(recipe.shape, recipe.dtype), chain), *args[1:], **kwargs)

    def _scratch(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """One buffer for every scratch run, grown to the largest parameter: allocating one per
        parameter leaves freed blocks in the allocator's arenas (docs/benchmarks.md)."""
        nbytes = shape.numel() * dtype.itemsize
        if self.scratch.numel() < nbytes:
            self.scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.draw)
        return self.scratch[:nbytes].view(dtype).view(shape)

    def _set_data(self, func: Any, args: tuple) -> Any:
        param: torch.Tensor
        param, value = args
        root = self._root(param)
        if root is param and self._root(value) is param and not self._chain(value):
            return None  # its own values, unchanged
        if root is param and self._root(value) is None:
            self.registry._forget(param)  # given a value of its own
            mark_present(param)
            with torch._C.DisableTorchFunctionSubclass():
                return func(param, value)
        return self._read(func, args, {})

    def _view(self, func: Any, name: str, args: tuple, kwargs: dict) -> Any:
        """A view (or the values themselves) of one deferred parameter: a meta tensor that stands
        for it, writes through which are recorded on the parameter."""
        root = self._root(args[0]) if args else None
        if root is None or len([a for a in tree_flatten((args[1:], kwargs))[0] if self._root(a) is not None]):
            return None
        source = args[0]
        chain = self._chain(source)
        if name in ("data.__get__", *_ALIASES):
            return self._track(self.registry.twin(root) if not chain else source, root, chain)
        base = self.registry.twin(root) if source is root else source
        try:
            with torch._C.DisableTorchFunctionSubclass():
                out = func(base, *args[1:], **kwargs)
        except (NotImplementedError, RuntimeError, TypeError, ValueError):
            return None
        outs = out if isinstance(out, (tuple, list)) else (out,)
        twin = self.registry.twin(root)
        if not outs or not all(isinstance(o, torch.Tensor) and o.is_meta and o._is_view() and o._base is twin for o in outs):
            return None
        if isinstance(out, torch.Tensor):
            return self._track(out, root, chain + ((func, tuple(args[1:]), dict(kwargs)),))
        return type(out)(self._track(o, root, chain + ((_pick(func, k), tuple(args[1:]), dict(kwargs)),)) for k, o in enumerate(outs))

    def _track(self, view: torch.Tensor, root: torch.Tensor, chain: tuple) -> torch.Tensor:
        self.views[id(view)] = (view, root, chain)
        return view

    def _read(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Values are read: every deferred parameter involved is materialized, exactly."""
        roots = {id(r): r for t in tree_flatten((args, kwargs))[0] if (r := self._root(t)) is not None}
        real = {}
        for t in tree_flatten((args, kwargs))[0]:
            root = self._root(t)
            if root is not None and t is not root:
                real[id(t)] = (root, self._chain(t))
        for root in roots.values():
            self.registry.materialize(root)

        def substitute(a: Any) -> Any:
            if isinstance(a, torch.Tensor) and id(a) in real:
                root, chain = real[id(a)]
                return _through(root.data, chain)
            return a

        return func(*tree_map(substitute, args), **tree_map(substitute, kwargs))


def _pick(func: Any, k: int) -> Any:
    """The ``k``-th output of a view function that returns several (``split``, ``unbind``)."""
    return lambda t, *a, **kw: func(t, *a, **kw)[k]


def _generator_states(kwargs: dict) -> tuple:
    generator = kwargs.get("generator")
    return ((generator, generator.get_state()),) if isinstance(generator, torch.Generator) else ()
