// The gradlog tab: which tensors are not learning, and since when. Plain JavaScript, no build step,
// no network beyond this plugin's own routes (TensorBoard serves it from the gradlog wheel).
// Loaded by TensorBoard's plugin_entry.html, which calls render(); every path is relative to
// plugin/gradlog/ (the page's <base>).

const SPECIAL = {
  notMeasured: -1, // no value at that step
  noGrad: -2, // no gradient at that step
  zeroGrad: -3, // gradient exactly zero
};
const COLOURS = {
  notMeasured: [243, 243, 243],
  noGrad: [150, 150, 150],
  zeroGrad: [0, 0, 0],
  noUpdate: [68, 1, 84],
  nonfinite: [230, 0, 0],
};
const MARK_COLOURS = {
  never_updated: "#e60000",
  stalled: "#ff8c00",
  partly_updated: "#e0b000",
  stopped_slices: "#ff8c00",
  nonfinite: "#c800c8",
  no_update: "#ff8c00",
};
const MARK_TEXT = {
  never_updated: "never updated",
  stalled: "stopped learning",
  partly_updated: "partly updated",
  stopped_slices: "slices stopped",
  nonfinite: "NaN/Inf",
  no_update: "no update now",
};
const METRIC_TEXT = {
  update_ratio: "update ratio ‖Δw‖/‖w‖",
  grad_norm: "gradient norm",
  grad_zero_frac: "zero fraction of the gradient",
  grad_nonfinite: "NaN/Inf entries in the gradient",
  weight_norm: "weight norm ‖w‖",
};
const STOPS = [
  [59, 82, 139],
  [33, 145, 140],
  [94, 201, 98],
  [253, 231, 37],
];
const LABEL_W = 300; // px for row names left of the cells
const REFRESH_MS = 30000;

const CSS = `
body { font-family: Roboto, Arial, sans-serif; font-size: 13px; margin: 12px; color: #212121; }
#gl-bar { display: flex; gap: 12px; align-items: center; flex-wrap: wrap; margin-bottom: 8px; }
#gl-bar label { color: #616161; }
#gl-verdict { font-size: 15px; font-weight: 500; padding: 8px 10px; border-radius: 4px; margin-bottom: 10px; }
#gl-verdict.ok { background: #e8f5e9; } #gl-verdict.problem { background: #ffebee; }
#gl-verdict.provisional { background: #fff8e1; }
#gl-main { display: flex; gap: 16px; align-items: flex-start; }
#gl-left { flex: 0 0 auto; max-width: 62%; overflow: auto; max-height: 86vh; position: relative; }
#gl-right { flex: 1 1 0; min-width: 320px; }
#gl-canvas { cursor: crosshair; display: block; }
#gl-tip { position: fixed; pointer-events: none; background: rgba(33,33,33,.92); color: #fff; padding: 4px 7px;
  border-radius: 3px; font-size: 12px; display: none; z-index: 10; white-space: nowrap; }
#gl-legend { display: flex; gap: 10px; flex-wrap: wrap; align-items: center; margin: 6px 0; font-size: 12px; }
#gl-legend .sw { display: inline-block; width: 12px; height: 12px; vertical-align: middle; margin-right: 3px;
  border: 1px solid #ccc; }
#gl-scale { vertical-align: middle; }
/* A table wraps its long cells (and names at their dots) to fit the pane; what still does not fit
   scrolls inside its own box, never past the pane's right edge. */
.gl-scroll { max-width: 100%; overflow-x: auto; margin: 4px 0 14px; }
table.gl { border-collapse: collapse; font-size: 12px; }
table.gl th, table.gl td { border: 1px solid #ddd; padding: 3px 6px; text-align: left; vertical-align: top; }
table.gl th, table.gl td.short { white-space: nowrap; }
/* a heading or a key breaks only after its underscores (last_grad_step, dead_units), a list (rows, elements,
   columns) at its spaces: a table of many columns fits a narrow pane */
table.gl th.split, table.gl td.list { white-space: normal; }
table.gl td.long { min-width: 8em; overflow-wrap: anywhere; }
table.gl tr.sel td { background: #e3f2fd; }
table.gl details > summary { cursor: pointer; list-style: none; }
table.gl details > summary .more { color: #1565c0; white-space: nowrap; }
table.gl details[open] > summary { display: none; }
h3 { font-size: 13px; margin: 10px 0 2px; }
#gl-findings li { cursor: pointer; margin: 2px 0; }
#gl-findings .k { display: inline-block; min-width: 7.5em; font-weight: 500; }
#gl-series figure { margin: 0 0 6px; }
#gl-series figcaption { font-size: 11px; color: #616161; margin: 0 0 1px; }
#gl-series canvas { display: block; max-width: 100%; border: 1px solid #eee; }
.muted { color: #757575; }
`;

