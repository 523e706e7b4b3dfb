"""The model ids one lorad serves: the base model and each registered adapter.

Builds their /v1/models cards and turns a request's `model` and `adapter` fields into what it
runs on, refusing an unknown or contradictory choice before anything is admitted: a request never
falls back to the base model silently. Does not validate adapter folders (lorad.config.adapters).
"""

from __future__ import annotations

from dataclasses import dataclass

from lorad.config.adapters import AdapterSpec
from lorad.daemon.errors import ApiError, bad_request


@dataclass(frozen=True)
class ModelChoice:
    """What one request runs on."""

    model_id: str  # the id its responses report: the adapter's name, or the base model's id
    adapter: AdapterSpec | None  # None: the base model (adapter id 0)

    @property
    def adapter_id(self) -> int:
        return self.adapter.adapter_id if self.adapter is not None else 0

    @property
    def adapter_key(self) -> str:
        return self.adapter.key if self.adapter is not None else ""


def choose(base_id: str, adapters: tuple[AdapterSpec, ...], model: str,
           adapter: str | None) -> ModelChoice:
    """`model` is the base id or an adapter's name (404 otherwise); `adapter`, if given, names a
    registered adapter (400 otherwise) and, with an adapter's name as `model`, must be the same."""
    by_name = {spec.name: spec for spec in adapters}
    if model != base_id and model not in by_name:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves "
                            f"{_listing(base_id, adapters)}.", "model", "model_not_found")
    if adapter is not None and adapter not in by_name:
        served = (f"its adapters are {', '.join(f'`{a.name}`' for a in adapters)}" if adapters
                  else "it was started without adapters")
        raise bad_request(f"The adapter `{adapter}` does not exist on this server; {served}.",
                          "adapter", "adapter_not_found")
    if model != base_id and adapter is not None and adapter != model:
        raise bad_request(f"model `{model}` and adapter `{adapter}` disagree: send the adapter's "
                          f"name as model, or model `{base_id}` with adapter `{adapter}`",
                          "adapter", "adapter_conflict")
    name = model if model != base_id else adapter
    if name is None:
        return ModelChoice(base_id, None)
    return ModelChoice(name, by_name[name])


def model_cards(base_id: str, adapters: tuple[AdapterSpec, ...], created: int,
                max_model_len: int) -> list[dict]:
    """The base model's card first, then one per adapter in slot order (`parent`: the base)."""
    base = {"id": base_id, "object": "model", "created": created, "owned_by": "lorad",
            "parent": None, "max_model_len": max_model_len}
    return [base] + [{**base, "id": spec.name, "parent": base_id} for spec in adapters]


def _listing(base_id: str, adapters: tuple[AdapterSpec, ...]) -> str:
    ids = [f"`{base_id}`"] + [f"`{spec.name}`" for spec in adapters]
    return ids[0] if len(ids) == 1 else f"{', '.join(ids[:-1])} and {ids[-1]}"
