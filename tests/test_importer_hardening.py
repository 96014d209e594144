"""`tracediff import sglang-dump` and `import specforge-ckpt` on hostile and large dumps: names shown as
data, loss masks of any dtype, a record larger than the recorder's queue written whole, and a feature
file at odds with the earlier ones refused in one line (real torch.save files, written as the tools do)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tracediff as td  # noqa: E402
from tests.conftest import cli  # noqa: E402
from tracediff.integrations.sglang.importer import import_sglang_dump  # noqa: E402
from tracediff.integrations.specforge.importer import import_specforge_ckpt  # noqa: E402
from tracediff.text import safe  # noqa: E402

# Names that act on a terminal when printed raw: clear the screen and set its title (ESC, BEL), a C1
# CSI, DEL, a newline (a forged second line). (A name that is not UTF-8, a lone surrogate in Python,
# is printed by stderr's backslashreplace; it is a request id below.)
HOSTILE = {"esc": "\x1b[2J\x1b]0;PWNED\x07", "c1": "\x9b31m", "del": "a\x7fb", "newline": "x\nerror: forged"}
RAW = ("\x1b", "\x07", "\x9b", "\x7f")


def feature_sample(length: int, width: int = 12, mask=None) -> dict:
    """One SpecForge offline feature file's dict: input_ids [L], loss_mask [L], aux_hidden_state
    [1, L, width] and hidden_state [1, L, width / 3]."""
    return {"input_ids": torch.arange(length) % 500,
            "loss_mask": torch.ones(length, dtype=torch.long) if mask is None else mask,
            "aux_hidden_state": torch.randn(1, length, width),
            "hidden_state": torch.randn(1, length, width // 3)}


def sglang_file(run: Path, step: int, index: int, name: str, value) -> Path:
    """One file as SGLang's dumper writes it: its name says step, rank, index and name; its meta too."""
    path = run / f"step={step}___rank=0___dump_index={index}___name={name}.pt"
    torch.save({"value": value, "meta": {"step": step, "rank": 0, "name": name, "dump_index": index}}, path)
    return path


def sglang_forward(run: Path, tensors: dict, rids=("req-a",), lengths=(4,)) -> None:
    """One flat prefill batch: the core fields the non-intrusive hooks dump, then the tensors."""
    run.mkdir(parents=True, exist_ok=True)
    ids = [t for n in lengths for t in range(3, 3 + n)]
    positions = [p for n in lengths for p in range(n)]
    fields = {"input_ids": torch.tensor(ids), "positions": torch.tensor(positions),
              "seq_lens": torch.tensor(lengths), "rids": list(rids), **tensors}
    for index, (name, value) in enumerate(fields.items()):
        sglang_file(run, 0, index, name, value)


def one_error_line(result) -> str:
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


# --- names are data --------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_specforge_file_named_with_terminal_escapes_is_named_by_escapes_in_the_error_line(
        kind, tmp_path) -> None:
    folder = tmp_path / "features"
    folder.mkdir()
    (folder / f"data_{HOSTILE[kind]}.ckpt").write_bytes(b"not a torch.save file")
    line = one_error_line(cli("import", "specforge-ckpt", str(folder), "-o", str(tmp_path / "t.h5")))
    assert not any(c in line for c in RAW), repr(line)
    assert f"data_{safe(HOSTILE[kind])}.ckpt: not a feature file" in line
    assert not (tmp_path / "t.h5").exists()


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_an_sglang_dump_named_with_terminal_escapes_is_named_by_escapes_in_the_error_line(
        kind, tmp_path) -> None:
    run = tmp_path / "dumps" / "run0"
    sglang_forward(run, {"custom": torch.ones(4, 2)})
    (run / f"step=0___rank=0___dump_index=9___name={HOSTILE[kind]}.pt").write_bytes(b"\x80\x02junk")
    line = one_error_line(cli("import", "sglang-dump", str(tmp_path / "dumps"), "-o", str(tmp_path / "s.h5")))
    assert not any(c in line for c in RAW), repr(line)
    assert f"name={safe(HOSTILE[kind])}.pt: not a" in line  # not a dump (a newline: not a dumper file name)
    assert not (tmp_path / "s.h5").exists()


