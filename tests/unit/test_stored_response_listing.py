"""A stored response's input items as the edge lists them (services/edge/responses_api.py): ids, pages, errors."""

from __future__ import annotations

import pytest

from services.edge.responses_api import page, with_ids
from shared import errors

ITEMS = with_ids([{"type": "message", "role": "user", "content": []}, {"type": "function_call_output",
                  "call_id": "c", "output": "x"}, {"type": "function_call", "id": "fc_own", "call_id": "c",
                  "name": "n", "arguments": "{}"}, {"type": "reasoning", "summary": []}], "abc")


def test_items_keep_their_own_id_or_get_one_from_the_response():
    assert [item["id"] for item in ITEMS] == ["msg_abc_in0", "fco_abc_in1", "fc_own", "rs_abc_in3"]


def test_pages_newest_first_by_default_and_in_order_on_asc_with_an_after_cursor():
    first = page(ITEMS, {"limit": "2"})
    assert [i["id"] for i in first["data"]] == ["rs_abc_in3", "fc_own"]
    assert (first["first_id"], first["last_id"], first["has_more"]) == ("rs_abc_in3", "fc_own", True)
    rest = page(ITEMS, {"limit": "2", "after": first["last_id"]})
    assert [i["id"] for i in rest["data"]] == ["fco_abc_in1", "msg_abc_in0"] and rest["has_more"] is False
    assert [i["id"] for i in page(ITEMS, {"order": "asc"})["data"]] == [i["id"] for i in ITEMS]
    assert page([], {}) == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}


@pytest.mark.parametrize(("query", "param"), [({"limit": "0"}, "limit"), ({"limit": "101"}, "limit"),
                                              ({"limit": "x"}, "limit"), ({"order": "up"}, "order"),
                                              ({"after": "nope"}, "after")])
def test_bad_listing_params_are_400_naming_them(query, param):
    with pytest.raises(errors.ApiError) as info:
        page(ITEMS, query)
    assert (info.value.status, info.value.param) == (400, param)