// A cell longer than this many characters shows its start and folds the rest behind a click: the indices of an
// embedding's unseen ids run to thousands of ranges, a wall of text that pushed every other table off the screen.
const FOLD_CHARS = 400;

function folded(text) {
  const s = String(text);
  if (s.length <= FOLD_CHARS) return s;
  const comma = s.lastIndexOf(", ", FOLD_CHARS - 80);
  const head = s.slice(0, comma > 0 ? comma : FOLD_CHARS - 80);
  const more = `… show all (${s.length.toLocaleString()} characters)`;
  return h("details", { class: "fold" },
    h("summary", {}, head, " ", h("span", { class: "more" }, more)), h("span", { class: "all" }, s));
}

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v);
  }
  for (const c of children) el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return el;
}

async function getJSON(path) {
  const r = await fetch(path);
  if (!r.ok) throw new Error(`${path}: HTTP ${r.status} ${await r.text()}`);
  return r.json();
}

// The binary heatmap: u32 header length, JSON header, padding, float32 cells (row-major).
async function getHeatmap(run, metric) {
  const r = await fetch(`heatmap?run=${encodeURIComponent(run)}&metric=${metric}`);
  if (!r.ok) throw new Error(`heatmap: HTTP ${r.status} ${await r.text()}`);
  const buf = await r.arrayBuffer();
  const n = new DataView(buf).getUint32(0, true);
  const header = JSON.parse(new TextDecoder().decode(new Uint8Array(buf, 4, n)));
  header.cells = new Float32Array(buf, 4 + n);
  return header;
}

function scaleColour(t) {
  t = Math.min(1, Math.max(0, t)) * (STOPS.length - 1);
  const i = Math.min(Math.floor(t), STOPS.length - 2);
  const f = t - i;
  const a = STOPS[i], b = STOPS[i + 1];
  return [a[0] + (b[0] - a[0]) * f, a[1] + (b[1] - a[1]) * f, a[2] + (b[2] - a[2]) * f];
}

function valueRange(cells, scale) {
  if (scale === "linear") return [0, 1];
  let lo = Infinity, hi = -Infinity;
  for (let i = 0; i < cells.length; i++) {
    const v = cells[i];
    if (v > 0 && v < Infinity) { if (v < lo) lo = v; if (v > hi) hi = v; }
  }
  if (!(lo <= hi)) return [1, 10];
  if (hi === lo) { lo /= 3.16; hi *= 3.16; }
  return [lo, hi];
}

function describe(v, metric) {
  if (Number.isNaN(v)) return "NaN";
  if (v === Infinity || v === -Infinity) return String(v);
  if (v === SPECIAL.notMeasured) return "not measured";
  if (v === SPECIAL.noGrad) return "no gradient";
  if (v === SPECIAL.zeroGrad) return "gradient exactly zero";
  if (metric === "update_ratio" && v === 0) return "0 (no update)";
  return Number(v).toPrecision(4);
}