def test_the_runs_an_sglang_folder_holds_are_listed_as_data(tmp_path) -> None:
    for run in ("a\x1b[2J", "b\x1b]0;PWNED\x07"):
        sglang_forward(tmp_path / "dumps" / run, {"custom": torch.ones(4, 2)})
    line = one_error_line(cli("import", "sglang-dump", str(tmp_path / "dumps"), "-o", str(tmp_path / "s.h5")))
    assert "holds the dumps of 2 runs (a\\x1b[2J, b\\x1b]0;PWNED\\x07)" in line and "\x1b" not in line


def test_a_feature_file_whose_name_is_not_utf8_imports_under_an_escaped_request(tmp_path) -> None:
    folder = tmp_path / "features"
    folder.mkdir()
    torch.save(feature_sample(3), os.fsdecode(os.fsencode(folder) + b"/data_caf\xe9.ckpt"))
    done = cli("import", "specforge-ckpt", str(folder), "-o", str(tmp_path / "t.h5"))
    assert done.returncode == 0, done.stderr
    with td.open_trace(tmp_path / "t.h5") as trace:
        assert trace.request_tokens().sequence("data_caf\\udce9")[1].tolist() == [0, 1, 2]
        assert len(trace.rows("target.aux")) == 3


# --- dtypes -----------------------------------------------------------------------------------------

def test_loss_masks_stored_as_int64_float32_or_bool_import_as_one_int64_mask(tmp_path) -> None:
    folder = tmp_path / "features"
    folder.mkdir()
    masks = [torch.tensor([0, 1, 1]), torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([True, False])]
    for i, mask in enumerate(masks):
        torch.save(feature_sample(len(mask), mask=mask), folder / f"data_{i}.ckpt")
    done = cli("import", "specforge-ckpt", str(folder), "-o", str(tmp_path / "t.h5"))
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout and "9 rows from 3 files" in done.stdout
    with td.open_trace(tmp_path / "t.h5") as trace:
        for i, mask in enumerate(masks):
            rows = trace.rows("train.loss_mask", request=f"data_{i}")
            assert rows.numpy().dtype == np.int64 and rows.numpy().tolist() == mask.long().tolist()


def test_a_loss_mask_that_is_not_whole_numbers_and_features_at_odds_with_earlier_files_are_one_line(
        tmp_path) -> None:
    cases = {"weights": [feature_sample(3, mask=torch.tensor([0.5, 1.0, 0.0]))],
             "nan": [feature_sample(2, mask=torch.tensor([float("nan"), 1.0]))],
             "width": [feature_sample(3, width=12), feature_sample(3, width=24)],
             "dtype": [feature_sample(3), {**feature_sample(3), "hidden_state": torch.randn(1, 3, 4).half()}]}
    for case, samples in cases.items():
        folder = tmp_path / case
        folder.mkdir()
        for i, data in enumerate(samples):
            torch.save(data, folder / f"data_{i}.ckpt")
        out = tmp_path / f"{case}.h5"
        line = one_error_line(cli("import", "specforge-ckpt", str(folder), "-o", str(out)))
        last = folder / f"data_{len(samples) - 1}.ckpt"
        assert line.startswith(f"error: {last}: "), line
        assert {"weights": "loss_mask holds values that are not whole numbers (torch.float32)",
                "nan": "loss_mask holds values that are not whole numbers",
                "width": "target.aux: ", "dtype": "target.final_hidden: float16"}[case] in line
        assert not out.exists()


# --- records larger than the recorder's queue -----------------------------------------------------

QUEUE = 1 << 20  # the importers' recorder bound in these tests: each record below is larger


def test_a_specforge_sample_larger_than_the_queue_is_written_whole(tmp_path) -> None:
    folder = tmp_path / "features"
    folder.mkdir()
    big = feature_sample(600, width=768)  # aux: 600 x 768 fp32, 1.8 MB, as 10,500 x 12,288 bf16 is at 256 MiB
    torch.save(big, folder / "data_0.ckpt")
    torch.save(feature_sample(5, width=768), folder / "data_1.ckpt")  # and a small one after it
    assert big["aux_hidden_state"].nbytes > QUEUE
    done = import_specforge_ckpt(folder, tmp_path / "t.arrow", queue_bytes=QUEUE)
    assert (done.files, done.rows) == (2, 605)
    with td.open_trace(tmp_path / "t.arrow") as trace:
        aux = trace.rows("target.aux", request="data_0")
        assert np.array_equal(aux.numpy(), big["aux_hidden_state"][0].numpy())
        assert len(trace.rows("target.final_hidden")) == 605
        assert trace.finals[0]["dropped_records"] == 0


