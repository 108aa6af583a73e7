"""Digest of the files a fixed-seed run writes, timestamps removed: to show a refactor changed no byte.

    python benchmarks/run_digest.py OUT.json           # run the demo model with TensorBoard + W&B offline
    python benchmarks/run_digest.py --compare A.json B.json [--rename OLD=NEW ...]

The run: the demo's five planted bugs, 24 steps, `every=2`, histograms, once with the TensorBoard writer
and once with W&B offline. TensorBoard values are read with TensorBoard's own loader and compared as
serialized `Summary.Value` protos per tag, in the order written (how many values share one `Event`
depends on the writer thread's timing, so events are flattened); gradlog's run ids inside table text
are replaced. W&B history items are compared by (`gradlog/step`, key) (how one step's items split into
rows, and W&B's own `_step` row counter, depend on the writer thread's timing); summary and config items
sorted by key (wandb-core writes a row's items in map order); all without wandb's clocks (`_timestamp`,
`_runtime`), artifact references and the tables' file names, sizes and hashes: the tables' own JSON files
are compared instead, run ids replaced.
Records wandb writes about itself (system stats, files, telemetry) are left out, and of the overview
images only the final one (the others are drawn when wall time allows). File names are
normalised (times, hostnames, pids and run ids replaced).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any


def _run(root: Path) -> None:
    import torch
    from torch import nn

    import gradlog
    from gradlog.cli.demo import build, freeze_by_mistake, scheduler

    os.environ["WANDB_MODE"] = "offline"
    os.environ["WANDB_SILENT"] = "true"
    os.environ["WANDB_DIR"] = str(root / "wandb_dir")
    (root / "wandb_dir").mkdir()
    for name in ("tensorboard", "wandb"):
        model, optimizer = build(0)
        steps = 24
        sched = scheduler(optimizer, steps)
        g = torch.Generator().manual_seed(1)
        xs = [torch.randn(32, 16, generator=g) for _ in range(steps)]
        ys = [torch.randint(0, 4, (32,), generator=g) for _ in range(steps)]
        writer: Any = (
            name
            if name == "tensorboard"
            else gradlog.Output("wandb", options={"project": "digest", "dir": str(root / "wandb_dir")})
        )
        gl = gradlog.GradLogger(model, optimizer, writer=writer, every=2, log_dir=str(root / name), print_report=False)
        freeze_by_mistake(model)  # after gradlog started: a suspect freeze, in the never-updated table
        for step in range(steps):
            loss = nn.functional.cross_entropy(model(xs[step]), ys[step])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sched.step()
            gl.log(step)
        gl.close()


_NAME_NOISE = [
    (re.compile(r"gradlog-run-\d{8}T\d{6}-\d+-\d+"), "gradlog-run-<id>"),
    (re.compile(r"\d{10}"), "<time>"),
    (re.compile(r"run-\d{8}_\d{6}-[a-z0-9]+"), "run-<id>"),
    (re.compile(r"run-[a-z0-9]{8}\.wandb"), "run-<id>.wandb"),
]


_RUN_ID = re.compile(rb"\d{8}T\d{6}-\d+-\d+|\b\d+-\d{9,}\b")  # gradlog's run ids: time-pid-n, pid-object id
OVERVIEW_PREFIX = "gradlog/overview"
_RUN_ID_TEXT = re.compile(_RUN_ID.pattern.decode())
#: records wandb writes about itself (clocks, hosts, files, its own output): not gradlog's bytes
_W_AND_B_OWN = {"files", "stats", "run", "telemetry", "environment", "exit", "final", "footer", "header"}
_W_AND_B_OWN |= {"output", "output_raw", "request", "preempting", "use_artifact", "artifact"}
_ARTIFACT = re.compile(r"wandb-client-artifact://[a-z0-9]+")


def _norm(rel: str) -> str:
    import socket

    rel = rel.replace(socket.gethostname(), "<host>")
    for pat, sub in _NAME_NOISE:
        rel = pat.sub(sub, rel)
    return re.sub(r"\.\d+\.\d+(\.|$)", r".<pid>\1", rel)


def _tb_digest(path: Path) -> list[str]:
    """One line per (tag, step, value) in tag order: how many values share an `Event` depends on the
    writer thread's timing, so events are flattened; the order of each tag's values is kept."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    out = []
    for e in LegacyEventFileLoader(str(path)).Load():  # TensorBoard's own reader, not gradlog's
        if e.HasField("summary"):
            for v in e.summary.value:
                if v.HasField("tensor") and v.tensor.string_val:
                    clean = [_RUN_ID.sub(b"<run id>", x) for x in v.tensor.string_val]
                    del v.tensor.string_val[:]
                    v.tensor.string_val.extend(clean)
                body = hashlib.sha256(v.SerializeToString(deterministic=True)).hexdigest()[:16]
                out.append(f"{v.tag}@{e.step}:{body}")
        elif not e.HasField("file_version"):
            e.wall_time = 0
            out.append(f"event@{e.step}:" + hashlib.sha256(e.SerializeToString(deterministic=True)).hexdigest()[:16])
    out = _last_overview(out)
    order = {line: i for i, line in enumerate(out)}
    return sorted(out, key=lambda line: (line.split("@")[0], order[line]))


def _last_overview(lines: list[str]) -> list[str]:
    """Only the final overview image: the ones during training are drawn at most every 20 s of wall time
    and skipped while a drawing runs (gradlog/writers/overview.py), so which steps have one is timing."""
    overview = [line for line in lines if line.startswith(OVERVIEW_PREFIX)]
    return [line for line in lines if not line.startswith(OVERVIEW_PREFIX)] + overview[-1:]


