"""Other producers' torch.save files are read with weights_only=True only, and what it refuses is said
in plain words: a pickled object is never run, and a file that is not a torch.save file says so."""

from __future__ import annotations

import gzip
import io
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tracediff.errors import InputError  # noqa: E402
from tracediff.integrations.torch_files import load_tensors  # noqa: E402


class Smuggler:
    """Unpickling it would run code: it touches a marker file."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def npy_bytes() -> bytes:
    out = io.BytesIO()
    np.save(out, np.arange(3))
    return out.getvalue()


NOT_TORCH = "not a torch.save file (or a damaged one)"
FILES = {
    "pickled object": (lambda p, marker: torch.save({"x": Smuggler(marker)}, p),
                       "would need unpickling (refused, never run)"),
    "random bytes": (lambda p, marker: p.write_bytes(bytes(range(256)) * 3), NOT_TORCH),
    "text": (lambda p, marker: p.write_bytes(b"hello world\n" * 5), NOT_TORCH),
    "npy": (lambda p, marker: p.write_bytes(npy_bytes()), NOT_TORCH),
    "gzip of zeros": (lambda p, marker: p.write_bytes(gzip.compress(b"\0" * 100)), NOT_TORCH),
}


@pytest.mark.parametrize("kind", FILES)
def test_what_torch_load_refuses_is_said_plainly_and_nothing_runs(tmp_path, kind) -> None:
    path, marker = tmp_path / "f.pt", tmp_path / "MARKER"
    write, said = FILES[kind]
    write(path, marker)
    with pytest.raises(InputError) as caught:
        load_tensors(path, "a dump")
    assert caught.value.path == str(path) and said in caught.value.problem, caught.value.problem
    assert "weights_only` set to" not in caught.value.problem  # torch's advice to rerun is not ours
    assert not marker.exists()


def test_tensors_in_a_dict_load() -> None:
    buffer = io.BytesIO()
    torch.save({"x": torch.ones(2)}, buffer)
    buffer.seek(0)
    assert torch.equal(load_tensors(pathlib.Path("mem"), "a dump", buffer)["x"], torch.ones(2))
