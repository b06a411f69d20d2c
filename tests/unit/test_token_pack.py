"""shared/token_pack.py and the schema codec that uses it: a GenerateRequest's token ids go packed, 2 or 3 bytes
each, and come back as the same plain list; what is not a packing of token ids never decodes."""

from __future__ import annotations

import random

import msgspec
import pytest

from shared import schema, token_pack
from shared.schema import GenerateRequest, KvTransfer, SamplingParams


@pytest.mark.parametrize("ids, width", [
    ([], 2),
    ([0, 1, 65535], 2),
    ([0, 65536], 3),
    ([token_pack.MAX_ID, 7], 3),
])
def test_ids_round_trip_at_the_narrowest_width(ids, width):
    packed = token_pack.pack(ids)
    assert packed[0] == width and len(packed) == token_pack.packed_size(len(ids), max(ids, default=0))
    assert token_pack.unpack(packed) == ids


@pytest.mark.parametrize("ids", [[-1], [token_pack.MAX_ID + 1], [1 << 40]])
def test_ids_out_of_range_are_refused(ids):
    with pytest.raises(ValueError):
        token_pack.pack(ids)


@pytest.mark.parametrize("data", [b"", b"\x04\x00\x00\x00\x00", b"\x02\x00", b"\x03\x00\x00\x00\x00"])
def test_what_is_not_a_packing_does_not_unpack(data):
    with pytest.raises(ValueError):
        token_pack.unpack(data)


def test_a_generate_request_goes_packed_and_comes_back_equal():
    rng = random.Random(3)
    prompt = [rng.randrange(262_144) for _ in range(256_000)]  # a 256K prompt of a 262K vocabulary
    request = GenerateRequest("r", "m", prompt, SamplingParams(max_tokens=8), attempt=1,
                              kv_transfer=KvTransfer("p-0", "r-p", 128, {"remote_block_ids": [1, 2]}),
                              output_token_ids=[9, 70_000])
    data = schema.encode(request)
    assert len(data) < 1 << 20 < len(msgspec.msgpack.encode(prompt))  # fits NATS' default max_payload; unpacked not
    back = schema.decode(data, GenerateRequest)
    assert back == request and type(back.prompt_token_ids) is list


def test_a_generate_request_with_unpackable_ids_does_not_decode():
    data = schema.encode(GenerateRequest("r", "m", [1, 2, 3], SamplingParams(max_tokens=4)))
    broken = data.replace(token_pack.pack([1, 2, 3]), b"\x09\x01\x02\x03\x04\x05\x06")
    with pytest.raises(msgspec.ValidationError):
        schema.decode(broken, GenerateRequest)