def _wandb_digest(path: Path) -> list[str]:
    from wandb.proto import wandb_internal_pb2

    from gradlog.readers.wandb_offline import read_chunks

    out: list[str] = []
    history: dict[tuple[str, str], str] = {}
    run_id = path.name[len("run-") : -len(".wandb")]  # gradlog's run_id in a W&B run is the W&B id
    data = path.read_bytes()  # wandb 0.31 ships no reader for its run files: gradlog's chunk reader
    for raw in read_chunks(data, []):
        r = wandb_internal_pb2.Record()
        r.ParseFromString(raw)
        kind = r.WhichOneof("record_type")
        if kind in ("history", "summary", "config"):
            body: Any = getattr(r, kind)
            items = []
            for it in body.item if kind == "history" else body.update:
                key = it.key or "/".join(it.nested_key)
                if key.endswith(("/sha256", "/size")) or (key.endswith("/path") and "media/table" in it.value_json):
                    continue  # a table's file name, size and hash: the table's own file is compared instead
                if key in ("_timestamp", "_runtime") or key.startswith("_wandb") or key.endswith("artifact_path"):
                    continue  # wandb's clocks and its artifact references (random ids, and the key in the path)
                value = _ARTIFACT.sub("<artifact>", _RUN_ID_TEXT.sub("<run id>", it.value_json))
                value = value.replace(f'"{run_id}"', '"<run id>"')
                items.append((key, value))
            if kind == "history":  # by (gradlog/step, key): how a step's items split into rows depends on timing
                step = dict(items).get("gradlog/step", "?")
                for key, value in items:
                    if key != "_step":  # W&B's own row counter
                        history[(step, key)] = value
                continue
            items.sort()  # wandb-core writes a row's items in map order, which varies from run to run
            out.append(kind + ":" + hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16])
        elif kind == "metric":
            out.append("metric:" + hashlib.sha256(r.metric.SerializeToString(deterministic=True)).hexdigest()[:16])
        elif kind not in _W_AND_B_OWN:
            out.append(str(kind))
    final = max((s for s, k in history if k.startswith(OVERVIEW_PREFIX)), key=_number, default=None)
    lines = [
        f"history@{s}:{k}:{hashlib.sha256(v.encode()).hexdigest()[:16]}"
        for (s, k), v in history.items()
        if not k.startswith(OVERVIEW_PREFIX) or s == final  # the final overview only: see _last_overview
    ]
    return sorted(lines) + out


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return -1.0


def digest(root: Path) -> dict[str, Any]:
    files: dict[str, Any] = {}
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        rel = _norm(str(p.relative_to(root)))
        if p.name.endswith(".table.json"):
            rel = re.sub(r"_[0-9a-f]{20}\.table\.json$", ".table.json", rel)
            data = _RUN_ID.sub(b"<run id>", p.read_bytes())
            for part in p.parts:  # a W&B run's id (gradlog's run_id there): its folder offline-run-<time>-<id>
                if part.startswith(("offline-run-", "run-")) and "-" in part[4:]:
                    data = data.replace(part.rsplit("-", 1)[1].encode(), b"<run id>")
            files[rel] = hashlib.sha256(data).hexdigest()[:16]
            continue
        if "wandb_dir" in rel and not p.name.endswith(".wandb"):
            continue  # W&B's own logs, metadata, media written by wandb
        if "tfevents" in p.name:
            files[rel] = _tb_digest(p)
        elif p.name.endswith(".wandb"):
            files[rel] = _wandb_digest(p)
        else:
            files[rel] = hashlib.sha256(p.read_bytes()).hexdigest()[:16]
    return files


def _renamed(d: dict[str, Any], renames: list[str]) -> dict[str, Any]:
    """`d` with each OLD=NEW replaced in file names and records: a deliberate rename between A and B."""
    pairs = [r.split("=", 1) for r in renames]

    def fix(text: str) -> str:
        for old, new in pairs:
            text = text.replace(old, new)
        return text

    return {fix(k): sorted(fix(x) for x in v) if isinstance(v, list) else v for k, v in d.items()}


def compare(a: dict[str, Any], b: dict[str, Any], renames: list[str] | None = None) -> int:
    if renames:
        a = _renamed(a, renames)
        b = {k: sorted(v) if isinstance(v, list) else v for k, v in b.items()}
    bad = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"only in {'A' if name in a else 'B'}: {name}")
            bad += 1
        elif a[name] != b[name]:
            if isinstance(a[name], list):
                diff = [i for i, (x, y) in enumerate(zip(a[name], b[name])) if x != y]
                print(f"differs: {name}: {len(a[name])} vs {len(b[name])} records, first differing record {diff[:5]}")
                for i in diff[:5]:
                    print("   ", a[name][i], "|", b[name][i])
            else:
                print(f"differs: {name}")
            bad += 1
        else:
            n = len(a[name]) if isinstance(a[name], list) else 1
            print(f"same: {name} ({n} records)")
    print("IDENTICAL" if not bad else f"{bad} files differ")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--compare", nargs=2)
    ap.add_argument("--rename", action="append", default=[], help="OLD=NEW: a deliberate rename in A (repeatable)")
    args = ap.parse_args()
    if args.compare:
        a, b = (json.loads(Path(p).read_text()) for p in args.compare)
        return compare(a, b, args.rename)
    with tempfile.TemporaryDirectory() as tmp:
        _run(Path(tmp))
        d = digest(Path(tmp))
    Path(args.out).write_text(json.dumps(d, indent=1))
    print(f"{len(d)} files, {sum(len(v) if isinstance(v, list) else 1 for v in d.values())} records -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
