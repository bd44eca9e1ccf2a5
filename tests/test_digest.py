"""A checkpoint file's digests (trainer.checkpoint.digest): each piece's sha256 and xxh3-128,
checked on every core; a damaged piece anywhere caught by either; a manifest of before (one
sha256) checked whole; and which digest a store's restore checks."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
import xxhash

from trainer.checkpoint import digest
from trainer.checkpoint.digest import PieceCheck
from trainer.checkpoint.manager import Checkpointer
from trainer.checkpoint.store import LocalStore

PIECE = 1024  # many pieces from a small file
REFERENCE = {  # each digest as its own library computes it
    "sha256": lambda data: hashlib.sha256(data).hexdigest(),
    "xxh3": lambda data: xxhash.xxh3_128(data).hexdigest(),
}


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(digest, "PIECE_BYTES", PIECE)


@pytest.fixture
def written(tmp_path):
    data = os.urandom(10 * PIECE + 17)
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(data)
    return path, data


@pytest.mark.parametrize("algorithm", sorted(REFERENCE))
def test_each_piece_has_its_own_digests_and_the_file_matches_them(written, small_pieces, algorithm):
    path, data = written
    done = []
    pieces = digest.piece_digests(path, done.append)[algorithm]
    assert pieces == [REFERENCE[algorithm](data[at : at + PIECE]) for at in range(0, len(data), PIECE)]
    assert done[-1] == len(data) and len(done) == 11
    assert digest.matches(path, PieceCheck(algorithm, pieces, PIECE))


@pytest.mark.parametrize("algorithm", sorted(REFERENCE))
@pytest.mark.parametrize("where", [0, 5 * PIECE + 3, 10 * PIECE + 16])
def test_a_flipped_byte_in_any_piece_fails_the_check(written, small_pieces, where, algorithm):
    path, data = written
    pieces = digest.piece_digests(path)[algorithm]
    damaged = bytearray(data)
    damaged[where] ^= 0x01
    path.write_bytes(damaged)
    assert not digest.matches(path, PieceCheck(algorithm, pieces, PIECE))


def test_a_manifest_of_before_is_checked_by_the_whole_files_sha256(written):
    path, data = written
    whole = hashlib.sha256(data).hexdigest()
    assert digest.matches(path, PieceCheck("sha256", None, 0, whole))
    assert not digest.matches(path, PieceCheck("sha256", None, 0, hashlib.sha256(b"other").hexdigest()))


def test_an_empty_file_and_a_wrong_piece_count(tmp_path, small_pieces):
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    assert digest.piece_digests(empty) == {"sha256": [], "xxh3": []}
    assert digest.matches(empty, PieceCheck("sha256", [], PIECE))
    assert not digest.matches(empty, PieceCheck("sha256", ["00" * 32], PIECE))


@pytest.mark.parametrize(("own_writes", "checked"), [(True, "xxh3"), (False, "sha256")])
def test_a_store_of_its_own_writes_is_checked_by_xxh3_any_other_by_sha256(
    tmp_path, own_writes, checked, caplog
):
    """Each digest is spoiled in turn in the manifest: the restore refuses the file exactly
    when the one its store checks is wrong (snapshots: xxh3; a bucket or folder: sha256)."""
    for spoiled in ("sha256", "xxh3"):
        folder = tmp_path / f"{own_writes}-{spoiled}"
        checkpointer = Checkpointer(LocalStore(folder), keep_last=0, cache=folder, own_writes=own_writes)
        checkpointer.store.prepare()
        checkpointer.save({"model": {"w": torch.ones(8)}}, step=1, epoch=0, world_size=1)
        manifest_path = folder / "step-1" / "manifest.json"
        manifest = json.loads(manifest_path.read_text())
        manifest[f"{spoiled}_pieces"] = ["00" * 16]
        manifest_path.write_text(json.dumps(manifest))
        assert checkpointer.fetch_verified(1) == (spoiled != checked), (own_writes, spoiled)
    assert f"fails its {checked} check" in caplog.text
