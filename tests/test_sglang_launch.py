"""The SGLang plugin under the launcher: a script that serves on CPU with SGLang's classes and no
recording code of its own, run with the environment ``tracediff record`` gives its child, writes the
trace that ``install`` writes in-process, with --requests / --match-prefix honoured."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from testbed.sglang_cpu import sglang_missing

if sglang_missing():
    pytest.skip(sglang_missing(), allow_module_level=True)

import torch  # noqa: E402

import tracediff as td  # noqa: E402
from testbed.sglang_cpu import CpuServer, tiny_checkpoint  # noqa: E402
from tests.conftest import run_cli  # noqa: E402

PROMPTS = [[5, 17, 42, 99], [9, 8, 7], [9, 8, 6, 5]]
RIDS = ["a", "b", "c"]
FILTERS = {"requests": 1, "match_prefix": (9, 8)}  # the first request starting 9, 8: b alone

SCRIPT = """
import json, sys
from testbed.sglang_cpu import CpuServer, tiny_checkpoint

target_dir, target_weights, draft_dir, draft_weights = tiny_checkpoint(sys.argv[1])
server = CpuServer(target_dir, target_weights, draft_dir, draft_weights, num_steps=2)
tokens = server.serve({prompts}, 3, rids={rids})
with open(sys.argv[2], "w") as f:
    json.dump(tokens, f)
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_launched_script_records_like_install(tmp_path):
    """Through the real CLI: the stand-in sits where SGLang's launcher would (``.../sglang/
    launch_server.py``), so ``tracediff record`` picks the SGLang plugin and checks CUDA graphs."""
    script = tmp_path / "sglang" / "launch_server.py"
    script.parent.mkdir()
    script.write_text(SCRIPT.format(prompts=PROMPTS, rids=RIDS))
    launched, tokens_file = tmp_path / "launched.h5", tmp_path / "tokens.json"
    serve = [sys.executable, str(script), str(tmp_path / "ckpt"), str(tokens_file), "--disable-cuda-graph"]
    done = run_cli("record", "--out", str(launched), "--requests", "1", "--match-prefix", "9,8", "--", *serve)
    assert done.returncode == 0, done.stderr[-3000:]
    assert str(launched) in done.stderr  # the summary names the file written

    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    direct = tmp_path / "direct.h5"
    with td.record(direct, source="serving") as rec:
        server = CpuServer(*ckpt, num_steps=2, recorder=rec, **FILTERS)
        assert server.serve(PROMPTS, 3, rids=RIDS) == json.loads(tokens_file.read_text())
        server.close()

    with td.open_trace(launched) as trace:
        assert trace.meta["source"] == "serving" and trace.meta["world_size"] == 1
        stated = trace.contract
        assert stated["tp_rank"] == 0 and stated["tp_size"] == 1
        assert stated["aux_layer_ids"] == [1, 3, 5] and stated["layers_to_capture"] == [2, 4, 6]
        for name in ("target.layer.7", "target.aux", "draft.fc_in", "draft.hidden", "draft.token_target"):
            assert set(trace.rows(name).request.tolist()) == {"b"}, name
        report = td.compare(direct, trace)
    assert report.verdict == "match", report.reasons
    assert report.coverage.fraction == 1.0
    assert not report.contract.differing


FAMILY_SCRIPT = """
import subprocess, sys
import torch

if len(sys.argv) > 3:  # the server: one process per family (as a server's ranks are), each loading its model
    workers = [subprocess.Popen([sys.executable, __file__, family, sys.argv[1] + "." + family + ".pt"])
               for family in sys.argv[2].split(",")]
    sys.exit(max(worker.wait() for worker in workers))

from testbed.sglang_families import family_bed

bed = family_bed(sys.argv[1])
model = bed.load()  # SGLang's loader: the registry's class, its load_weights (patched by the plugin)
model.set_eagle3_layers_to_capture([1, 2, 3])  # as SGLang's model runner does for an EAGLE-3 draft
served = bed.serve(model)
torch.save({"tokens": served.tokens, "hidden": bed.reference(served.tokens).hidden_states}, sys.argv[2])
"""
FAMILY_RECORDS = {  # family: (model class, layer pattern, what the aux holds for ids [1, 2, 3])
    "deepseek_v2": ("sglang.srt.models.deepseek_v2.DeepseekV3ForCausalLM", "boundary",
                    ["target.layer.1", "target.layer.2", "target.layer.3"]),  # the first id is 1: + 1
    "gemma3_causal": ("sglang.srt.models.gemma3_causal.Gemma3ForCausalLM", "classic",
                      ["target.layer.1.branch", "target.layer.2.branch", "target.layer.3.branch"]),
    "qwen3_moe": ("sglang.srt.models.qwen3_moe.Qwen3MoeForCausalLM", "boundary",
                  ["target.layer.1", "target.layer.2", "target.layer.3"]),  # by per-layer flags
}


@pytest.mark.slow
@pytest.mark.subprocess
def test_launcher_records_every_family(tmp_path):
    """Through the real CLI, a stand-in where SGLang's launcher sits starts one process per family,
    each loading its real model class through SGLang's loader: the plugin finds each class from its
    model file's registry entry (no list of families), every process writes its own file, and each
    contract names class, family and layer pattern, the states equal HF's hidden states and
    ``aux_slot_states`` says what each aux slot really holds."""
    script = tmp_path / "sglang" / "launch_server.py"
    script.parent.mkdir()
    script.write_text(FAMILY_SCRIPT)
    reference = tmp_path / "reference"
    serve = [sys.executable, str(script), str(reference), ",".join(FAMILY_RECORDS), "--disable-cuda-graph"]
    done = run_cli("record", "--out", str(tmp_path / "serve.h5"), "--", *serve)
    assert done.returncode == 0, done.stderr[-3000:]
    written = sorted(tmp_path.glob("serve*.h5"))
    assert len(written) == len(FAMILY_RECORDS), done.stderr[-3000:]  # serve.h5 and serve.pidN.h5
    seen = set()
    for path in written:
        with td.open_trace(path) as trace:
            stated = trace.contract
            family = stated["target_family"]
            model_class, pattern, slots = FAMILY_RECORDS[family]
            seen.add(family)
            assert stated["target_model_class"] == model_class and stated["target_layer_pattern"] == pattern
            assert stated["aux_layer_ids"] == [1, 2, 3] and stated["aux_slot_states"] == slots
            assert "sglang_recording_stopped" not in stated
            expected = torch.load(f"{reference}.{family}.pt", weights_only=True)
            for i in range(stated["target_num_layers"] - 1):  # HF's last hidden state is after the final norm
                rows = trace.rows(f"target.layer.{i}")
                assert sorted(rows.position.tolist()) == list(range(len(expected["tokens"])))
                np.testing.assert_allclose(rows.data, expected["hidden"][i + 1][rows.position].numpy(),
                                           rtol=1e-4, atol=1e-4, err_msg=f"{family} target.layer.{i}")
    assert seen == set(FAMILY_RECORDS)
