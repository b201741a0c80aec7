"""atomic_output: a reader never sees half a file, and a failed write leaves
the previous file as it was, with no temporary behind."""

import os

import pytest

from odmlq.errors import OdmlqError
from odmlq.files import atomic_output


def test_a_complete_file_replaces_the_old_one(tmp_path):
    target = tmp_path / "model.bin"
    target.write_bytes(b"old")
    with atomic_output(target) as temporary:
        assert os.path.dirname(temporary) == str(tmp_path) and temporary != str(target)
        with open(temporary, "wb") as f:
            f.write(b"new")
        assert target.read_bytes() == b"old"  # not replaced before the write is complete
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["model.bin"]
    assert oct(target.stat().st_mode & 0o777) == oct(0o644)


def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    target = tmp_path / "model.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="halfway"):
        with atomic_output(target) as temporary:
            with open(temporary, "wb") as f:
                f.write(b"ne")
            raise RuntimeError("halfway")
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["model.bin"]


def test_a_missing_directory_is_named(tmp_path):
    with pytest.raises(OdmlqError, match=r"Cannot write .*: directory .*missing' does not exist"):
        with atomic_output(tmp_path / "missing" / "model.bin"):
            pass
