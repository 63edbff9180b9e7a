"""The broadcast transport's in-band bucket header (``weightsync.impl.transfer.bucket_header``), single
process: encoding and decoding, and the refusal of a header of another round, bucket or wire format."""

from __future__ import annotations

import pytest
import torch

from weightsync.impl.transfer.bucket_header import HEADER_BYTES, decode_header, encode_header
from weightsync.spec.errors import WireMismatchError


def test_bucket_header_round_trips_every_digest_kind_and_refuses_a_foreign_one() -> None:
    """The broadcast transport's in-band header (``bucket_header``): what the trainer encodes is what a
    worker decodes (no digest, CRC-32, HMAC-SHA256, abort), and a header of another round, bucket or wire
    format is a WireMismatchError naming what was expected, not a silent misread."""
    cpu = torch.device("cpu")
    mac = "ab" * 32
    for digest, abort in ((None, False), (0xDEADBEEF, False), (mac, False), (None, True)):
        t = encode_header(7, 3, digest, abort, cpu)
        assert t.dtype == torch.uint8 and t.numel() == HEADER_BYTES
        h = decode_header(t.clone(), 7, 3, "here")
        assert (h.seq, h.number, h.abort, h.digest) == (7, 3, abort, digest)
    t = encode_header(7, 3, None, False, cpu)
    with pytest.raises(
        WireMismatchError, match=r"here: from rank 0, expected the header of bucket 4 of round 7"
    ):
        decode_header(t, 7, 4, "here")
    with pytest.raises(WireMismatchError, match="round 8"):
        decode_header(t, 8, 3, "here")
    foreign = t.clone()
    foreign[:4] = torch.tensor(list(b"WSB1"), dtype=torch.uint8)
    with pytest.raises(WireMismatchError, match="b'WSB1'"):
        decode_header(foreign, 7, 3, "here")
    with pytest.raises(ValueError, match="32 bytes"):
        encode_header(7, 3, "abcd", False, cpu)
