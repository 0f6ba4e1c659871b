"""GGUF checkpoints (hf_ppo/models/gguf.py): a file name that a local folder does not hold is named with the files it
does hold, before anything is read or asked of the Hub. (The conversion itself: tests/cli/test_command.py, and
tests/integration/test_gguf_command_real.py on a real file.)"""

from __future__ import annotations

import pytest

from hf_ppo.models import gguf


def test_a_wrong_gguf_file_name_in_a_local_folder_lists_the_files_it_has(tmp_path, monkeypatch):
    """It gave a Hub URL and login advice for a local folder."""
    (tmp_path / "SmolLM2-135M-Instruct-Q8_0.gguf").write_bytes(b"GGUF")
    (tmp_path / "notes.txt").write_text("x")
    monkeypatch.setattr(gguf, "_convert", lambda *a: pytest.fail("converted"))
    with pytest.raises(ValueError, match=r"has no GGUF file 'smollm2-135m-q8\.gguf'; its GGUF files are "
                                         r"\['SmolLM2-135M-Instruct-Q8_0\.gguf'\]: set gguf_file"):
        gguf.converted(str(tmp_path), {"gguf_file": "smollm2-135m-q8.gguf"}, "policy")
    with pytest.raises(ValueError, match=r"its GGUF files are \['SmolLM2-135M-Instruct-Q8_0\.gguf'\]"):
        gguf.converted(str(tmp_path / "smollm2.gguf"), None, "policy")  # the file itself, misnamed
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="has no .gguf file"):
        gguf.converted(str(empty), {"gguf_file": "model.gguf"}, "policy")
