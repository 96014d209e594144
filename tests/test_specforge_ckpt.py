"""`tracediff import specforge-ckpt`: SpecForge's offline hidden-state files into a training trace
that compares with a serving trace of the same tokens, read with torch.load(weights_only=True)."""

from __future__ import annotations

import collections
import gzip
import io
import pathlib

import pytest

torch = pytest.importorskip("torch")

import tracediff as td  # noqa: E402
from tests.conftest import cli, tiny_llama  # noqa: E402

PROMPTS = [[5, 77, 300, 12, 9], [17, 3, 250]]
AUX = (0, 1, 2)


def sample(model, tokens) -> dict:
    """What SpecForge's capture writes for one sample (HF hidden_states: [0] embed, [i+1] layer i,
    the last after the final norm)."""
    with torch.no_grad():
        hidden = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return {"input_ids": torch.tensor(tokens), "loss_mask": torch.ones(len(tokens), dtype=torch.long),
            "aux_hidden_state": torch.cat([hidden[i + 1] for i in AUX], dim=-1),
            "hidden_state": hidden[-1]}


def save(data, path, zipped: bool = False) -> None:
    buffer = io.BytesIO()
    torch.save(data, buffer)
    path.write_bytes(gzip.compress(buffer.getvalue()) if zipped else buffer.getvalue())


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, layers=4)


def test_imported_training_features_match_a_serving_trace_of_the_same_tokens(model, tmp_path) -> None:
    features = tmp_path / "features"
    features.mkdir()
    save(sample(model, PROMPTS[0]), features / "data_0.ckpt")
    save(sample(model, PROMPTS[1]), features / "data_1.ckpt.gz", zipped=True)
    out = cli("import", "specforge-ckpt", str(features), "-o", str(tmp_path / "train.h5"),
                  "--aux-layer-ids", "0,1,2")
    assert out.returncode == 0, out.stderr
    assert f"wrote {tmp_path / 'train.h5'}: 8 rows from 2 files" in out.stdout
    with td.open_trace(tmp_path / "train.h5") as trace:
        assert trace.meta["contract"]["aux_layer_ids"] == [0, 1, 2]
        assert set(trace.names()) == {"target.aux", "target.final_hidden", "train.loss_mask"}
        assert trace.request_tokens().sequence("data_1")[1].tolist() == PROMPTS[1]
    with td.record(tmp_path / "serve.h5", source="serving") as rec, torch.no_grad():
        for i, tokens in enumerate(PROMPTS):
            hidden = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
            rec.log("target.aux", torch.cat([hidden[k + 1] for k in AUX], dim=-1), token_ids=[tokens],
                    request=f"req{i}")
    report = td.compare(tmp_path / "train.h5", tmp_path / "serve.h5")
    assert report.verdict == "match", report.reasons
    aux = next(t for t in report.tensors if t.name == "target.aux")
    assert aux.coverage.fraction == 1.0 and aux.rows == 8


class Payload:
    """Not a tensor: loading it would need real unpickling."""


class Smuggler:
    """Unpickling it would run code: it touches a marker file."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_files_that_are_not_feature_files_give_one_line_and_leave_nothing(model, tmp_path) -> None:
    good = sample(model, PROMPTS[0])
    cases = {
        "pickled.ckpt": {**good, "extra": Payload()},
        "missing.ckpt": {k: v for k, v in good.items() if k != "hidden_state"},
        "short.ckpt": {**good, "loss_mask": torch.ones(2)},
        "smuggled.ckpt": {**good, "extra": Smuggler(tmp_path / "MARKER")},
    }
    for name, data in cases.items():
        folder = tmp_path / name.split(".")[0]
        folder.mkdir()
        save(collections.OrderedDict(data), folder / name)
        result = cli("import", "specforge-ckpt", str(folder), "-o", str(tmp_path / f"{name}.h5"))
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {folder / name}: ")
        assert {"pickled.ckpt": "objects other than tensors", "missing.ckpt": "expected a dict with",
                "short.ckpt": "loss_mask has 2 positions",
                "smuggled.ckpt": "which would need unpickling (refused, never run)"}[name] in lines[0]
        assert not (tmp_path / f"{name}.h5").exists()
        assert "weights_only` set to `False`" not in result.stderr  # torch's advice is not ours to give
    assert not (tmp_path / "MARKER").exists()  # nothing was unpickled
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    save(good, truncated / "data_0.ckpt")
    (truncated / "data_0.ckpt").write_bytes((truncated / "data_0.ckpt").read_bytes()[:100])
    result = cli("import", "specforge-ckpt", str(truncated), "-o", str(tmp_path / "t.h5"))
    assert result.returncode == 2 and "torch.load(weights_only=True) reads" in result.stderr
    result = cli("import", "specforge-ckpt", str(tmp_path / "nowhere"), "-o", str(tmp_path / "x.h5"))
    assert result.returncode == 2 and result.stderr.strip().endswith("no such file or directory")


def test_a_flipped_byte_in_a_feature_file_fails_its_zip_crc(model, tmp_path) -> None:
    """torch.load reads torch.save's zip entries unchecked (a flipped byte loads as another tensor):
    the importer checks each entry's stored CRC-32 first, and names the file."""
    good = sample(model, PROMPTS[0])
    folder = tmp_path / "features"
    folder.mkdir()
    path = folder / "data_0.ckpt"
    save(good, path)
    raw = bytearray(path.read_bytes())
    at = bytes(raw).index(good["hidden_state"].numpy().tobytes()[:64])
    raw[at + 5] ^= 0x10
    path.write_bytes(bytes(raw))
    result = cli("import", "specforge-ckpt", str(folder), "-o", str(tmp_path / "t.h5"))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: corrupt: its entry ")
    assert lines[0].endswith("fails its CRC-32") and not (tmp_path / "t.h5").exists()


def test_a_damaged_zip_directory_is_one_error_line(model, tmp_path) -> None:
    """A flipped byte in the zip's central directory (an entry's compression method, its flags):
    zipfile refuses to read the entry (NotImplementedError); that is a corrupt file, one line."""
    folder = tmp_path / "features"
    folder.mkdir()
    path = folder / "data_0.ckpt"
    save(sample(model, PROMPTS[0]), path)
    raw = bytearray(path.read_bytes())
    central = bytes(raw).rindex(b"PK\x01\x02")  # the last entry's central directory header
    raw[central + 10] ^= 0xFF  # its compression method
    path.write_bytes(bytes(raw))
    result = cli("import", "specforge-ckpt", str(folder), "-o", str(tmp_path / "t.h5"))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {path}: corrupt: its zip directory is damaged")
    assert not (tmp_path / "t.h5").exists()
