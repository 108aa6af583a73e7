"""The "gradlog" tab in TensorBoard: the verdict, the findings tables and a per-tensor heatmap.

Registered through TensorBoard's `tensorboard_plugins` entry point (pyproject.toml), so a plain
`tensorboard --logdir runs` lists it. It reads only what TensorBoard has already loaded, through
`context.data_provider`, so it shows a run while training is still writing it. This module imports
tensorboard; nothing on gradlog's training path imports it.
"""

from __future__ import annotations

import json
import mimetypes
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tensorboard import errors
from tensorboard.backend import http_util
from tensorboard.context import RequestContext
from tensorboard.data import provider
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from gradlog.runformat.markdown import parse_markdown_table
from gradlog.runformat.names import ORDER_TAG, PACK_TAG, PLUGIN_NAME, RUN, SUMMARY, TABLE_SUFFIX
from gradlog.runformat.rundata import summary_dict
from gradlog.runformat.tags import TENSORS
from gradlog.views.tensorboard_plugin import data

STATIC = os.path.join(os.path.dirname(__file__), "static")
#: More points than TensorBoard keeps per tag (it samples at load time): ask for all of them.
_ALL = 1_000_000


class GradlogPlugin(base_plugin.TBPlugin):  # type: ignore[misc]  # tensorboard ships no type hints
    """Serves `index.js` and the data routes `/runs`, `/overview`, `/heatmap`, `/series`."""

    plugin_name = PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext) -> None:
        self._provider = context.data_provider

    def get_plugin_apps(self) -> dict[str, Any]:
        return {
            "/index.js": _wsgi(self._static),
            "/runs": _wsgi(self._runs_route),
            "/overview": _wsgi(self._overview_route),
            "/heatmap": _wsgi(self._heatmap_route),
            "/series": _wsgi(self._series_route),
        }

    def is_active(self) -> bool:
        """Active when any run has gradlog's per-tensor scalars (or its tensor order record)."""
        if self._provider is None:
            return False
        return bool(self._runs(RequestContext(), ""))

    def data_plugin_names(self) -> tuple[str, ...]:
        return (PLUGIN_NAME,)  # the tensor-order record: TensorBoard then knows without asking is_active

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="gradlog")

    # --- reading ---------------------------------------------------------------------------------
    def _runs(self, ctx: RequestContext, eid: str) -> list[str]:
        listing = self._provider.list_scalars(ctx, experiment_id=eid, plugin_name="scalars")
        out = [run for run, tags in listing.items() if data.has_tensor_series(list(tags))]
        return sorted(out)

    def _scalar_tags(self, ctx: RequestContext, eid: str, run: str) -> list[str]:
        listing = self._provider.list_scalars(
            ctx, experiment_id=eid, plugin_name="scalars", run_tag_filter=provider.RunTagFilter(runs=[run])
        )
        if run not in listing:
            raise errors.NotFoundError(f"no gradlog data for run {run!r}")
        return list(listing[run])

    def _read(self, ctx: RequestContext, eid: str, run: str, tags: Sequence[str]) -> dict[str, list[tuple[int, float]]]:
        if not tags:
            return {}
        got = self._provider.read_scalars(
            ctx,
            experiment_id=eid,
            plugin_name="scalars",
            downsample=_ALL,
            run_tag_filter=provider.RunTagFilter(runs=[run], tags=list(tags)),
        )
        return {tag: [(d.step, d.value) for d in points] for tag, points in got.get(run, {}).items()}

    def _by_name(
        self, series: Mapping[str, list[tuple[int, float]]], prefix: str
    ) -> dict[str, list[tuple[int, float]]]:
        """`{tensor name: points}` of the tags starting with `prefix` (`weights/grad_norm/`, see data.metric_prefix)."""
        return {t[len(prefix) :]: pts for t, pts in series.items() if t.startswith(prefix)}

    def _order(self, ctx: RequestContext, eid: str, run: str) -> list[str]:
        text = self._last_text(ctx, eid, run, PLUGIN_NAME, [ORDER_TAG]).get(ORDER_TAG)
        return text.split("\n") if text else []

    def _last_text(
        self, ctx: RequestContext, eid: str, run: str, plugin: str, tags: Sequence[str] | None
    ) -> dict[str, str]:
        listing = self._provider.list_tensors(
            ctx, experiment_id=eid, plugin_name=plugin, run_tag_filter=provider.RunTagFilter(runs=[run], tags=tags)
        )
        wanted = list(listing.get(run, {}))
        if not wanted:
            return {}
        got = dict(_tensors(self._provider, ctx, eid, plugin, 1, provider.RunTagFilter(runs=[run], tags=wanted)))
        if not got:  # a damaged tag: read them one at a time, so that it loses itself and not the others
            for tag in wanted:
                one = _tensors(self._provider, ctx, eid, plugin, 1, provider.RunTagFilter(runs=[run], tags=[tag]))
                got = {run: {**got.get(run, {}), **one.get(run, {})}}
        out = {}
        for tag, points in got.get(run, {}).items():
            if points and points[-1].numpy.size:
                value = points[-1].numpy
                raw = value.item() if value.shape == () else value.reshape(-1)[0]
                out[tag] = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        return out

    def _packed(
        self, ctx: RequestContext, eid: str, run: str, names: list[str]
    ) -> tuple[list[int], dict[str, Any]] | None:
        """The per-step packed rows gradlog's writer adds (one small tensor per step), or None for runs
        without them (written by another writer or an older gradlog): then the scalars are read."""
        listing = self._provider.list_tensors(
            ctx, experiment_id=eid, plugin_name=PLUGIN_NAME, run_tag_filter=provider.RunTagFilter(runs=[run])
        )
        tags = [t for t in listing.get(run, {}) if t.startswith(PACK_TAG)]
        if not tags or not names:
            return None
        got = _tensors(self._provider, ctx, eid, PLUGIN_NAME, _ALL, provider.RunTagFilter(runs=[run], tags=tags))
        points = [(d.step, d.numpy) for pts in got.get(run, {}).values() for d in pts]
        if not points:  # unreadable (a damaged event file): the per-tensor scalars say the same, slower
            return None
        return data.packed_matrices(points, len(names))

    def _tables(self, ctx: RequestContext, eid: str, run: str) -> dict[str, data.Table]:
        out: dict[str, data.Table] = {}
        for tag, text in self._last_text(ctx, eid, run, "text", None).items():
            if not tag.startswith(RUN):
                continue
            name = tag[len(RUN) :].removesuffix(TABLE_SUFFIX)
            try:
                out[name] = parse_markdown_table(text)
            except ValueError:
                continue
        return out

    # --- routes ----------------------------------------------------------------------------------
    def _static(self, request: wrappers.Request) -> wrappers.Response:
        name = os.path.basename(request.path)
        with open(os.path.join(STATIC, name), "rb") as f:
            body = f.read()
        mime = "text/javascript" if name.endswith(".js") else mimetypes.guess_type(name)[0] or "text/plain"
        return _respond(request, body, mime)

    def _runs_route(self, request: wrappers.Request) -> wrappers.Response:
        ctx, eid = _ctx(request)
        return _respond(request, self._runs(ctx, eid), "application/json")

    def _overview_route(self, request: wrappers.Request) -> wrappers.Response:
        ctx, eid = _ctx(request)
        run = _arg(request, "run")
        tags = self._scalar_tags(ctx, eid, run)
        order = self._order(ctx, eid, run)
        names = data.tensor_names(tags, order)
        run_level = self._read(ctx, eid, run, [t for t in tags if t.startswith(RUN)])
        packed = self._packed(ctx, eid, run, order)
        last_step = None
        if packed is not None:
            live = data.packed_live_marks(order, packed[1])
            last_step = packed[0][-1] if packed[0] else None
        else:
            heads = [data.metric_prefix(m) for m in ("update_ratio", "grad_norm", "grad_nonfinite")]
            series = self._read(ctx, eid, run, [t for t in tags if t.startswith(tuple(heads))])
            live = data.live_marks(names, *(self._by_name(series, h) for h in heads))
        tables = self._tables(ctx, eid, run)
        summary = summary_dict(tables.pop(SUMMARY.removeprefix(RUN), None))
        line, final = data.verdict(summary, run_level, live, last_step, tables)
        report = data.closed(tables, summary)
        # what a person reads: one row, one finding per cause (the records stay per tensor in the run files)
        shown = {**tables, **data.grouped_tables(report)} if report is not None else tables
        body = {
            "run": run,
            "verdict": line,
            "final": final,
            "summary": summary,
            "tables": {k: {"columns": c, "rows": r} for k, (c, r) in shown.items()},
            "titles": data.table_titles(),
            "findings": [] if report is None else data.findings(report),
            "marks": data.marks(tables, summary, live),
            "names": names,
            "metrics": [m for m in data.METRICS if any(t.startswith(data.metric_prefix(m)) for t in tags)],
            "scales": data.METRICS,
            "run_level": {t: [pts[-1][0], _json_float(pts[-1][1])] for t, pts in run_level.items() if pts},
        }
        return _respond(request, json.dumps(body, allow_nan=False, default=str), "application/json")

    def _heatmap_route(self, request: wrappers.Request) -> wrappers.Response:
        ctx, eid = _ctx(request)
        run = _arg(request, "run")
        metric = request.args.get("metric", "update_ratio")
        if metric not in data.METRICS:
            raise errors.InvalidArgumentError(f"unknown metric {metric!r}; choose from {', '.join(data.METRICS)}")
        tags = self._scalar_tags(ctx, eid, run)
        order = self._order(ctx, eid, run)
        packed = self._packed(ctx, eid, run, order)
        if packed is not None:  # the fast path: one small tensor per step
            steps_p, mats = packed
            header = {"metric": metric, "scale": data.METRICS[metric], "names": order, "steps": steps_p}
            return _respond(request, data.encode(header, data.packed_heatmap(metric, mats)), "application/octet-stream")
        names = data.tensor_names(tags, order)
        head = data.metric_prefix(metric)
        values = self._by_name(self._read(ctx, eid, run, [t for t in tags if t.startswith(head)]), head)
        if metric == "grad_norm":
            steps, cells = data.heatmap(names, metric, values, values)
        else:
            n_steps = len({s for pts in values.values() for s, _ in pts})
            wanted = {n for n in names if data.needs_gradient(metric, values.get(n), n_steps)}
            ghead = data.metric_prefix("grad_norm")
            grad_tags = [t for t in tags if t.startswith(ghead) and t[len(ghead) :] in wanted]
            grad = self._by_name(self._read(ctx, eid, run, grad_tags), ghead)
            steps, cells = data.heatmap(names, metric, values, grad, wanted)
        header = {"metric": metric, "scale": data.METRICS[metric], "names": names, "steps": steps}
        return _respond(request, data.encode(header, cells), "application/octet-stream")

    def _series_route(self, request: wrappers.Request) -> wrappers.Response:
        ctx, eid = _ctx(request)
        run = _arg(request, "run")
        name = _arg(request, "name")
        metrics = (*data.METRICS, "weight_norm")
        wanted = {f"{TENSORS}{m}/{name}": m for m in metrics}
        series = self._read(ctx, eid, run, list(wanted))
        body = {wanted[t]: [[s, _json_float(v)] for s, v in pts] for t, pts in series.items()}
        return _respond(request, json.dumps(body, allow_nan=False), "application/json")


