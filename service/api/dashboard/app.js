// The dashboard: the service's own API, read with the key typed once (kept in this tab's
// sessionStorage, sent as a Bearer header, never in a URL). Pages by the URL's hash:
// #/jobs, #/jobs/<id>, #/files, #/graders, #/fleet (an operator key's). Live data comes from the
// API's event streams, read with fetch (EventSource cannot send a header), resumed after the last id
// when a connection drops.
"use strict";

const API = "/v1";
const CURVES = ["train_reward_mean", "kl", "loss", "entropy", "completion_length_mean", "valid_reward_mean"];
const FINAL = new Set(["succeeded", "failed", "cancelled"]);
const EXAMPLE_GRADER = {
  type: "string_check", name: "exact", input: "{{ sample.output_text }}",
  reference: "{{ item.answer }}", operation: "eq",
};
let page = null; // the open page's AbortController: its streams and timers end with it

// Helpers ------------------------------------------------------------------------------------------
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "onclick") node.addEventListener("click", v);
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c ?? "")));
  return node;
}

const key = () => sessionStorage.getItem("rloo-key");
const headers = extra => ({ Authorization: "Bearer " + key(), ...extra });

async function api(path, options = {}) {
  const json = options.body !== undefined && !(options.body instanceof FormData);
  const r = await fetch(API + path, {
    ...options,
    headers: headers(json ? { "Content-Type": "application/json" } : {}),
    body: json ? JSON.stringify(options.body) : options.body,
  });
  const body = await r.json().catch(() => ({}));
  if (r.status === 401) { sessionStorage.removeItem("rloo-key"); showLogin("That key is not valid on this server."); }
  if (!r.ok) throw new Error(body.error ? body.error.message : `${r.status} ${r.statusText}`);
  return body;
}

// A server-sent event stream: onMessage(data) for each message until [DONE] or the page closes.
async function follow(path, onMessage, signal) {
  let last = null;
  while (!signal.aborted) {
    try {
      const r = await fetch(API + path, { headers: headers(last ? { "Last-Event-ID": last } : {}), signal });
      if (!r.ok) return;
      const reader = r.body.getReader(), decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const lines = buffer.slice(0, cut).split("\n");
          buffer = buffer.slice(cut + 2);
          const id = lines.find(l => l.startsWith("id: "));
          const data = lines.filter(l => l.startsWith("data: ")).map(l => l.slice(6)).join("\n");
          if (!data) continue;
          if (data === "[DONE]") return;
          if (id) last = id.slice(4);
          onMessage(JSON.parse(data));
        }
      }
    } catch (e) {
      if (signal.aborted) return;
    }
    await new Promise(resolve => setTimeout(resolve, 1000)); // dropped: open it again after the last id
  }
}

function debounce(fn, ms) {
  let timer = null;
  return () => { clearTimeout(timer); timer = setTimeout(fn, ms); };
}

const time = t => (t ? new Date(t * 1000).toLocaleString() : "");
const main = () => document.getElementById("main");

function showError(where, error) {
  where.replaceChildren(el("p", { class: "error", text: String(error.message || error) }));
}

// Login --------------------------------------------------------------------------------------------
function showLogin(message = "") {
  document.getElementById("login").hidden = false;
  document.getElementById("login-error").textContent = message;
  main().replaceChildren();
  document.getElementById("signout").hidden = true;
}

document.getElementById("login").addEventListener("submit", async event => {
  event.preventDefault();
  sessionStorage.setItem("rloo-key", document.getElementById("key").value.trim());
  try {
    await api("/files?limit=1");
    document.getElementById("login").hidden = true;
    document.getElementById("key").value = "";
    route();
  } catch (e) {
    document.getElementById("login-error").textContent = String(e.message || e);
  }
});

document.getElementById("signout").addEventListener("click", () => {
  sessionStorage.removeItem("rloo-key");
  showLogin();
});

// Jobs ---------------------------------------------------------------------------------------------
async function jobsPage(signal) {
  const root = el("section", {}, el("h1", { text: "Jobs" }));
  main().replaceChildren(root);
  const table = el("table", { id: "jobs" });
  root.append(table);
  const draw = async () => {
    const jobs = (await api("/fine_tuning/jobs?limit=50")).data;
    const rows = await Promise.all(jobs.map(async job => {
      const series = (await api(`/fine_tuning/jobs/${job.id}/metrics`)).data;
      const headline = series.map(m => m.train_reward_mean ?? m.train_loss);
      const last = headline.length ? headline[headline.length - 1] : null;
      return el("tr", {},
        el("td", {}, el("a", { href: `#/jobs/${job.id}`, text: job.id })),
        el("td", { class: `status-${job.status}`, text: job.status }),
        el("td", { text: `${job.progress.step}/${job.progress.total_steps}` }),
        el("td", { text: job.model }),
        el("td", { text: job.method.type }),
        el("td", { text: last === null || last === undefined ? "" : last.toFixed(3) }),
        el("td", { class: "spark", text: sparkline(headline) }));
    }));
    table.replaceChildren(
      el("tr", {}, ...["job", "status", "step", "model", "method", "last reward / loss", "curve"].map(h => el("th", { text: h }))),
      ...rows);
  };
  await draw();
  const timer = setInterval(() => draw().catch(e => showError(root, e)), 5000);
  signal.addEventListener("abort", () => clearInterval(timer));
}

async function jobPage(jobId, signal) {
  const root = el("section");
  main().replaceChildren(root);
  const head = el("div");
  const charts = el("div", { class: "charts" });
  const series = Object.fromEntries(CURVES.map(name => [name, []]));
  const canvases = {};
  for (const name of CURVES) {
    canvases[name] = el("canvas", { "data-metric": name });
    charts.append(el("div", { class: "chart" }, el("h3", { text: name }), canvases[name]));
  }
  const events = el("div", { class: "events", id: "events" });
  const checkpoints = el("table", { id: "checkpoints" });
  const samples = el("table", { class: "samples", id: "samples" });
  const evaluation = evaluationPanel(jobId, signal);
  root.append(head, charts, el("h2", { text: "Events" }), events, el("h2", { text: "Checkpoints" }), checkpoints,
    el("h2", { text: "Evaluations" }), evaluation.panel, el("h2", { text: "What the reward looks like" }), samples);

  const refresh = async () => {
    const job = await api(`/fine_tuning/jobs/${jobId}`);
    const act = verb => async () => {
      try { await api(`/fine_tuning/jobs/${jobId}/${verb}`, { method: "POST" }); } catch (e) { alert(e.message); }
      refresh();
    };
    head.replaceChildren(
      el("h1", { text: job.id }),
      el("p", {}, el("span", { id: "status", class: `status-${job.status}`, text: job.status }),
        ` · step ${job.progress.step}/${job.progress.total_steps} · ${job.method.type} · ${job.model}`,
        job.fine_tuned_model ? ` → ${job.fine_tuned_model}` : ""),
      job.error ? el("p", { class: "error", text: job.error.message }) : "",
      el("p", {},
        el("button", { id: "cancel", onclick: act("cancel"), ...(FINAL.has(job.status) ? { disabled: "" } : {}) }, "Cancel"), " ",
        el("button", { id: "pause", onclick: act("pause"), ...(job.status !== "running" ? { disabled: "" } : {}) }, "Pause"), " ",
        el("button", { id: "resume", onclick: act("resume"), ...(job.status !== "paused" ? { disabled: "" } : {}) }, "Resume")));
    const ckpts = (await api(`/fine_tuning/jobs/${jobId}/checkpoints?limit=100`)).data;
    checkpoints.replaceChildren(
      el("tr", {}, ...["step", "model id", "created", ""].map(h => el("th", { text: h }))),
      ...ckpts.map(c => el("tr", {},
        el("td", { text: c.step_number }), el("td", { text: c.fine_tuned_model_checkpoint }), el("td", { text: time(c.created_at) }),
        el("td", {}, el("button", { onclick: () => download(jobId, c) }, "Download")))));
    // The newest recorded step: samples come every sample_interval steps (and at the last).
    const since = Math.max(0, job.progress.step - (job.hyperparameters.sample_interval || 1));
    const recorded = (await api(`/fine_tuning/jobs/${jobId}/samples?after_step=${since}&limit=100`)).data;
    const latest = recorded[recorded.length - 1];
    samples.replaceChildren(...(latest ? [
      el("tr", {}, el("th", { text: `step ${latest.step}: prompt` }), el("th", { text: "completion" }), el("th", { text: "reward" }), el("th", { text: "advantage" })),
      ...latest.groups.flatMap(g => g.completions.map((c, i) => el("tr", {},
        el("td", { text: i ? "" : g.prompt }), el("td", { text: c.text }),
        el("td", { text: c.reward === null ? "n/a" : c.reward.toFixed(3) }), el("td", { text: c.advantage === null ? "" : c.advantage.toFixed(3) })))),
    ] : [el("tr", {}, el("td", { text: "none recorded yet" }))]));
  };
  const later = debounce(() => refresh().catch(() => {}), 400);
  await refresh();
  evaluation.refresh();

  const redraw = debounce(() => { for (const name of CURVES) plot(canvases[name], series[name]); }, 100);
  redraw();
  follow(`/fine_tuning/jobs/${jobId}/metrics?stream=true`, row => {
    for (const name of CURVES) if (Number.isFinite(row[name])) series[name].push([row.step, row[name]]);
    redraw();
  }, signal);
  follow(`/fine_tuning/jobs/${jobId}/events?stream=true`, event => {
    events.prepend(el("div", { class: `level-${event.level}`, text: `${time(event.created_at)}  ${event.message}` }));
    later();
  }, signal);
}

// The job's newest evaluation (POST /fine_tuning/jobs/{id}/evaluations): a row a model, the starting
// model first; a file chosen here starts a new one on the server's inference workers.
function evaluationPanel(jobId, signal) {
  const files = el("select", { id: "eval-file" });
  const table = el("table", { id: "evaluations" });
  const state = el("p", { id: "eval-status" });
  const start = el("button", { id: "evaluate" }, "Evaluate checkpoints");
  const panel = el("div", {}, el("p", {}, "File ", files, " ", start), state, table);
  const num = v => (v === null || v === undefined ? "n/a" : v.toFixed(3));
  const refresh = async () => {
    if (!files.options.length) {
      const list = (await api("/files?limit=100")).data;
      files.replaceChildren(...list.map(f => el("option", { value: f.id, text: `${f.filename} (${f.id})` })));
    }
    const latest = (await api(`/fine_tuning/jobs/${jobId}/evaluations?limit=1`)).data[0];
    if (!latest) { state.textContent = "none yet"; table.replaceChildren(); return; }
    state.replaceChildren(el("span", { class: `status-${latest.status}`, text: latest.status }),
      ` · ${latest.id} · ${latest.progress.done}/${latest.progress.total} · ${latest.samples} lines of ${latest.file}`,
      latest.error ? el("span", { class: "error", text: ` · ${latest.error.message}` }) : "");
    const graders = Object.keys((latest.results[0] || {}).grader_means || {});
    table.replaceChildren(
      el("tr", {}, ...["model", "step", "reward", "± s.e.", ...graders, "length"].map(h => el("th", { text: h }))),
      ...latest.results.map(r => el("tr", {},
        el("td", { text: r.model }), el("td", { text: r.step_number === null ? "start" : r.step_number }),
        el("td", { class: "reward", text: num(r.reward_mean) }), el("td", { text: num(r.reward_std_error) }),
        ...graders.map(g => el("td", { text: num(r.grader_means[g]) })), el("td", { text: num(r.completion_length_mean) }))));
    return latest.status;
  };
  const watch = async () => {
    while (!signal.aborted && ["queued", "running"].includes(await refresh())) await new Promise(r => setTimeout(r, 1500));
  };
  start.onclick = async () => {
    try {
      await api(`/fine_tuning/jobs/${jobId}/evaluations`, {
        method: "POST", body: { file: files.value, checkpoints: "all", samples: 20 },
      });
    } catch (e) { alert(e.message); return; }
    watch().catch(() => {});
  };
  return { panel, refresh: () => watch().catch(() => {}) };
}

async function download(jobId, ckpt) {
  const r = await fetch(`${API}/fine_tuning/jobs/${jobId}/checkpoints/${ckpt.id}/content`, { headers: headers() });
  if (!r.ok) { alert(`download failed: ${r.status}`); return; }
  const url = URL.createObjectURL(await r.blob());
  const a = el("a", { href: url, download: `${jobId}-step-${ckpt.step_number}.tar` });
  document.body.append(a); a.click(); a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

// Files --------------------------------------------------------------------------------------------
async function filesPage() {
  const files = (await api("/files")).data;
  main().replaceChildren(el("h1", { text: "Files" }), el("table", { id: "files" },
    el("tr", {}, ...["id", "filename", "purpose", "bytes", "lines", "created"].map(h => el("th", { text: h }))),
    ...files.map(f => el("tr", {}, el("td", { text: f.id }), el("td", { text: f.filename }), el("td", { text: f.purpose }),
      el("td", { text: f.bytes }), el("td", { text: f.line_count ?? "" }), el("td", { text: time(f.created_at) })))));
}

// Fleet ---------------------------------------------------------------------------------------------
// The training workers (GET /v1/workers), for an operator's key; any other key sees the API's 403,
// which says how to get one.
async function fleetPage(signal) {
  const root = el("section", {}, el("h1", { text: "Fleet" }));
  main().replaceChildren(root);
  const table = el("table", { id: "fleet" });
  root.append(el("p", { text: "The training workers as they registered themselves, and the queues they consume." }), table);
  const draw = async () => {
    const workers = (await api("/workers")).data;
    table.replaceChildren(
      el("tr", {}, ...["worker", "host", "devices", "memory a device", "queues", "version", "started", "heartbeat", ""].map(h => el("th", { text: h }))),
      ...workers.map(w => el("tr", { class: w.live ? "live" : "stale" },
        el("td", { text: w.id }), el("td", { text: w.host }),
        el("td", { class: "devices", text: `${w.devices} x ${w.accelerator}` }),
        el("td", { text: w.memory_per_device_gib === null ? "" : `${w.memory_per_device_gib} GiB` }),
        el("td", { text: w.queues.join(", ") }), el("td", { text: w.version }),
        el("td", { text: time(w.started_at) }), el("td", { text: time(w.heartbeat_at) }),
        el("td", { class: w.live ? "status-succeeded" : "status-failed", text: w.live ? "live" : "stale" }))),
      ...(workers.length ? [] : [el("tr", {}, el("td", { text: "no worker has registered" }))]));
  };
  await draw();
  const timer = setInterval(() => draw().catch(e => showError(root, e)), 5000);
  signal.addEventListener("abort", () => clearInterval(timer));
}

// Grader playground --------------------------------------------------------------------------------
function gradersPage() {
  const grader = el("textarea", { id: "grader", rows: "9" });
  grader.value = JSON.stringify(EXAMPLE_GRADER, null, 2);
  const sample = el("textarea", { id: "sample", rows: "2" });
  sample.value = "Paris";
  const item = el("textarea", { id: "item", rows: "3" });
  item.value = JSON.stringify({ answer: "Paris" });
  const out = el("pre", { id: "result" });
  const run = async () => {
    out.textContent = "running…";
    try {
      const body = { grader: JSON.parse(grader.value), model_sample: sample.value, item: JSON.parse(item.value) };
      const r = await api("/fine_tuning/alpha/graders/run", { method: "POST", body });
      const flags = Object.entries(r.metadata.errors).filter(([, v]) => v === true).map(([k]) => k);
      out.textContent = `reward ${r.reward}\nsub_rewards ${JSON.stringify(r.sub_rewards)}\n` +
        (flags.length ? `errors: ${flags.join(", ")}` : "no errors");
    } catch (e) {
      out.textContent = String(e.message || e);
    }
  };
  main().replaceChildren(el("h1", { text: "Grader playground" }),
    el("p", { text: "A dry run of a grader on one sample and item (POST /v1/fine_tuning/alpha/graders/run)." }),
    el("h3", { text: "grader" }), grader, el("h3", { text: "sample (the completion)" }), sample,
    el("h3", { text: "item (the training line)" }), item, el("p", {}, el("button", { id: "run", onclick: run }, "Run")), out);
}

// Routing ------------------------------------------------------------------------------------------
async function route() {
  if (page) page.abort();
  page = new AbortController();
  if (!key()) { showLogin(); return; }
  document.getElementById("login").hidden = true;
  document.getElementById("signout").hidden = false;
  const [, section, id] = (location.hash || "#/jobs").split("/");
  try {
    if (section === "jobs" && id) await jobPage(id, page.signal);
    else if (section === "files") await filesPage();
    else if (section === "graders") gradersPage();
    else if (section === "fleet") await fleetPage(page.signal);
    else await jobsPage(page.signal);
  } catch (e) {
    showError(main(), e);
  }
}

window.addEventListener("hashchange", route);
route();
