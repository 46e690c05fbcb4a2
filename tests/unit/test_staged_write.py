"""``staged``: an export or base save is built in ``.tmp-<name>`` beside ``out`` and renamed into
place. A folder of the user's that bears that name is refused and kept; a killed write's leftover
(it carries the staging marker) is removed; the finished folder holds no marker."""

import pytest

from llmft.errors import UserError
from llmft.model.save import STAGING_MARKER, staged


def test_a_users_folder_named_like_the_staging_folder_is_refused_and_kept(tmp_path):
    mine = tmp_path / ".tmp-out"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(UserError) as e:
        with staged(tmp_path / "out"):
            pass
    assert str(e.value) == (
        f"{mine}: is in the way: llmft stages out there before renaming it into place, and this is not a "
        "folder llmft left (it has no staging marker). Move it away, or choose another --out."
    )
    assert (mine / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "out").exists()


def test_a_file_named_like_the_staging_folder_is_refused_and_kept(tmp_path):
    (tmp_path / ".tmp-out").write_text("mine")
    with pytest.raises(UserError):
        with staged(tmp_path / "out"):
            pass
    assert (tmp_path / ".tmp-out").read_text() == "mine"


def test_a_killed_writes_leftover_is_removed_and_the_result_has_no_marker(tmp_path):
    left = tmp_path / ".tmp-out"
    left.mkdir()
    (left / STAGING_MARKER).touch()
    (left / "model.safetensors").write_bytes(b"half")
    with staged(tmp_path / "out") as tmp:
        assert sorted(p.name for p in tmp.iterdir()) == [STAGING_MARKER]  # a fresh folder
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
