"""serve/response_store.py: the most recent responses are kept, a read counting as recent use;
a deleted or dropped one is gone; a store of capacity 0 keeps none."""

import pytest

from kvjax.serve.response_store import ResponseStore


def response(i: int) -> dict:
    return {"id": f"resp_{i}", "object": "response"}


def test_the_least_recently_stored_or_read_goes_first():
    store = ResponseStore(capacity=2)
    store.put(response(1), [{"role": "user", "content": "1"}])
    store.put(response(2), [])
    kept = store.get("resp_1")
    assert (kept.response, kept.conversation) == (response(1), [{"role": "user", "content": "1"}])
    store.put(response(3), [])  # 2 is now the least recent
    assert store.get("resp_2") is None
    assert store.get("resp_1") is not None and store.get("resp_3") is not None
    assert store.delete("resp_1") and not store.delete("resp_1")
    assert store.get("resp_1") is None


def test_a_store_of_no_capacity_keeps_nothing_and_a_bad_one_is_refused():
    store = ResponseStore(capacity=0)
    store.put(response(1), [])
    assert store.get("resp_1") is None
    with pytest.raises(ValueError, match="capacity >= 0 responses, got -1"):
        ResponseStore(-1)
