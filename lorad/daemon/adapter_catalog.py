"""The adapters the coordinator serves by name, as they change while serving.

Each registered version has its own registry id (never reused) and identity key. A load validates
the folder here first (the same refusals as at start, as ApiErrors naming the field and file),
then registers it on every rank (EngineClient.load_adapter: all ranks or none). A reload puts a
new version under the name; requests that chose the old one finish on it, and the old version is
unloaded on the workers once its last request ended. An unload removes the name at once and
answers once its last request ended. Requests hold their version (`hold`) from the moment they
choose it, so no Admit ever names an unloaded id. With --adapter-dir, a name's first request
loads DIR/NAME this way.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lorad.config import ConfigError, ModelConfig
from lorad.config.adapter_capacity import LoraCapacity
from lorad.config.adapters import ADAPTER_NAME, AdapterSpec, read_adapter
from lorad.daemon.engine_client import AdapterLoadError, EngineClient, EngineDead
from lorad.daemon.errors import ApiError, bad_request

log = logging.getLogger("lorad.adapters")


class AdapterCatalog:
    def __init__(self, start: tuple[AdapterSpec, ...], capacity: LoraCapacity,
                 model_config: ModelConfig | None, base_name: str,
                 adapter_dir: str | None = None, pinned: tuple[str, ...] = ()) -> None:
        self.capacity = capacity
        self.model_config = model_config
        self.base_name = base_name
        self.adapter_dir = Path(adapter_dir) if adapter_dir else None
        self._current: dict[str, AdapterSpec] = {spec.name: spec for spec in start}
        self._pinned: set[int] = {s.adapter_id for s in start if s.name in pinned}
        self._next_id = len(start) + 1
        self._open: dict[int, int] = {}  # registry id -> requests holding it
        self._retired: set[int] = set()  # versions no name points to, unloaded once unused
        self._idle: dict[int, asyncio.Event] = {}  # set when a version's last request ends
        self._locks: dict[str, asyncio.Lock] = {}  # one change at a time per name
        self.engine: EngineClient | None = None  # set once the workers are up
        self.num_loads = 0  # versions registered while serving (reloads and first uses too)
        self.num_unloads = 0

    # --- reading ------------------------------------------------------------------------------

    def served(self) -> tuple[AdapterSpec, ...]:
        """The current version of every served name, by registry id."""
        return tuple(sorted(self._current.values(), key=lambda s: s.adapter_id))

    def digest(self) -> str:
        """sha256 over the served versions (name, id, identity key, strength, pinned): moves
        with every load, reload and unload."""
        parts = [[s.name, s.adapter_id, s.key, s.strength, self.is_pinned(s)]
                 for s in self.served()]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()

    def is_pinned(self, spec: AdapterSpec) -> bool:
        return spec.adapter_id in self._pinned

    def num_open(self, spec: AdapterSpec) -> int:
        return self._open.get(spec.adapter_id, 0)

    # --- requests -----------------------------------------------------------------------------

    async def first_use(self, name: str) -> None:
        """With --adapter-dir: make `name` served from DIR/NAME if it is not yet and the folder
        exists (a bad folder is a 400; no folder leaves the name unknown: a 404 follows)."""
        if (self.adapter_dir is None or name in self._current or name == self.base_name
                or not ADAPTER_NAME.fullmatch(name)):
            return
        folder = self.adapter_dir / name
        if not folder.is_dir():
            return
        async with self._lock(name):
            if name not in self._current:  # a request beside this one may have loaded it
                await self._load(name, str(folder), 1.0, False, "model")

    @contextmanager
    def hold(self, spec: AdapterSpec | None) -> Iterator[None]:
        """A request runs on this version until the block ends."""
        if spec is None:
            yield
            return
        self._open[spec.adapter_id] = self._open.get(spec.adapter_id, 0) + 1
        try:
            yield
        finally:
            self._release(spec.adapter_id)

    # --- admin ----------------------------------------------------------------------------------

    async def load(self, name: str, path: str, strength: float, pinned: bool,
                   replace: bool) -> tuple[AdapterSpec, AdapterSpec | None]:
        """Register `path` as `name` -> (the new version, the version it replaced or None)."""
        if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
            raise bad_request("name must be 1 to 64 letters, digits, '.', '_' or '-', starting "
                              "with a letter or digit", "name")
        if name == self.base_name:
            raise bad_request(f"`{name}` is the base model's id; adapters need their own", "name")
        async with self._lock(name):
            old = self._current.get(name)
            if old is not None and not replace:
                raise ApiError(409, f"an adapter named `{name}` is already served (id "
                                    f"{old.adapter_id}); send replace: true to reload it",
                               "name", "adapter_exists")
            if pinned and not (old is not None and self.is_pinned(old)) \
                    and len(self._pinned) + 1 >= max(self.capacity.num_slots, 1):
                raise bad_request(f"pinning `{name}` would leave no device slot of "
                                  f"{self.capacity.num_slots} (--max-gpu-adapters) for the "
                                  "others", "pinned")
            spec = await self._load(name, path, strength, pinned, "path")
            return spec, old

    async def unload(self, name: str) -> AdapterSpec:
        """Stop serving `name`: new requests get a 404 at once; answers once the requests that
        chose it have ended and the workers forgot it."""
        async with self._lock(name):
            spec = self._current.pop(name, None)
            if spec is None:
                raise ApiError(404, f"no adapter named `{name}` is served", "name",
                               "adapter_not_found")
            self._retire(spec)
            event = self._idle.get(spec.adapter_id)
            if event is not None:
                await event.wait()
            self.num_unloads += 1
            return spec

    # --- inside -------------------------------------------------------------------------------

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    async def _load(self, name: str, path: str, strength: float, pinned: bool,
                    field: str) -> AdapterSpec:
        adapter_id = self._next_id
        self._next_id += 1
        spec = await asyncio.to_thread(self._validate, name, path, strength, adapter_id, field)
        if self.engine is None:
            raise ApiError(503, "the workers are not up yet", None, "not_ready")
        try:
            await self.engine.load_adapter(spec, pinned)
        except EngineDead as exc:
            raise ApiError(503, f"the engine is down: {exc}", None, "engine_down") from None
        except AdapterLoadError as exc:
            raise bad_request(f"adapter `{name}` ({spec.path}) was not loaded, and every rank "
                              f"keeps the adapters it had: {exc}", field, "adapter_load_failed")
        old = self._current.get(name)
        self._current[name] = spec  # requests from here on choose the new version
        if pinned:
            self._pinned.add(adapter_id)
        if old is not None:
            self._retire(old)
        self.num_loads += 1
        log.info("adapter %r registered as id %d (key %s...)%s", name, adapter_id, spec.key[:16],
                 f", replacing id {old.adapter_id}" if old is not None else "")
        return spec

    def _validate(self, name: str, path: str, strength: float, adapter_id: int,
                  field: str) -> AdapterSpec:
        try:
            spec = read_adapter(Path(path), name, strength, adapter_id, self.model_config)
        except ConfigError as exc:
            raise bad_request(f"adapter `{name}` at {path}: {exc}", field,
                              "invalid_adapter") from None
        refusal = self.capacity.refusal(spec.modules)
        if refusal is not None:
            raise bad_request(f"adapter `{name}` at {path}: {refusal}", field, "invalid_adapter")
        return spec

    def _retire(self, spec: AdapterSpec) -> None:
        """No name points to this version any more: unload it on the workers once unused."""
        self._pinned.discard(spec.adapter_id)
        self._retired.add(spec.adapter_id)
        if self._open.get(spec.adapter_id):
            self._idle[spec.adapter_id] = asyncio.Event()
        else:
            self._unload(spec.adapter_id)

    def _release(self, adapter_id: int) -> None:
        left = self._open[adapter_id] - 1
        if left:
            self._open[adapter_id] = left
            return
        del self._open[adapter_id]
        if adapter_id in self._retired:
            self._unload(adapter_id)
            event = self._idle.pop(adapter_id, None)
            if event is not None:
                event.set()

    def _unload(self, adapter_id: int) -> None:
        self._retired.discard(adapter_id)
        if self.engine is not None:
            self.engine.unload_adapter(adapter_id)
