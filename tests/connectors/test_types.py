import pytest
import torch

from kvwire.connectors.types import IntermediateTensors


def _it():
    return IntermediateTensors({"hidden_states": torch.arange(12.0).view(6, 2), "residual": torch.ones(6, 2)})


def test_intermediate_tensors_index_by_name_and_slice():
    it = _it()
    assert torch.equal(it["residual"], torch.ones(6, 2))
    part = it[2:4]
    assert isinstance(part, IntermediateTensors)
    assert list(part.keys()) == ["hidden_states", "residual"]
    assert torch.equal(part["hidden_states"], torch.tensor([[4.0, 5.0], [6.0, 7.0]]))
    assert part["residual"].shape == (2, 2)
    assert len(it) == 2 and len(part) == 2


def test_intermediate_tensors_setitem_items_and_repr():
    it = _it()
    it["extra"] = torch.zeros(6, 1)
    assert [k for k, _ in it.items()] == ["hidden_states", "residual", "extra"]
    assert "extra: (6, 1)" in repr(it)
    with pytest.raises(TypeError):
        it[0]  # noqa: B018


def test_intermediate_tensors_equality_compares_keys_and_values():
    assert _it() == _it()
    other = _it()
    other["residual"] = torch.zeros(6, 2)
    assert _it() != other
    fewer = IntermediateTensors({"hidden_states": _it()["hidden_states"]})
    assert _it() != fewer
    assert _it().kv_connector_output is None
    assert IntermediateTensors({}, kv_connector_output="x").kv_connector_output == "x"
