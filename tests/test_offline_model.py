"""SmolLM2 materialized from its PyPI wheel: a half-written folder is rebuilt, and a folder another
process renamed into place first is kept as it is (it may be in use)."""

from __future__ import annotations

import json
import shutil

import pytest

from rollout import offline_model

pytestmark = pytest.mark.slow  # a build from the gguf, ~19 s here


def test_a_half_written_folder_is_rebuilt_and_a_racing_builders_folder_is_kept(tmp_path, monkeypatch):
    half = tmp_path / "half"
    half.mkdir()
    (half / "config.json").write_text("{}")  # no weights: an interrupted build of an older version
    built = offline_model.materialize_smollm2(half)
    assert json.loads((built / "config.json").read_text())["model_type"] == "llama"
    assert (built / "model.safetensors").stat().st_size > 100 * 2**20

    # another process renames its complete folder into place while this one builds (the build is a
    # copy of the one above: the rename is what is tested)
    monkeypatch.setattr(offline_model, "_build", lambda gguf, folder: [shutil.copy(f, folder) for f in built.iterdir()])
    raced = tmp_path / "raced"
    real_rename = type(raced).rename

    def rename(self, target):
        if target == raced and not raced.exists():
            raced.mkdir()
            (raced / "config.json").write_text('{"theirs": true}')
            (raced / "model.safetensors").write_text("theirs")
        return real_rename(self, target)

    monkeypatch.setattr(type(raced), "rename", rename)
    assert offline_model.materialize_smollm2(raced) == raced
    assert json.loads((raced / "config.json").read_text()) == {"theirs": True}  # kept, not replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["half", "raced"]  # no temporary folder left
