// A line chart on a canvas, drawn by hand (no library, nothing fetched: the service runs offline).
// plot(canvas, points, options) draws [[x, y], ...] with axis titles (options.x, options.y) and, with
// no point to draw, options.empty ("no data yet" unless told why). It keeps what it drew on the canvas
// for whoever wants to check (the dashboard's browser tests do): canvas.points, and the attributes
// data-points (how many) and data-empty (the text shown instead). Hovering the canvas marks the
// nearest point and shows its x and y in a tip beside the chart.
"use strict";

const PLOT = { pad: { l: 64, r: 12, t: 10, b: 34 }, frame: "#d9dde6", text: "#6b7385", line: "#3b6fe0" };

function plot(canvas, points, options = {}) {
  canvas.points = points.filter(p => Number.isFinite(p[1]));
  canvas.plotOptions = options;
  canvas.dataset.points = String(canvas.points.length);
  canvas.dataset.empty = canvas.points.length ? "" : options.empty || "no data yet";
  if (!canvas.hoverable) hoverable(canvas);
  drawPlot(canvas);
}

// The chart itself; `marked`, a point of canvas.points, gets a guide line and a dot.
function drawPlot(canvas, marked = null) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 360, h = canvas.clientHeight || 180, pad = PLOT.pad;
  canvas.width = w * dpr; canvas.height = h * dpr;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  ctx.strokeStyle = PLOT.frame; ctx.lineWidth = 1;
  ctx.strokeRect(pad.l, pad.t, w - pad.l - pad.r, h - pad.t - pad.b);
  axisTitles(ctx, w, h, canvas.plotOptions);
  const finite = canvas.points;
  canvas.frame = null;
  if (!finite.length) {
    ctx.fillStyle = PLOT.text; ctx.font = "12px system-ui"; ctx.textAlign = "left";
    wrapText(ctx, canvas.dataset.empty, pad.l + 8, pad.t + 18, w - pad.l - pad.r - 16, 15);
    return;
  }
  let [x0, x1] = [finite[0][0], finite[finite.length - 1][0]];
  let y0 = Math.min(...finite.map(p => p[1])), y1 = Math.max(...finite.map(p => p[1]));
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const X = x => pad.l + (x - x0) / (x1 - x0) * (w - pad.l - pad.r);
  const Y = y => h - pad.b - (y - y0) / (y1 - y0) * (h - pad.t - pad.b);
  canvas.frame = { X, Y };
  ticks(ctx, w, h, X, Y, [finite[0][0], finite[finite.length - 1][0]], [y0, (y0 + y1) / 2, y1]);
  ctx.strokeStyle = PLOT.line; ctx.lineWidth = 1.5; ctx.beginPath();
  finite.forEach(([x, y], i) => (i ? ctx.lineTo(X(x), Y(y)) : ctx.moveTo(X(x), Y(y))));
  ctx.stroke();
  ctx.fillStyle = PLOT.line;
  if (finite.length === 1) ctx.fillRect(X(finite[0][0]) - 2, Y(finite[0][1]) - 2, 4, 4);
  if (marked) {
    ctx.strokeStyle = PLOT.frame; ctx.beginPath();
    ctx.moveTo(X(marked[0]), pad.t); ctx.lineTo(X(marked[0]), h - pad.b); ctx.stroke();
    ctx.beginPath(); ctx.arc(X(marked[0]), Y(marked[1]), 3.5, 0, 2 * Math.PI); ctx.fill();
  }
}

// "step" under the x axis, the metric's title up the y axis.
function axisTitles(ctx, w, h, options) {
  const pad = PLOT.pad;
  ctx.fillStyle = PLOT.text; ctx.font = "11px system-ui"; ctx.textAlign = "center";
  ctx.fillText(options.x || "step", pad.l + (w - pad.l - pad.r) / 2, h - 4);
  if (!options.y) return;
  ctx.save();
  ctx.translate(11, pad.t + (h - pad.t - pad.b) / 2);
  ctx.rotate(-Math.PI / 2);
  ctx.fillText(options.y, 0, 0);
  ctx.restore();
}

