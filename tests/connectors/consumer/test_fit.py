"""A location's fit: KV of another checkpoint, or of another prompt of the same length, is refused as a mismatch,
whatever the shapes say."""

from __future__ import annotations

import msgspec
import pytest

from kvwire.connectors.config import ConnectorKind
from kvwire.connectors.consumer.errors import ReceiveError
from kvwire.connectors.consumer.fit import LocationFit
from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.prompt import prompt_fingerprint
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.wire import DType, HeadSlice, KVLayout, KVLocation, TensorDesc
from kvwire.observability.labels import TransferFailure

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=DType.FLOAT32)


def _fit(model: str) -> LocationFit:
    return LocationFit(KVRegion.from_kv_caches(KVPool.allocate(LAYOUT, 8).kv_caches).of_model(model), verify_kv=False)


def _loc(model: str) -> KVLocation:
    return KVLocation(request_id="r1", producer="prefill-0", producer_epoch=1, kind=ConnectorKind.TCP,
                      side_channel="tcp://127.0.0.1:1", transport_address=b"",
                      layout=msgspec.structs.replace(LAYOUT, model=model), block_ids=[3, 4], num_tokens=6, hidden=[])


@pytest.mark.parametrize("heads", [None, HeadSlice(src_head=0, num_heads=2, dst_head=0)])
def test_kv_of_another_checkpoint_is_a_mismatch_naming_both(heads):
    with pytest.raises(ReceiveError) as err:
        _fit("bbbb").check("r1", 6, [0, 1], 0, _loc("aaaa"), heads=heads)
    assert err.value.failure == TransferFailure.MISMATCH and err.value.peer == "prefill-0"
    assert "another checkpoint (model aaaa, ours bbbb)" in str(err.value)


@pytest.mark.parametrize("ours, theirs", [("bbbb", "bbbb"), ("", "bbbb"), ("bbbb", "")])
def test_the_same_checkpoint_or_one_not_known_fits(ours, theirs):
    loc, dst = _fit(ours).check("r1", 6, [0, 1, 2], 0, _loc(theirs))
    assert dst == [0, 1] and loc.block_ids == [3, 4]


def test_other_shapes_still_say_so():
    other = msgspec.structs.replace(_loc("bbbb"), layout=msgspec.structs.replace(LAYOUT, head_dim=16, model="bbbb"))
    with pytest.raises(ReceiveError, match="does not match ours"):
        _fit("bbbb").check("r1", 6, [0, 1], 0, other)


def test_kv_of_another_kv_cache_dtype_is_a_mismatch_naming_both():
    """One uint8 byte is a value of fp8_e4m3 or of fp8_e5m2: the cache dtypes must agree, not only the bytes."""
    ours = msgspec.structs.replace(LAYOUT, dtype=DType.UINT8, kv_quant="fp8_e4m3")
    fit = LocationFit(KVRegion.from_kv_caches(KVPool.allocate(ours, 8).kv_caches).of_model("m", "fp8_e4m3"),
                      verify_kv=False)
    for theirs, said in (("fp8_e5m2", "fp8_e5m2"), ("", "uint8")):
        loc = msgspec.structs.replace(_loc("m"), layout=msgspec.structs.replace(ours, model="m", kv_quant=theirs))
        with pytest.raises(ReceiveError, match=f"KV cache is {said}, ours fp8_e4m3: serve the same --kv-cache-dtype"):
            fit.check("r1", 6, [0, 1], 0, loc)
    same = msgspec.structs.replace(_loc("m"), layout=msgspec.structs.replace(ours, model="m"))
    assert fit.check("r1", 6, [0, 1, 2], 0, same)[1] == [0, 1]


def test_kv_of_another_prompt_of_the_same_length_is_a_mismatch():
    """A batch's prompts all told one key, or one request's params handed to another: the lengths agree."""
    ours, theirs = prompt_fingerprint([1, 2, 3, 4, 5, 6]), prompt_fingerprint([1, 2, 3, 4, 5, 7])
    with pytest.raises(ReceiveError) as err:
        _fit("m").check("r1", 6, [0, 1], 0, msgspec.structs.replace(_loc("m"), prompt=theirs), prompt=ours)
    assert err.value.failure == TransferFailure.MISMATCH and "another prompt of 6 tokens" in str(err.value)
    for loc_prompt, our_prompt in ((ours, ours), ("", ours), (ours, "")):  # the same, or one side not known
        loc = msgspec.structs.replace(_loc("m"), prompt=loc_prompt)
        assert _fit("m").check("r1", 6, [0, 1], 0, loc, prompt=our_prompt)[1] == [0, 1]


def test_a_prompts_fingerprint_is_of_its_token_ids():
    assert prompt_fingerprint([5, 70000, 2**40]) == prompt_fingerprint((5, 70000, 2**40))
    assert len({prompt_fingerprint(p) for p in ([], [0], [1], [0, 0], [1, 0], [0, 1])}) == 6


@pytest.mark.parametrize(("rows", "intermediate", "fits"), [
    (1, False, True),  # a last stage's prompt's last row
    (6, False, True),  # every row: a producer of an earlier build
    (6, True, True),  # a pipeline stage's intermediate tensors, every row
    (1, True, False),  # ... which the next stage's forward reads all of
    (5, False, False),
])
def test_hidden_states_fit_as_the_last_row_or_every_row(rows, intermediate, fits):
    loc = msgspec.structs.replace(_loc("m"), hidden=[TensorDesc("hidden_states", DType.FLOAT32, (rows, 8))],
                                  intermediate=intermediate)
    if fits:
        assert _fit("m").check("r1", 6, [0, 1], 0, loc)[1] == [0, 1]
    else:
        with pytest.raises(ReceiveError, match="neither the prompt's last row nor every row"):
            _fit("m").check("r1", 6, [0, 1], 0, loc)