def test_an_sglang_logits_dump_larger_than_the_queue_is_written_whole(tmp_path) -> None:
    logits = torch.randn(2, 160_000)  # 2 requests' last-token logits, 1.28 MB (600 x 128,256 fp32 in life)
    assert logits.nbytes > QUEUE
    run = tmp_path / "dumps" / "run0"
    sglang_forward(run, {"non_intrusive__logits_processor.output.next_token_logits": logits,
                         "custom": torch.ones(7, 2)}, rids=("req-a", "req-b"), lengths=(4, 3))
    done = import_sglang_dump(tmp_path / "dumps", tmp_path / "s.h5", queue_bytes=QUEUE)
    assert (done.files, done.skipped) == (6, 0)
    with td.open_trace(tmp_path / "s.h5") as trace:
        rows = trace.rows("target.logits")
        assert np.array_equal(rows.numpy(), logits.numpy())
        assert list(rows.request) == ["req-a", "req-b"] and rows.position.tolist() == [3, 2]
        assert len(trace.rows("sglang.custom")) == 7
        assert trace.finals[0]["dropped_records"] == 0


# --- what the importers' fuzz found (tests/test_fuzz.py) -------------------------------------------

def test_an_sglang_step_with_empty_input_ids_or_positions_imports_keyed_by_position(tmp_path) -> None:
    for case, fields in {"ids": {"input_ids": torch.empty(0, dtype=torch.long)},
                         "positions": {"positions": torch.empty(0, dtype=torch.long)}}.items():
        run = tmp_path / case / "run0"
        sglang_forward(run, {"custom": torch.ones(4, 2)})
        for name, value in fields.items():  # the core field rewritten empty
            path = next(run.glob(f"*___name={name}.pt"))
            torch.save({**torch.load(path, weights_only=True), "value": value}, path)
        done = cli("import", "sglang-dump", str(tmp_path / case), "-o", str(tmp_path / f"{case}.h5"))
        assert done.returncode == 0 and not done.stderr, done.stderr
        with td.open_trace(tmp_path / f"{case}.h5") as trace:
            assert trace.rows("sglang.custom").position.tolist() == [0, 1, 2, 3]


def test_sglang_request_ids_and_names_that_are_not_valid_unicode_import_escaped(tmp_path) -> None:
    run = tmp_path / "dumps" / "run0"
    sglang_forward(run, {"custom": torch.ones(4, 2)}, rids=("caf\udce9",))
    done = cli("import", "sglang-dump", str(tmp_path / "dumps"), "-o", str(tmp_path / "s.h5"))
    assert done.returncode == 0 and not done.stderr, done.stderr
    with td.open_trace(tmp_path / "s.h5") as trace:
        assert set(trace.rows("sglang.custom").request) == {"caf\\udce9"}


def test_specforge_input_ids_that_are_not_integers_and_hidden_states_without_a_width_are_one_line(
        tmp_path) -> None:
    cases = {"complex ids": {"input_ids": torch.ones(3, dtype=torch.complex64)},
             "bool ids": {"input_ids": torch.ones(3, dtype=torch.bool)},
             "flat hidden": {"hidden_state": torch.randn(3)},
             "no width": {"aux_hidden_state": torch.zeros(1, 3, 0)}}
    for case, edit in cases.items():
        folder = tmp_path / case.replace(" ", "_")
        folder.mkdir()
        torch.save({**feature_sample(3), **edit}, folder / "data_0.ckpt")
        line = one_error_line(cli("import", "specforge-ckpt", str(folder), "-o", str(tmp_path / "t.h5")))
        assert {"complex ids": "input_ids is not an integer tensor",
                "bool ids": "input_ids is not an integer tensor",
                "flat hidden": "hidden_state has shape [3], not [1, L, width]",
                "no width": "aux_hidden_state has shape [1, 3, 0], not [1, L, width]"}[case] in line, line
        assert not (tmp_path / "t.h5").exists()
