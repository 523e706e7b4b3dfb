"""How a request's `model` and `adapter` fields pick the base model or an adapter, and the
/v1/models cards: every accepted combination, and every refusal's status, field and code."""

from __future__ import annotations

import pytest

from lorad.config.adapters import AdapterSpec
from lorad.daemon.errors import ApiError
from lorad.daemon.model_ids import choose, model_cards

BASE = "base"
ADAPTERS = tuple(AdapterSpec(name, f"/srv/{name}", slot, 1.0, key * 64, f"/srv/{name}/w", ())
                 for slot, (name, key) in enumerate([("sql", "a"), ("pirate", "b")], start=1))


@pytest.mark.parametrize("model,adapter,used,slot,key", [
    (BASE, None, BASE, 0, ""),
    (BASE, "sql", "sql", 1, "a" * 64),
    ("sql", None, "sql", 1, "a" * 64),
    ("sql", "sql", "sql", 1, "a" * 64),
    ("pirate", None, "pirate", 2, "b" * 64),
])
def test_accepted_choices(model, adapter, used, slot, key):
    choice = choose(BASE, ADAPTERS, model, adapter)
    assert (choice.model_id, choice.adapter_id, choice.adapter_key) == (used, slot, key)


@pytest.mark.parametrize("adapters,model,adapter,status,param,code", [
    (ADAPTERS, "other", None, 404, "model", "model_not_found"),
    (ADAPTERS, "other", "sql", 404, "model", "model_not_found"),
    (ADAPTERS, BASE, "other", 400, "adapter", "adapter_not_found"),
    (ADAPTERS, BASE, BASE, 400, "adapter", "adapter_not_found"),
    (ADAPTERS, "sql", "other", 400, "adapter", "adapter_not_found"),
    (ADAPTERS, "sql", "pirate", 400, "adapter", "adapter_conflict"),
    ((), BASE, "sql", 400, "adapter", "adapter_not_found"),
    ((), "sql", None, 404, "model", "model_not_found"),
])
def test_refused_choices(adapters, model, adapter, status, param, code):
    with pytest.raises(ApiError) as exc:
        choose(BASE, adapters, model, adapter)
    assert (exc.value.status, exc.value.param, exc.value.code) == (status, param, code)


def test_messages_name_what_is_served():
    with pytest.raises(ApiError) as exc:
        choose(BASE, ADAPTERS, "other", None)
    assert "`base`, `sql` and `pirate`" in exc.value.message
    with pytest.raises(ApiError) as exc:
        choose(BASE, (), BASE, "sql")
    assert "started without adapters" in exc.value.message


def test_cards_list_the_base_then_each_adapter_with_its_parent():
    cards = model_cards(BASE, ADAPTERS, created=7, max_model_len=512)
    assert [(c["id"], c["parent"]) for c in cards] == [(BASE, None), ("sql", BASE),
                                                       ("pirate", BASE)]
    assert all(c["object"] == "model" and c["owned_by"] == "lorad" and c["created"] == 7
               and c["max_model_len"] == 512 for c in cards)
