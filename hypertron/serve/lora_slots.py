"""Many LoRA adapters served in one batch: their weights stacked in device memory, a slot each.

:class:`LoraSlots` holds ``max_loras`` slots. Each adapted projection (the union of the targets
the server was started with, or all seven of a layer) keeps every slot's ``A [N, *in, R]`` and
``B [N, R, *out]`` side by side, ranks padded to ``max_lora_rank`` with zeros (exact: the padding
adds nothing), and each slot its scale (``alpha / r``; 0 for an empty slot). :meth:`attach` hands
the engine its weights wrapped as :class:`~hypertron.quant.lora.StackedLoraWeight`; each step
names its tokens' slots, and the einsum hook adds each token's adapter (the one-hot stacked
product of :func:`hypertron.quant.lora.stacked_delta`). Loading or unloading changes arrays of
the same shapes: nothing recompiles.

A request takes its adapter's slot by name (:meth:`acquire`) and gives it back when it ends
(:meth:`release`). Unloading an adapter that requests still use retires its slot: its name is
free at once, the slot only when the last of them ends, so running requests keep their adapter.
Each load has its own ``key`` (name and load count): the prefix cache's pages of one adapter are
never another's, nor those of an adapter loaded again under the same name.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading

import jax
import jax.numpy as jnp
import numpy as np

from hypertron.config import EngineConfig, ModelConfig
from hypertron.errors import ConfigError
from hypertron.models import resolve_dtype
from hypertron.models.lora import ALL_LINEAR, LoraSettings, load_peft, peft_config, peft_modules, targets
from hypertron.quant.lora import StackedLoraWeight
from hypertron.serve.types import LoraError


@dataclasses.dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    slot: int
    rank: int
    key: str  # what the prefix cache keys its pages by


class LoraSlots:
    """``max_loras`` adapter slots of rank up to ``max_lora_rank`` for a model of ``cfg`` (see the
    module docstring); ``modules``: the projections adapters may target (PEFT names)."""

    def __init__(self, cfg: ModelConfig, max_loras: int, max_lora_rank: int, modules=ALL_LINEAR, dtype=jnp.float32):
        if max_loras <= 0 or max_lora_rank <= 0:
            raise ConfigError(f"--max-loras={max_loras}, --max-lora-rank={max_lora_rank}: both must be positive")
        self.cfg, self.max_loras, self.max_rank = cfg, max_loras, max_lora_rank
        self.targets = targets(cfg, tuple(modules))
        self.modules = frozenset(t.module for t in self.targets)
        n, r = max_loras, max_lora_rank
        # Per target, per stacking index (a layer): A and B of every slot.
        self._a = {t.path: [jnp.zeros((n, *t.ins, r), dtype) for _ in np.ndindex(*t.stack)] for t in self.targets}
        self._b = {t.path: [jnp.zeros((n, r, *t.outs), dtype) for _ in np.ndindex(*t.stack)] for t in self.targets}
        self._scales = jnp.zeros(n, jnp.float32)
        self._lock = threading.Lock()
        self._adapters: dict[str, Adapter] = {}
        self._loading: set[str] = set()  # names being loaded
        self._writing = threading.Lock()  # one load writes the stacks at a time (each write replaces them)
        self._free = list(range(n))
        self._users: collections.Counter[int] = collections.Counter()
        self._retired: set[int] = set()
        self._loads = itertools.count(1)
        self.version = 0  # bumped by every change of the arrays: the engine attaches them again

    # -- what is loaded -----------------------------------------------------------------------

    def adapters(self) -> list[Adapter]:
        with self._lock:
            return list(self._adapters.values())

    def load(self, name: str, path: str) -> Adapter:
        """Load the PEFT adapter at ``path`` as ``name`` into a free slot (a :class:`LoraError`
        naming the problem otherwise: the name taken, no slot free, a rank above the limit, a
        module the slots lack, or an adapter this model cannot take)."""
        if not name or not isinstance(name, str):
            raise LoraError("lora_name must be a non-empty string", param="lora_name")
        try:
            adapters, settings = load_peft(path, self.cfg)
        except ConfigError as e:
            raise LoraError(str(e), param="lora_path") from None
        if settings.rank > self.max_rank:
            raise LoraError(f"adapter {name!r} has rank {settings.rank}, above --max-lora-rank={self.max_rank}",
                            param="lora_path")
        extra = {t.module for t in targets(self.cfg, settings.targets)} - self.modules
        if extra:
            raise LoraError(f"adapter {name!r} adapts {', '.join(sorted(extra))}, which this server's adapters do not "
                            f"(they cover {', '.join(sorted(self.modules))}: the modules of --lora-modules at start)",
                            param="lora_path")
        with self._lock:
            if name in self._adapters or name in self._loading:
                raise LoraError(f"an adapter named {name!r} is loaded already", param="lora_name")
            if not self._free:
                raise LoraError(f"{self.max_loras} adapters are loaded (--max-loras={self.max_loras}); unload one "
                                "first", param="lora_name")
            slot = self._free.pop(0)
            self._loading.add(name)
        try:
            with self._writing:
                self._write(slot, adapters, settings)
        except BaseException:
            with self._lock:
                self._free.insert(0, slot)
                self._loading.discard(name)
            raise
        adapter = Adapter(name, str(path), slot, settings.rank, f"{name}#{next(self._loads)}")
        with self._lock:
            self._adapters[name] = adapter
            self._loading.discard(name)
        return adapter

    def unload(self, name: str) -> None:
        """Unload ``name`` (a 404 :class:`LoraError` if none is loaded): its slot goes at once, or
        when the last request using it ends."""
        with self._lock:
            adapter = self._adapters.pop(name, None)
            if adapter is None:
                raise LoraError(f"no adapter named {name!r} is loaded", status=404, param="lora_name")
            if self._users[adapter.slot]:
                self._retired.add(adapter.slot)
            else:
                self._free.append(adapter.slot)

    def acquire(self, name: str) -> Adapter:
        """``name``'s adapter, held for a request until :meth:`release` (a 404 if none is loaded)."""
        with self._lock:
            adapter = self._adapters.get(name)
            if adapter is None:
                raise LoraError(f"no adapter named {name!r} is loaded", status=404, param="model")
            self._users[adapter.slot] += 1
            return adapter

    def release(self, slot: int) -> None:
        with self._lock:
            self._users[slot] -= 1
            if not self._users[slot] and slot in self._retired:
                self._retired.discard(slot)
                self._free.append(slot)

    # -- the weights ----------------------------------------------------------------------------

    def attach(self, params: dict) -> dict:
        """``params`` (the engine's, layers unrolled or stacked) with each adapted weight wrapped
        as :class:`StackedLoraWeight` over every slot."""
        params = dict(params)
        for t in self.targets:
            if t.stack and not isinstance(params[t.path[0]], (list, tuple)):
                raise ConfigError("LoRA serving runs the layers unrolled (the engine's default)")
            for k, index in enumerate(np.ndindex(*t.stack)):
                node = params
                keys = (t.path[0], *index, *t.path[1:]) if t.stack else t.path
                for key in keys[:-1]:  # copy the way down: the engine's tree is not changed
                    child = node[key]
                    child = list(child) if isinstance(child, (list, tuple)) else dict(child)
                    node[key] = child
                    node = child
                node[keys[-1]] = StackedLoraWeight(node[keys[-1]], self._a[t.path][k], self._b[t.path][k],
                                                   self._scales)
        return params

    def _write(self, slot: int, adapters: dict, settings: LoraSettings) -> None:
        """Slot ``slot`` := ``adapters`` (every target of the slots: zeros where it has none)."""
        r = settings.rank
        for t in self.targets:
            node = adapters
            for key in t.path:
                node = node.get(key) if isinstance(node, dict) else None
                if node is None:
                    break
            for k, index in enumerate(np.ndindex(*t.stack)):
                a = np.zeros((*t.ins, self.max_rank), np.float32)
                b = np.zeros((self.max_rank, *t.outs), np.float32)
                if node is not None:
                    a[..., :r] = np.asarray(node["a"])[index]
                    b[:r] = np.asarray(node["b"])[index]
                self._a[t.path][k] = _put(self._a[t.path][k], slot, a)
                self._b[t.path][k] = _put(self._b[t.path][k], slot, b)
        self._scales = self._scales.at[slot].set(settings.scale)
        self.version += 1


def slots_for(cfg: ModelConfig, config: EngineConfig, adapters=()) -> LoraSlots | None:
    """The engine's LoRA slots (None without ``config.enable_lora``) holding ``adapters``
    (``(name, path)`` pairs), over the modules they adapt (all seven of a layer if none are given):
    a :class:`ConfigError` naming the adapter that cannot be loaded."""
    if not config.enable_lora:
        return None
    modules = set()
    for name, path in adapters:
        try:
            modules |= set(peft_modules(peft_config(path), path))
        except ConfigError as e:
            raise ConfigError(f"--lora-modules {name}={path}: {e}") from None
    slots = LoraSlots(cfg, config.max_loras, config.max_lora_rank, tuple(modules) or ALL_LINEAR,
                      dtype=resolve_dtype(cfg.dtype))
    for name, path in adapters:
        try:
            slots.load(name, path)
        except LoraError as e:
            raise ConfigError(f"--lora-modules {name}={path}: {e}") from None
    return slots


@jax.jit
def _put(stack: jax.Array, slot, value) -> jax.Array:
    return stack.at[slot].set(value.astype(stack.dtype))