function globToRegExp(pattern) {
  const p = pattern.trim();
  if (!p) return null;
  if (/[*?]/.test(p)) {
    const rx = p.replace(/[.+^${}()|[\]\\]/g, "\\$&").replace(/\*/g, ".*").replace(/\?/g, ".");
    return new RegExp(`^${rx}$`, "i");
  }
  return new RegExp(p.replace(/[.*+?^${}()|[\]\\]/g, "\\$&"), "i");
}

class Tab {
  constructor() {
    this.t0 = performance.now();
    this.state = { run: null, metric: "update_ratio", filter: "", selected: null };
    this.overview = null;
    this.heat = null;
    this.rows = []; // visible row indices into heat.names
    window.gradlog = this; // for scripts and tests: timings, state
  }

  async start() {
    document.head.append(h("style", {}, CSS));
    this.runSel = h("select", { id: "gl-run", onchange: () => this.load(this.runSel.value) });
    this.metricSel = h("select", { id: "gl-metric", onchange: () => this.loadHeatmap() });
    this.filterBox = h("input", {
      id: "gl-filter", type: "search", size: "28", placeholder: "filter rows: substring or glob (*.bias)",
      oninput: () => { this.state.filter = this.filterBox.value; this.applyFilter(); },
    });
    this.status = h("span", { id: "gl-status", class: "muted" });
    this.verdict = h("div", { id: "gl-verdict" }, "loading…");
    this.legend = h("div", { id: "gl-legend" });
    this.canvas = h("canvas", { id: "gl-canvas" });
    this.tip = h("div", { id: "gl-tip" });
    this.findings = h("div", { id: "gl-findings" });
    this.tables = h("div", { id: "gl-tables" });
    this.series = h("div", { id: "gl-series" });
    document.body.append(
      h("div", { id: "gl-bar" },
        h("label", {}, "run ", this.runSel), h("label", {}, "heatmap ", this.metricSel),
        this.filterBox, this.status),
      this.verdict,
      h("div", { id: "gl-main" },
        h("div", { id: "gl-left" }, this.legend, this.canvas),
        h("div", { id: "gl-right" }, this.series, this.findings, this.tables)),
      this.tip,
    );
    this.canvas.addEventListener("mousemove", (e) => this.hover(e));
    this.canvas.addEventListener("mouseleave", () => { this.tip.style.display = "none"; });
    this.canvas.addEventListener("click", (e) => {
      const cell = this.cellAt(e);
      if (cell) this.select(this.heat.names[cell.row]);
    });
    const runs = await getJSON("runs");
    if (!runs.length) {
      this.verdict.textContent = "No gradlog data yet: log a run with gradlog's TensorBoard writer.";
      return;
    }
    for (const r of runs) this.runSel.append(h("option", { value: r }, r));
    await this.load(runs[runs.length - 1]);
    setInterval(() => this.refresh(), REFRESH_MS); // training may still be writing
  }

  async load(run) {
    this.state.run = run;
    this.runSel.value = run;
    this.state.selected = null;
    this.series.replaceChildren();
    await this.refresh();
  }

  async refresh() {
    const run = this.state.run;
    try {
      const ov = await getJSON(`overview?run=${encodeURIComponent(run)}`);
      if (run !== this.state.run) return;
      this.overview = ov;
      this.showOverview();
      await this.loadHeatmap();
    } catch (err) {
      this.status.textContent = String(err);
    }
  }