// Values at the ends of the x axis, and at the bottom, middle and top of the y axis (with grid lines).
function ticks(ctx, w, h, X, Y, xs, ys) {
  const pad = PLOT.pad;
  ctx.font = "11px system-ui"; ctx.fillStyle = PLOT.text; ctx.strokeStyle = "#eef0f4";
  ctx.textAlign = "right"; ctx.textBaseline = "middle";
  for (const y of ys) {
    ctx.fillText(fmt(y), pad.l - 4, Y(y));
    ctx.beginPath(); ctx.moveTo(pad.l + 1, Y(y)); ctx.lineTo(w - pad.r - 1, Y(y)); ctx.stroke();
  }
  ctx.textBaseline = "alphabetic";
  ctx.textAlign = "left"; ctx.fillText(String(xs[0]), pad.l, h - pad.b + 13);
  if (xs[1] !== xs[0]) { ctx.textAlign = "right"; ctx.fillText(String(xs[1]), w - pad.r, h - pad.b + 13); }
}

function wrapText(ctx, text, x, y, width, lineHeight) {
  let line = "";
  for (const word of text.split(" ")) {
    if (line && ctx.measureText(line + " " + word).width > width) {
      ctx.fillText(line, x, y); y += lineHeight; line = word;
    } else line = line ? line + " " + word : word;
  }
  ctx.fillText(line, x, y);
}

// Hover: the point nearest the pointer along x, marked, its values in a tip (".plot-tip", placed
// in the canvas's parent, which the stylesheet positions).
function hoverable(canvas) {
  canvas.hoverable = true;
  const tip = document.createElement("div");
  tip.className = "plot-tip";
  tip.hidden = true;
  canvas.after(tip);
  canvas.addEventListener("mousemove", event => {
    const point = nearest(canvas, event.offsetX);
    if (!point) { tip.hidden = true; return; }
    drawPlot(canvas, point);
    const { X, Y } = canvas.frame, name = canvas.plotOptions.name || canvas.plotOptions.y || "y";
    tip.textContent = `${canvas.plotOptions.x || "step"} ${point[0]} · ${name} ${fmtExact(point[1])}`;
    tip.hidden = false;
    const left = canvas.offsetLeft + X(point[0]), right = canvas.offsetLeft + canvas.clientWidth;
    tip.style.left = `${Math.min(left + 8, right - tip.offsetWidth)}px`;
    tip.style.top = `${canvas.offsetTop + Math.max(0, Y(point[1]) - 30)}px`;
  });
  canvas.addEventListener("mouseleave", () => { tip.hidden = true; drawPlot(canvas); });
}

function nearest(canvas, px) {
  if (!canvas.frame || !canvas.points.length) return null;
  let best = null;
  for (const p of canvas.points) {
    if (!best || Math.abs(canvas.frame.X(p[0]) - px) < Math.abs(canvas.frame.X(best[0]) - px)) best = p;
  }
  return best;
}

function fmt(v) { return Math.abs(v) >= 1000 || (Math.abs(v) < 0.01 && v !== 0) ? v.toExponential(1) : v.toFixed(3); }

function fmtExact(v) {
  return Math.abs(v) >= 1e5 || (Math.abs(v) < 1e-3 && v !== 0) ? v.toExponential(3) : String(Number(v.toPrecision(4)));
}

function sparkline(values) {
  const bars = "▁▂▃▄▅▆▇█", finite = values.filter(Number.isFinite);
  if (!finite.length) return "";
  const lo = Math.min(...finite), hi = Math.max(...finite), span = (hi - lo) || 1;
  return finite.slice(-30).map(v => bars[Math.min(7, Math.round((v - lo) / span * 7))]).join("");
}