def _tensors(
    source: provider.DataProvider,
    ctx: RequestContext,
    eid: str,
    plugin: str,
    downsample: int,
    tags: provider.RunTagFilter,
) -> Mapping[str, Mapping[str, Sequence[Any]]]:
    """`read_tensors`, empty where TensorBoard cannot convert what a run file holds: its reader turns every
    point into an array as it is read, and a damaged or crafted tensor (a shape its values do not fill, a
    dtype it does not know) raises there. The tab then shows what else it has instead of an error 500."""
    try:
        got: Mapping[str, Mapping[str, Sequence[Any]]] = source.read_tensors(
            ctx, experiment_id=eid, plugin_name=plugin, downsample=downsample, run_tag_filter=tags
        )
    except (ValueError, TypeError):
        return {}
    return got


def _wsgi(handler: Callable[[wrappers.Request], wrappers.Response]) -> Callable[..., Any]:
    """A WSGI app from a request -> response method (what werkzeug's decorator does, with types)."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        return handler(wrappers.Request(environ))(environ, start_response)

    return app


def _respond(request: wrappers.Request, body: Any, mime: str) -> wrappers.Response:
    response: wrappers.Response = http_util.Respond(request, body, mime)
    return response


def _json_float(v: float) -> float | str:
    """JSON has no NaN/Inf: they travel as the strings "NaN", "Infinity", "-Infinity"."""
    if v != v:
        return "NaN"
    if v in (float("inf"), float("-inf")):
        return "Infinity" if v > 0 else "-Infinity"
    return v


def _ctx(request: wrappers.Request) -> tuple[RequestContext, str]:
    from tensorboard import plugin_util

    return RequestContext(), plugin_util.experiment_id(request.environ)


def _arg(request: wrappers.Request, key: str) -> str:
    value = request.args.get(key)
    if not value:
        raise errors.InvalidArgumentError(f"missing query parameter {key!r}")
    return str(value)


__all__ = ["GradlogPlugin"]