  showOverview() {
    const ov = this.overview;
    const cls = !ov.final ? "provisional" : ov.verdict.includes(" OK") ? "ok" : "problem";
    this.verdict.className = cls;
    this.verdict.textContent = ov.verdict;
    const metrics = ov.metrics.length ? ov.metrics : ["update_ratio"];
    const keep = metrics.includes(this.state.metric) ? this.state.metric : metrics[0];
    this.metricSel.replaceChildren(...metrics.map((m) => h("option", { value: m }, METRIC_TEXT[m] || m)));
    this.metricSel.value = keep;
    this.state.metric = keep;
    // Findings: after close, one line per cause (a layer's units that died at one step, a layer left out of
    // the optimizer), naming the tensors it touches; before, one line per marked tensor. Strongest first, each
    // a link to its (first) tensor's row and series.
    const order = ["never_updated", "stalled", "stopped_slices", "partly_updated", "nonfinite", "no_update"];
    const list = h("ul", { id: "gl-marked" });
    const findings = ov.findings || [];
    const item = (name, kind, label, more) =>
      h("li", { "data-name": name, "data-kind": kind, onclick: () => this.select(name) },
        h("span", { class: "k", style: `color:${MARK_COLOURS[kind]}` }, MARK_TEXT[kind]), label,
        more ? h("span", { class: "muted" }, more) : "");
    let count = 0;
    if (findings.length) {
      const kinds = { precision: "partly_updated" };
      const sorted = [...findings].sort((a, b) =>
        order.indexOf(kinds[a.table] || a.table) - order.indexOf(kinds[b.table] || b.table));
      for (const f of sorted) {
        const more = f.tensors.length > 1 ? ` — ${f.touched.join(", ")}` : "";
        const label = f.where ? `${f.label} ${f.where}` : f.label; // which units, from when: causes of one layer differ
        list.append(item(f.tensors[0], kinds[f.table] || f.table, label, more));
      }
      for (const [name, kind] of Object.entries(ov.marks)) if (kind === "nonfinite") list.append(item(name, kind, name, ""));
      count = list.children.length;
    } else {
      const marked = Object.entries(ov.marks).sort((a, b) => order.indexOf(a[1]) - order.indexOf(b[1]));
      for (const [name, kind] of marked) list.append(item(name, kind, name, ""));
      count = marked.length;
    }
    this.findings.replaceChildren(h("h3", {}, count ? `Findings (${count})` : "Findings: none"), list);
    this.labels = Object.fromEntries(findings.map((f) => [f.label, f.tensors[0]]));
    const parts = [];
    for (const [key, title] of Object.entries(ov.titles)) { // the server's order and titles: the records' own
      const t = ov.tables[key];
      if (!t || !t.rows.length) continue; // an empty table says nothing the verdict does not
      parts.push(h("h3", {}, `${title} (${t.rows.length})`), this.table(key, t));
    }
    if (!ov.final) parts.push(h("p", { class: "muted" }, "Tables are written at close() (provisional ones during training)."));
    this.tables.replaceChildren(...parts);
  }

  table(key, t) {
    const long = new Set(["detail", "indices"]); // free text: wraps anywhere
    const cell = (c, column) => {
      if (long.has(column)) return h("td", { class: "long" }, folded(c));
      if (column === "name") return h("td", { class: "name" }, ...breakAtDots(String(c)));
      if (/, |_/.test(String(c))) return h("td", { class: "list" }, ...breakAfter(String(c), /(?<=_)/));
      return h("td", { class: "short" }, c);
    };
    const head = h("tr", {}, ...t.columns.map((c) => h("th", { class: "split" }, ...breakAfter(String(c), /(?<=_)/))));
    const rows = t.rows.map((r) => {
      const cellName = (r[t.columns.indexOf("name")] || "").split(" (= ")[0];
      const name = (this.labels && this.labels[cellName]) || cellName; // a cause's row: its first tensor
      return h("tr", { "data-name": name, onclick: () => name && this.select(name) },
        ...r.map((c, i) => cell(c, t.columns[i])));
    });
    return h("div", { class: "gl-scroll" }, h("table", { class: "gl", id: `gl-table-${key}` }, head, ...rows));
  }

