"""A store's check of the files it holds: the sha256 once, then the xxh3 recorded with it."""

from __future__ import annotations

import pytest
import torch

from edgetp.memory.shards import ShardStore, ShardWriter, file_digests


def test_a_held_file_is_checked_against_the_xxh3_recorded_with_its_sha256(tmp_path):
    store = ShardStore(tmp_path)
    ref = store.put({"w": torch.arange(4096, dtype=torch.float32)})
    path, record = store.path(ref), store.checksum_path(ref)
    right = path.read_bytes()
    sha256, xxh3 = file_digests(path)
    assert sha256 == ref.sha256 and int(record.read_text()) == xxh3  # recorded as stored
    assert store.checksum(ref) == xxh3

    flipped = bytearray(right)
    flipped[-7] ^= 0x01  # a weight's bit, the size unchanged
    path.write_bytes(bytes(flipped))
    assert store.checksum(ref) is None  # the record catches it: to be fetched again

    record.unlink()  # no record (a store from before, or one lost): the sha256 decides
    assert store.checksum(ref) is None and not record.exists()
    path.write_bytes(right)
    assert store.checksum(ref) == xxh3 and int(record.read_text()) == xxh3

    record.write_text("not a number")  # a damaged record is no record
    assert store.checksum(ref) == xxh3 and int(record.read_text()) == xxh3
    record.write_text(str(xxh3 ^ 1))  # a wrong one refuses the file, never passes a bad one
    assert store.checksum(ref) is None


def test_a_shard_with_rows_never_written_is_refused_and_not_stored(tmp_path):
    """Rows a writer never got would be zeros that compute without an error: finishing such a
    shard raises, names the tensor, and leaves nothing in the store."""
    store = ShardStore(tmp_path)
    writer = ShardWriter(store, {"w": (torch.float32, (4, 3)), "b": (torch.float32, (3,))})
    writer.write_rows("w", 0, torch.ones(2, 3))
    writer.write_rows("b", 0, torch.ones(3))
    with pytest.raises(ValueError, match=r"unwritten rows .*'w': 2"):
        writer.finish()
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == []
