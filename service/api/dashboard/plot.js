// A line chart on a canvas, drawn by hand (no library, nothing fetched: the service runs offline).
// plot(canvas, points) draws [[x, y], ...] and keeps them on the canvas as canvas.points: what was
// drawn, for whoever wants to check (the dashboard's browser test does).
"use strict";

function plot(canvas, points) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 360, h = canvas.clientHeight || 160;
  canvas.width = w * dpr; canvas.height = h * dpr;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const finite = points.filter(p => Number.isFinite(p[1]));
  canvas.points = finite;
  const pad = { l: 48, r: 8, t: 8, b: 20 };
  ctx.strokeStyle = "#d9dde6"; ctx.lineWidth = 1;
  ctx.strokeRect(pad.l, pad.t, w - pad.l - pad.r, h - pad.t - pad.b);
  if (!finite.length) {
    ctx.fillStyle = "#6b7385"; ctx.font = "12px system-ui"; ctx.fillText("no data yet", pad.l + 8, pad.t + 18);
    return;
  }
  let [x0, x1] = [finite[0][0], finite[finite.length - 1][0]];
  let y0 = Math.min(...finite.map(p => p[1])), y1 = Math.max(...finite.map(p => p[1]));
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const X = x => pad.l + (x - x0) / (x1 - x0) * (w - pad.l - pad.r);
  const Y = y => h - pad.b - (y - y0) / (y1 - y0) * (h - pad.t - pad.b);
  ctx.fillStyle = "#6b7385"; ctx.font = "11px system-ui";
  ctx.fillText(fmt(y1), 4, pad.t + 10); ctx.fillText(fmt(y0), 4, h - pad.b);
  ctx.fillText(String(finite[0][0]), pad.l, h - 4);
  ctx.fillText(String(finite[finite.length - 1][0]), w - pad.r - 24, h - 4);
  ctx.strokeStyle = "#3b6fe0"; ctx.lineWidth = 1.5; ctx.beginPath();
  finite.forEach(([x, y], i) => (i ? ctx.lineTo(X(x), Y(y)) : ctx.moveTo(X(x), Y(y))));
  ctx.stroke();
  if (finite.length === 1) { ctx.fillStyle = "#3b6fe0"; ctx.fillRect(X(finite[0][0]) - 2, Y(finite[0][1]) - 2, 4, 4); }
}

function fmt(v) { return Math.abs(v) >= 1000 || (Math.abs(v) < 0.01 && v !== 0) ? v.toExponential(1) : v.toFixed(3); }

function sparkline(values) {
  const bars = "▁▂▃▄▅▆▇█", finite = values.filter(Number.isFinite);
  if (!finite.length) return "";
  const lo = Math.min(...finite), hi = Math.max(...finite), span = (hi - lo) || 1;
  return finite.slice(-30).map(v => bars[Math.min(7, Math.round((v - lo) / span * 7))]).join("");
}