  async loadHeatmap() {
    const run = this.state.run;
    this.state.metric = this.metricSel.value || this.state.metric;
    const heat = await getHeatmap(run, this.state.metric);
    if (run !== this.state.run) return;
    this.heat = heat;
    this.applyFilter();
    if (this.firstPaintMs === undefined) {
      this.firstPaintMs = performance.now() - this.t0;
      this.canvas.setAttribute("data-first-paint-ms", this.firstPaintMs.toFixed(1));
    }
    this.status.textContent =
      `${heat.names.length} tensors × ${heat.steps.length} measured steps` +
      (heat.steps.length ? ` (steps ${heat.steps[0]}–${heat.steps[heat.steps.length - 1]})` : "");
  }

  applyFilter() {
    if (!this.heat) return;
    const rx = globToRegExp(this.state.filter);
    this.rows = [];
    this.heat.names.forEach((n, i) => { if (!rx || rx.test(n)) this.rows.push(i); });
    this.draw();
  }

  // One pixel per cell into an ImageData, then scaled up once: a million cells cost one pass.
  draw() {
    const heat = this.heat, rows = this.rows, cols = heat.steps.length;
    if (!heat.range) heat.range = valueRange(heat.cells, heat.scale);
    const [lo, hi] = heat.range;
    const avail = Math.max(200, (window.innerWidth * 0.6) - LABEL_W - 20);
    this.cw = Math.max(1, Math.min(14, Math.floor(avail / Math.max(1, cols))));
    this.rh = Math.max(2, Math.min(16, Math.floor(900 / Math.max(1, rows.length))));
    const AXIS = 30; // step labels under the cells
    const RIGHT = 40; // room for the last step's label, centred under the last column
    const w = Math.max(LABEL_W + cols * this.cw + RIGHT, LABEL_W + 120), hgt = Math.max(1, rows.length) * this.rh + AXIS;
    const cv = this.canvas;
    cv.width = w; cv.height = hgt;
    // the legend wraps within the heatmap's width, so a small heatmap leaves the rest to the tables
    this.legend.style.maxWidth = `${Math.max(w, 360)}px`;
    const ctx = cv.getContext("2d");
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, w, hgt);
    if (cols && rows.length) {
      if (!heat.colours) heat.colours = this.colours(heat, lo, hi); // once per payload: filtering only copies rows
      const img = new ImageData(cols, rows.length);
      const px = new Uint32Array(img.data.buffer);
      for (let r = 0; r < rows.length; r++) px.set(heat.colours.subarray(rows[r] * cols, (rows[r] + 1) * cols), r * cols);
      const off = document.createElement("canvas");
      off.width = cols; off.height = rows.length;
      off.getContext("2d").putImageData(img, 0, 0);
      ctx.imageSmoothingEnabled = false;
      ctx.drawImage(off, LABEL_W, 0, cols * this.cw, rows.length * this.rh);
    }
    this.drawRows(ctx, rows, cols);
    this.drawAxis(ctx, rows, cols);
    this.drawLegend(lo, hi);
  }

  // Every cell's colour, one 32-bit RGBA word each, from a 256-entry table (log scale) or special colours.
  colours(heat, lo, hi) {
    const metric = heat.metric, scale = heat.scale;
    const px = new Uint32Array(heat.cells.length);
    const pack = (c) => (255 << 24) | (Math.round(c[2]) << 16) | (Math.round(c[1]) << 8) | Math.round(c[0]);
    const lut = new Uint32Array(256);
    for (let i = 0; i < 256; i++) lut[i] = pack(scaleColour(i / 255));
    const NONF = pack(COLOURS.nonfinite), NM = pack(COLOURS.notMeasured), NG = pack(COLOURS.noGrad);
    const ZG = pack(COLOURS.zeroGrad), ZERO = metric === "update_ratio" ? pack(COLOURS.noUpdate) : ZG;
    const COUNT0 = pack([214, 234, 214]);
    const llo = Math.log10(lo), inv = 255 / (Math.log10(hi) - llo);
    const cells = heat.cells;
    for (let i = 0; i < cells.length; i++) {
      const v = cells[i];
      let p;
      if (v !== v || v === Infinity || v === -Infinity) p = NONF;
      else if (v < 0) p = v === SPECIAL.notMeasured ? NM : v === SPECIAL.noGrad ? NG : ZG;
      else if (scale === "count") p = v > 0 ? NONF : COUNT0;
      else if (scale === "linear") p = lut[Math.min(255, Math.max(0, Math.round(v * 255)))];
      else if (v === 0) p = ZERO;
      else p = lut[Math.min(255, Math.max(0, Math.round((Math.log10(v) - llo) * inv)))];
      px[i] = p;
    }
    return px;
  }

  drawRows(ctx, rows, cols) {
    const heat = this.heat;
    // Row markers and names: every name when rows are tall enough, else only the marked ones.
    const marks = (this.overview && this.overview.marks) || {};
    ctx.font = `${Math.min(12, Math.max(9, this.rh - 2))}px Roboto, Arial, sans-serif`;
    ctx.textBaseline = "middle";
    let lastLabelY = -100;
    for (let r = 0; r < rows.length; r++) {
      const name = heat.names[rows[r]];
      const kind = marks[name];
      const y = r * this.rh;
      if (kind) {
        ctx.fillStyle = MARK_COLOURS[kind];
        ctx.fillRect(LABEL_W - 8, y, 6, Math.max(this.rh, 2));
      }
      if (name === this.state.selected) {
        ctx.strokeStyle = "#1565c0"; ctx.lineWidth = 1;
        ctx.strokeRect(LABEL_W + 0.5, y + 0.5, cols * this.cw - 1, Math.max(this.rh, 2) - 1);
      }
      const cy = y + this.rh / 2;
      if ((this.rh >= 9 || kind) && cy - lastLabelY >= 11) {
        ctx.fillStyle = kind ? MARK_COLOURS[kind] : "#424242";
        ctx.textAlign = "right";
        ctx.fillText(fit(ctx, name, LABEL_W - 14), LABEL_W - 12, cy);
        lastLabelY = cy;
      }
    }
  }

  drawAxis(ctx, rows, cols) {
    const heat = this.heat;
    // The step axis: a tick every ~90 px, the first and last step always.
    const y0 = rows.length * this.rh;
    ctx.fillStyle = "#616161"; ctx.strokeStyle = "#9e9e9e"; ctx.textAlign = "center"; ctx.textBaseline = "top";
    ctx.font = "11px Roboto, Arial, sans-serif";
    const every = Math.max(1, Math.ceil(90 / this.cw));
    this.axisLabels = [];
    for (let c = 0; c < cols; c++) {
      if (c % every && c !== cols - 1) continue;
      if (c === cols - 1 && c % every && (c % every) * this.cw < 45) continue;
      const x = LABEL_W + (c + 0.5) * this.cw;
      ctx.beginPath(); ctx.moveTo(x, y0); ctx.lineTo(x, y0 + 4); ctx.stroke();
      ctx.fillText(String(heat.steps[c]), x, y0 + 6);
      const half = ctx.measureText(String(heat.steps[c])).width / 2;
      this.axisLabels.push([String(heat.steps[c]), x - half, x + half]); // for tests: where each label lands
    }
    ctx.textAlign = "right";
    ctx.fillText("step", LABEL_W - 12, y0 + 6);
  }

  drawLegend(lo, hi) {
    const metric = this.heat.metric, scale = this.heat.scale;
    const sw = (rgb, text) => h("span", {}, h("span", { class: "sw", style: `background:rgb(${rgb.join(",")})` }), text);
    const bar = h("canvas", { id: "gl-scale", width: "120", height: "12" });
    const g = bar.getContext("2d");
    for (let x = 0; x < 120; x++) {
      const c = scale === "count" ? (x < 60 ? [214, 234, 214] : COLOURS.nonfinite) : scaleColour(x / 119);
      g.fillStyle = `rgb(${c.join(",")})`; g.fillRect(x, 0, 1, 12);
    }
    const fmt = (v) => Number(v).toExponential(1);
    const ends = scale === "log" ? [fmt(lo), fmt(hi) + " (log)"] : scale === "linear" ? ["0", "1"] : ["0", ">0"];
    const items = [h("span", {}, ends[0], " ", bar, " ", ends[1])];
    if (metric === "update_ratio") items.push(sw(COLOURS.noUpdate, "no update (0)"));
    items.push(sw(COLOURS.noGrad, "no gradient"), sw(COLOURS.zeroGrad, "exactly zero"),
      sw(COLOURS.nonfinite, "NaN/Inf"), sw(COLOURS.notMeasured, "not measured"));
    items.push(h("span", { class: "muted" }, "rows: tensors in model order; columns: measured steps; click a row"));
    this.legend.replaceChildren(...items);
  }

  cellAt(e) {
    if (!this.heat) return null;
    const rect = this.canvas.getBoundingClientRect();
    const x = e.clientX - rect.left, y = e.clientY - rect.top;
    const r = Math.floor(y / this.rh);
    if (r < 0 || r >= this.rows.length) return null;
    const c = x < LABEL_W ? -1 : Math.floor((x - LABEL_W) / this.cw);
    if (c >= this.heat.steps.length) return null;
    return { row: this.rows[r], col: c };
  }

  hover(e) {
    const cell = this.cellAt(e);
    if (!cell) { this.tip.style.display = "none"; return; }
    const name = this.heat.names[cell.row];
    const kind = this.overview && this.overview.marks[name];
    let text = name + (kind ? ` [${MARK_TEXT[kind]}]` : "");
    if (cell.col >= 0) {
      const v = this.heat.cells[cell.row * this.heat.steps.length + cell.col];
      text += ` · step ${this.heat.steps[cell.col]} · ${describe(v, this.heat.metric)}`;
    }
    this.tip.textContent = text;
    this.tip.style.left = `${e.clientX + 14}px`;
    this.tip.style.top = `${e.clientY + 10}px`;
    this.tip.style.display = "block";
  }

  async select(name) {
    this.state.selected = name;
    if (this.heat) this.draw();
    for (const tr of document.querySelectorAll("table.gl tr")) tr.classList.toggle("sel", tr.dataset.name === name);
    const data = await getJSON(`series?run=${encodeURIComponent(this.state.run)}&name=${encodeURIComponent(name)}`);
    const kind = this.overview && this.overview.marks[name];
    const parts = [h("h3", { id: "gl-series-title" }, name, kind ? ` — ${MARK_TEXT[kind]}` : "")];
    for (const metric of ["update_ratio", "grad_norm", "grad_zero_frac", "grad_nonfinite", "weight_norm"]) {
      if (data[metric]) parts.push(lineChart(metric, data[metric]));
    }
    this.series.replaceChildren(...parts);
  }
}

