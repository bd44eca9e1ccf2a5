"""A checkpoint file's digests (trainer.checkpoint.digest): each piece's sha256, checked on
every core; a damaged piece anywhere caught; a manifest of before (one sha256) checked whole."""

from __future__ import annotations

import hashlib
import os

import pytest

from trainer.checkpoint import digest

PIECE = 1024  # many pieces from a small file


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(digest, "PIECE_BYTES", PIECE)


@pytest.fixture
def written(tmp_path):
    data = os.urandom(10 * PIECE + 17)
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(data)
    return path, data


def test_each_piece_has_its_own_sha256_and_the_file_matches_them(written, small_pieces):
    path, data = written
    done = []
    pieces = digest.piece_digests(path, done.append)
    assert pieces == [hashlib.sha256(data[at : at + PIECE]).hexdigest() for at in range(0, len(data), PIECE)]
    assert done[-1] == len(data) and len(done) == 11
    assert digest.matches(path, pieces=pieces, piece_bytes=PIECE, sha256=None)


@pytest.mark.parametrize("where", [0, 5 * PIECE + 3, 10 * PIECE + 16])
def test_a_flipped_byte_in_any_piece_fails_the_check(written, small_pieces, where):
    path, data = written
    pieces = digest.piece_digests(path)
    damaged = bytearray(data)
    damaged[where] ^= 0x01
    path.write_bytes(damaged)
    assert not digest.matches(path, pieces=pieces, piece_bytes=PIECE, sha256=None)


def test_a_manifest_of_before_is_checked_by_the_whole_files_sha256(written):
    path, data = written
    whole = hashlib.sha256(data).hexdigest()
    assert digest.matches(path, pieces=None, piece_bytes=0, sha256=whole)
    assert not digest.matches(path, pieces=None, piece_bytes=0, sha256=hashlib.sha256(b"other").hexdigest())


def test_an_empty_file_and_a_wrong_piece_count(tmp_path, small_pieces):
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    assert digest.piece_digests(empty) == []
    assert digest.matches(empty, pieces=[], piece_bytes=PIECE, sha256=None)
    assert not digest.matches(empty, pieces=["00" * 32], piece_bytes=PIECE, sha256=None)
