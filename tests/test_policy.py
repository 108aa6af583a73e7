"""The policy: severities by kind and tensor-name pattern, set in code, recorded in the run, overridden on
the command line, and judged by the one judge everywhere (issue 28).

Read back with independent readers: TensorBoard's own EventAccumulator and the W&B offline run file
parsed by gradlog's reader (tests/test_wandb.py checks that reader against wandb's own records).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from catalogue import Recommender
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

import gradlog
from gradlog.cli.entry import main
from gradlog.readers.run import parse_markdown_table
from gradlog.verdict.judge import judge
from gradlog.verdict.policy import DEFAULTS, KINDS, SEVERITIES, Policy, table_markdown
from gradlog.verdict.report import PartlyUpdated, Reason, Report

DOCS = Path(__file__).resolve().parent.parent / "docs" / "verdict.md"


# --- bad input --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("rules", "match"),
    [
        (
            {"not_in_bach": "note"},
            r"unknown finding kind 'not_in_bach'; valid kinds: \*, never\.\*.*partly\.not_in_batch",
        ),
        ({"not_in_batch": "fatal"}, r"unknown severity 'fatal'; valid severities: problem, warning, note, ignore"),
        ({"not_in_batch:emb.[0-3": "note"}, r"malformed tensor-name pattern 'emb\.\[0-3'"),
        ({"not_in_batch:": "note"}, r"malformed tensor-name pattern ''"),
        ({"not_in_batch:a b": "note"}, r"malformed tensor-name pattern 'a b'"),
    ],
)
def test_bad_rules_name_the_culprit_and_the_valid_choices(rules: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Policy(rules)
    with pytest.raises(ValueError, match=match):
        gradlog.GradLogger(nn.Linear(2, 2), writer="memory", policy=rules, print_report=False)


def test_bad_cli_rule_exits_2_with_the_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path), "--ignore", "nonsense"]) == 2
    assert "unknown finding kind 'nonsense'" in capsys.readouterr().err
    assert main(["diff", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--fail-on", "zero_grad:[x"]) == 2
    assert "malformed tensor-name pattern '[x'" in capsys.readouterr().err


# --- the rules ----------------------------------------------------------------------------------------------
UNSEEN_WPE = PartlyUpdated("transformer.wpe.weight", 0, 1, 64, (63,), Reason.NOT_IN_BATCH, "position 63")
UNSEEN_ITEMS = PartlyUpdated("items.weight", 0, 5, 100, (1, 2, 3, 4, 5), Reason.NOT_IN_BATCH, "ids")


def report(policy: Policy | None = None) -> Report:
    return Report(
        partly_updated=[UNSEEN_WPE, UNSEEN_ITEMS],
        optimizer_steps=10,
        measured_steps=10,
        tracked_tensors=4,
        policy=policy,
    )


def test_defaults_notes_and_rules_by_kind_and_pattern() -> None:
    v = judge(report())
    assert v.healthy and v.text.endswith("(10 optimizer steps, 10 measured; 2 notes)")
    # a recommender: every item row must learn
    v = judge(report(Policy({"not_in_batch:items.*": "problem"})))
    assert not v.healthy and v.tally == "1 problem, 1 note"
    # silence the position row: left out of the line, kept in the table
    r = report(Policy(ignore=["not_in_batch:*.wpe.weight"]))
    v = judge(r)
    assert v.healthy and v.tally == "1 note" and "transformer.wpe.weight" in r.table()
    assert [f.name for f in v.of("ignore")] == ["transformer.wpe.weight"]
    # the last matching rule wins; full kinds, bare names, TABLE.* and * all match
    p = Policy([("*", "problem"), ("partly.*", "warning"), ("partly.not_in_batch:items.weight", "note")])
    assert p.severity("partly.not_in_batch", "items.weight") == "note"
    assert p.severity("partly.not_in_batch", "transformer.wpe.weight") == "warning"
    assert p.severity("never.frozen", "x") == "problem"
    # a pattern rule never matches a run-level finding
    assert Policy({"skipped_steps:x*": "problem"}).severity("run.skipped_steps") == "note"


def test_every_kind_has_a_severity_and_the_docs_table_is_the_code() -> None:
    assert all(DEFAULTS[k][0] in SEVERITIES[:3] and DEFAULTS[k][1] for k in KINDS)
    for reason in Reason:  # every reason of every table has a kind
        for table in ("never", "partly", "stalled"):
            assert f"{table}.{reason.value}" in DEFAULTS
    assert table_markdown() in DOCS.read_text()


# --- set in the logger, recorded in the run, read back, overridden -------------------------------------------
def train(writer: Any, log_dir: Path, policy: Any) -> gradlog.Report:
    torch.manual_seed(0)
    model = Recommender()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gl = gradlog.GradLogger(model, opt, writer=writer, log_dir=str(log_dir), policy=policy, print_report=False)
    for step in range(20):
        ids = torch.randint(0, 40, (16, 4))  # items 40-49 never in a batch
        model(ids).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        gl.log(step)
    return gl.close()


def report_json(path: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    code = main(["report", str(path), "--json", *flags])
    return code, json.loads(capsys.readouterr().out)


POLICY = {"not_in_batch:items.weight": "problem"}


def test_policy_round_trip_tensorboard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    default = train("tensorboard", tmp_path / "default", None)
    assert default.healthy and "1 note" in default.verdict  # ids no batch held: a note by default
    rep = train("tensorboard", tmp_path / "tb", POLICY)
    assert not rep.healthy and rep.partly_updated[0].name == "items.weight"
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    acc.Reload()  # TensorBoard's own reader: the policy table is in the run
    cols, rows = parse_markdown_table(acc.Tensors("gradlog/policy")[-1].tensor_proto.string_val[0].decode())
    assert cols == ["kind", "pattern", "severity"] and rows == [["not_in_batch", "items.weight", "problem"]]
    code, out = report_json(tmp_path / "tb", capsys)
    assert (code, out["healthy"], out["verdict"]) == (1, False, rep.verdict)  # judged from disk as close() did
    code, out = report_json(tmp_path / "tb", capsys, "--note", "not_in_batch")  # the command line wins
    assert (code, out["healthy"]) == (0, True) and out["verdict"].endswith("; 1 note)")
    code, out = report_json(tmp_path / "default", capsys, "--fail-on", "partly.not_in_batch:items.*")
    assert (code, out["healthy"]) == (1, False)


def test_policy_round_trip_wandb(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: Any) -> None:
    pytest.importorskip("wandb")
    for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    from gradlog.readers.wandb_offline import find_run_files, read_finished_run
    from gradlog.writers.wandb import WandbWriter

    root = tmp_path / "wb"
    rep = train(WandbWriter(project="gradlog-policy", log_dir=str(root), mode="offline"), root, POLICY)
    (run_file,) = find_run_files(root)
    s = read_finished_run(run_file).summary  # the offline run file, parsed back
    assert s["gradlog/verdict"] == rep.verdict and s["gradlog/healthy"] is False
    code, out = report_json(root, capsys)
    assert (code, out["verdict"]) == (1, rep.verdict)
    code, out = report_json(root, capsys, "--ignore", "not_in_batch:items.weight")
    assert code == 0 and out["healthy"] is True