// A dotted tensor name as text pieces with a line-break chance after each dot
// (layers.0.block_sparse_moe.experts.3.w1.weight wraps between its parts, never inside one).
function breakAtDots(text) {
  return breakAfter(text, /(?<=\.)/);
}

// `text` as pieces split by `at` (a lookbehind: the separator stays on the left), with a line-break chance between.
function breakAfter(text, at) {
  const out = [];
  for (const piece of text.split(at)) {
    if (out.length) out.push(document.createElement("wbr"));
    out.push(piece);
  }
  return out;
}

function fit(ctx, text, width) {
  if (ctx.measureText(text).width <= width) return text;
  let lo = 0, hi = text.length;
  while (lo < hi) {
    const mid = Math.ceil((lo + hi) / 2);
    if (ctx.measureText("…" + text.slice(text.length - mid)).width <= width) lo = mid; else hi = mid - 1;
  }
  return "…" + text.slice(text.length - lo);
}

function num(v) {
  return v === "NaN" ? NaN : v === "Infinity" ? Infinity : v === "-Infinity" ? -Infinity : v;
}

// A small line chart under its title; log y for ratios and norms. Zeros sit on the bottom edge, NaN/Inf
// as red ticks.
function lineChart(metric, points) {
  const W = 420, H = 90, pad = 34;
  const cv = h("canvas", { width: String(W), height: String(H), "data-metric": metric });
  const panel = h("figure", { class: "gl-panel", "data-metric": metric },
    h("figcaption", {}, METRIC_TEXT[metric] || metric.replace(/_/g, " ")), cv);
  const g = cv.getContext("2d");
  const logY = metric === "update_ratio" || metric === "grad_norm" || metric === "weight_norm";
  const pts = points.map(([s, v]) => [s, num(v)]);
  const fin = pts.filter(([, v]) => Number.isFinite(v) && (!logY || v > 0)).map(([, v]) => v);
  let lo = fin.length ? Math.min(...fin) : 0, hi = fin.length ? Math.max(...fin) : 1;
  if (metric === "grad_zero_frac") { lo = 0; hi = 1; }
  if (metric === "grad_nonfinite") { lo = 0; hi = Math.max(1, hi); }
  if (logY) { lo = Math.log10(lo || 1e-12); hi = Math.log10(hi || 1); }
  if (hi === lo) { hi += 0.5; lo -= 0.5; }
  const zeros = logY && pts.some(([, v]) => v === 0);
  const s0 = pts.length ? pts[0][0] : 0, s1 = pts.length ? pts[pts.length - 1][0] : 1;
  const X = (s) => pad + ((s - s0) / Math.max(1, s1 - s0)) * (W - pad - 6);
  const bottom = zeros ? H - 22 : H - 12; // on a log axis, exact zeros get a row of their own below it
  const Y = (v) => {
    if (logY && v <= 0) return H - 13;
    const t = ((logY ? Math.log10(v) : v) - lo) / (hi - lo);
    return bottom - t * (bottom - 12);
  };
  g.fillStyle = "#fff"; g.fillRect(0, 0, W, H);
  g.fillStyle = "#616161"; g.font = "10px Roboto, Arial, sans-serif";
  g.fillText(logY ? Number(10 ** hi).toExponential(1) : Number(hi).toPrecision(2), 1, 22);
  g.fillText(logY ? Number(10 ** lo).toExponential(1) : Number(lo).toPrecision(2), 1, bottom);
  if (zeros) {
    g.fillStyle = "#440154"; g.fillText("0", 1, H - 10);
    g.strokeStyle = "#ddd"; g.setLineDash([3, 3]); g.beginPath(); g.moveTo(pad, H - 13); g.lineTo(W - 6, H - 13); g.stroke();
    g.setLineDash([]); g.fillStyle = "#616161";
  }
  g.fillText(String(s0), pad, H - 1); g.fillText(String(s1), W - 40, H - 1);
  g.strokeStyle = "#1565c0"; g.lineWidth = 1.2; g.beginPath();
  let open = false;
  for (const [s, v] of pts) {
    if (!Number.isFinite(v)) {
      g.save(); g.fillStyle = "#e60000"; g.fillRect(X(s) - 1, 12, 2, H - 24); g.restore();
      open = false; continue;
    }
    if (open) g.lineTo(X(s), Y(v)); else g.moveTo(X(s), Y(v));
    open = true;
  }
  g.stroke();
  if (zeros) {
    g.fillStyle = "#440154";
    for (const [s, v] of pts) if (v === 0) g.fillRect(X(s) - 1.5, H - 14.5, 3, 3);
  }
  return panel;
}

export async function render() {
  const tab = new Tab();
  try {
    await tab.start();
  } catch (err) {
    document.body.append(h("pre", { id: "gl-error" }, String(err && err.stack ? err.stack : err)));
  }
}
