"""ConsulClient.txn's pure parts: the request body and the typed answer."""

from __future__ import annotations

import pytest

from caravan_llm.common.consul_api import (
    TxnCas,
    TxnCheckIndex,
    TxnConflictError,
    TxnDeleteCas,
    TxnOpError,
    parse_txn_answer,
    txn_op_payload,
)
from caravan_llm.common.errors import HashiPermissionDenied, HashiUnavailable


def test_op_payloads_are_consuls_shapes():
    """Values travel base64-encoded, CAS indexes as Index."""
    assert {"KV": {"Verb": "cas", "Key": "k", "Value": "dg==", "Flags": 0, "Index": 3}} == (
        txn_op_payload(TxnCas("k", b"v", 3))
    )
    assert {"KV": {"Verb": "delete-cas", "Key": "k", "Index": 4}} == txn_op_payload(
        TxnDeleteCas("k", 4)
    )
    assert {"KV": {"Verb": "check-index", "Key": "k", "Index": 5}} == txn_op_payload(
        TxnCheckIndex("k", 5)
    )


def test_a_200_answer_gives_entries_with_decoded_values():
    """Results become KVEntry values, base64 decoded; writes carry no value."""
    body = {
        "Results": [
            {"KV": {"Key": "a", "Value": None, "Flags": 0, "CreateIndex": 7, "ModifyIndex": 7}},
            {"KV": {"Key": "b", "Value": "eA==", "Flags": 0, "CreateIndex": 2, "ModifyIndex": 3}},
        ],
        "Errors": None,
    }
    entries = parse_txn_answer(200, body)
    assert [("a", b"", 7), ("b", b"x", 3)] == [(e.key, e.value, e.modify_index) for e in entries]


def test_a_409_answer_is_a_retryable_conflict_with_the_op_errors():
    """Errors become TxnConflictError, retryable, listing OpIndex and What."""
    body = {"Results": None, "Errors": [{"OpIndex": 1, "What": "failed to set key"}]}
    with pytest.raises(TxnConflictError) as conflict:
        parse_txn_answer(409, body)
    assert conflict.value.retryable
    assert (TxnOpError(1, "failed to set key"),) == conflict.value.errors


def test_a_permission_error_in_a_409_is_permission_denied():
    """A token refused per operation is not a conflict to retry."""
    body = {"Results": None, "Errors": [{"OpIndex": 0, "What": "Permission denied: token"}]}
    with pytest.raises(HashiPermissionDenied) as denied:
        parse_txn_answer(409, body)
    assert not denied.value.retryable


def test_an_answer_that_is_not_json_is_unavailable():
    """A body that is not the JSON object Consul sends is a retryable HashiUnavailable."""
    with pytest.raises(HashiUnavailable):
        parse_txn_answer(200, "oops")
