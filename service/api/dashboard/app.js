// The dashboard: the service's own API, read with the key typed once (kept in this tab's
// sessionStorage, sent as a Bearer header, never in a URL). Pages by the URL's hash:
// #/jobs, #/jobs/<id>, #/evals, #/evals/<id>, #/tinker, #/tinker/<run>, #/files, #/usage, #/graders, #/fleet (an operator key's). Live data comes from the
// API's event streams, read with fetch (EventSource cannot send a header), resumed after the last id
// when a connection drops.
"use strict";

const API = "/v1";
// What each method's job page charts: a chart a metric, with its y axis title; `valid`: measured on
// the validation file (none without one); `note`: how to read it, from the job's hyperparameters.
const CHARTS = {
  reinforcement: { columns: 3, charts: [
    { metric: "train_reward_mean", y: "reward" },
    { metric: "kl", y: "KL (nats)" },
    { metric: "loss", y: "loss", note: hp => onePassLossNote(hp) },
    { metric: "entropy", y: "entropy (nats/token)" },
    { metric: "completion_length_mean", y: "length (tokens)" },
    { metric: "valid_reward_mean", y: "reward", valid: true },
  ] },
  supervised: { columns: 2, charts: [
    { metric: "train_loss", y: "loss (nats/token)" },
    { metric: "train_mean_token_accuracy", y: "token accuracy" },
    { metric: "valid_loss", y: "loss (nats/token)", valid: true },
    { metric: "valid_mean_token_accuracy", y: "token accuracy", valid: true },
  ] },
  dpo: { columns: 3, charts: [
    { metric: "train_loss", y: "loss (-log σ(margin))" },
    { metric: "reward_margin", y: "reward margin" },
    { metric: "reward_accuracy", y: "pairs ranked right" },
    { metric: "valid_loss", y: "loss (-log σ(margin))", valid: true },
    { metric: "valid_reward_margin", y: "reward margin", valid: true },
    { metric: "valid_reward_accuracy", y: "pairs ranked right", valid: true },
  ] },
};
const FINAL = new Set(["succeeded", "failed", "cancelled"]);
const EXAMPLE_GRADER = {
  type: "string_check", name: "exact", input: "{{ sample.output_text }}",
  reference: "{{ item.answer }}", operation: "eq",
};
let page = null; // the open page's AbortController: its streams and timers end with it
let me = null; // GET /v1/me: the key's project and scopes; pages leave out what the key may not do
const can = scope => Boolean(me && me.scopes.includes(scope));

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

async function api(path, options = {}, base = API) {
  const json = options.body !== undefined && !(options.body instanceof FormData);
  const r = await fetch(base + path, {
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

// Who the key is: its project, and the nav links to what it may read (each link's data-scope).
async function whoami() {
  me = await api("/me");
  document.getElementById("whoami").textContent = `${me.project.name} · ${me.key.name || me.key.prefix + "…"}`;
  for (const link of document.querySelectorAll("nav a[data-scope]")) link.hidden = !can(link.dataset.scope);
}

document.getElementById("login").addEventListener("submit", async event => {
  event.preventDefault();
  sessionStorage.setItem("rloo-key", document.getElementById("key").value.trim());
  me = null;
  try {
    await whoami();
    document.getElementById("login").hidden = true;
    document.getElementById("key").value = "";
    route();
  } catch (e) {
    document.getElementById("login-error").textContent = String(e.message || e);
  }
});

document.getElementById("signout").addEventListener("click", () => {
  sessionStorage.removeItem("rloo-key");
  me = null;
  document.getElementById("whoami").textContent = "";
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
  let job = await api(`/fine_tuning/jobs/${jobId}`);
  const reinforcement = job.method.type === "reinforcement"; // only its steps record samples
  const root = el("section");
  main().replaceChildren(root);
  const head = el("div");
  const charts = jobCharts(job);
  const events = el("div", { class: "events", id: "events" });
  const checkpoints = el("table", { id: "checkpoints" });
  const samples = el("table", { class: "samples", id: "samples" });
  const evaluation = evaluationPanel(job, signal);
  const evalRuns = el("div", { id: "job-eval-runs" });
  root.append(head, charts.node, el("h2", { text: "Events" }), events, el("h2", { text: "Checkpoints" }), checkpoints,
    el("h2", { text: "Evaluations" }), evaluation.panel, el("h2", { text: "Eval runs of its models" }), evalRuns,
    ...(reinforcement ? [el("h2", { text: "What the reward looks like" }), samples] : []));

  const refresh = async () => {
    job = await api(`/fine_tuning/jobs/${jobId}`);
    showJobHead(head, job, refresh);
    charts.redraw(job);
    await showCheckpoints(checkpoints, job);
    if (reinforcement) await showSamples(samples, job);
  };
  const later = debounce(() => refresh().catch(() => {}), 400);
  await refresh();
  evaluation.refresh();
  showJobEvalRuns(evalRuns, job).catch(e => showError(evalRuns, e));

  follow(`/fine_tuning/jobs/${jobId}/metrics?stream=true`, row => charts.add(row), signal);
  follow(`/fine_tuning/jobs/${jobId}/events?stream=true`, event => {
    events.prepend(el("div", { class: `level-${event.level}`, text: `${time(event.created_at)}  ${event.message}` }));
    later();
  }, signal);
}

function showJobHead(head, job, refresh) {
  const act = verb => async () => {
    try { await api(`/fine_tuning/jobs/${job.id}/${verb}`, { method: "POST" }); } catch (e) { alert(e.message); }
    refresh();
  };
  const off = disabled => (disabled ? { disabled: "" } : {});
  head.replaceChildren(
    el("h1", { text: job.id }),
    el("p", {}, el("span", { id: "status", class: `status-${job.status}`, text: job.status }),
      ` · step ${job.progress.step}/${job.progress.total_steps} · `, el("span", { id: "method", text: job.method.type }),
      ` · ${job.model}`, job.fine_tuned_model ? ` → ${job.fine_tuned_model}` : ""),
    job.error ? el("p", { class: "error", text: job.error.message }) : "",
    can("jobs:write") ? el("p", {},
      el("button", { id: "cancel", onclick: act("cancel"), ...off(FINAL.has(job.status)) }, "Cancel"), " ",
      el("button", { id: "pause", onclick: act("pause"), ...off(job.status !== "running") }, "Pause"), " ",
      el("button", { id: "resume", onclick: act("resume"), ...off(job.status !== "paused") }, "Resume")) : "");
}

async function showCheckpoints(table, job) {
  const ckpts = (await api(`/fine_tuning/jobs/${job.id}/checkpoints?limit=100`)).data;
  table.replaceChildren(
    el("tr", {}, ...["step", "model id", "created", ""].map(h => el("th", { text: h }))),
    ...ckpts.map(c => el("tr", {},
      el("td", { text: c.step_number }), el("td", { text: c.fine_tuned_model_checkpoint }), el("td", { text: time(c.created_at) }),
      el("td", {}, el("button", { onclick: () => download(job.id, c) }, "Download")))));
}

// The newest recorded step of a reinforcement job: samples come every sample_interval steps (and at the last).
async function showSamples(table, job) {
  const since = Math.max(0, job.progress.step - (job.hyperparameters.sample_interval || 1));
  const recorded = (await api(`/fine_tuning/jobs/${job.id}/samples?after_step=${since}&limit=100`)).data;
  const latest = recorded[recorded.length - 1];
  const num = v => (v === null ? "n/a" : v.toFixed(3));
  table.replaceChildren(...(latest ? [
    el("tr", {}, el("th", { text: `step ${latest.step}: prompt` }), el("th", { text: "completion" }), el("th", { text: "reward" }), el("th", { text: "advantage" })),
    ...latest.groups.flatMap(g => g.completions.map((c, i) => el("tr", {},
      el("td", { text: i ? "" : g.prompt }), el("td", { text: c.text }),
      el("td", { text: num(c.reward) }), el("td", { text: c.advantage === null ? "" : c.advantage.toFixed(3) })))),
  ] : [el("tr", {}, el("td", { text: "none recorded yet" }))]));
}

// The job's charts, its method's (CHARTS): add(row) takes a metrics row as the stream brings it,
// redraw(job) draws again with the job as it now is (a finished job's empty chart says so).
function jobCharts(job) {
  const spec = CHARTS[job.method.type] || CHARTS.reinforcement;
  const node = el("div", { class: "charts", style: `--columns: ${spec.columns}` });
  const charts = spec.charts.map(chart => {
    const canvas = el("canvas", { "data-metric": chart.metric });
    const note = el("p", { class: "note", text: chartNote(chart, job) });
    node.append(el("div", { class: "chart" }, el("h3", { text: chart.metric }), canvas, note));
    return { ...chart, canvas, points: [] };
  });
  const draw = () => {
    for (const c of charts) plot(c.canvas, c.points, { x: "step", y: c.y, name: c.metric, empty: emptyText(c, job) });
  };
  const later = debounce(draw, 100);
  draw();
  return {
    node,
    add(row) {
      for (const c of charts) if (Number.isFinite(row[c.metric])) c.points.push([row.step, row[c.metric]]);
      later();
    },
    redraw(latest) { job = latest; later(); },
  };
}

// What a chart shows with no point to draw: why there can be none, or that there are none yet.
function emptyText(chart, job) {
  if (chart.valid && !job.validation_file) return "no validation file: nothing to measure this on";
  return FINAL.has(job.status) ? "no data: the job recorded none" : "no data yet";
}

// The line under a chart: why it stays empty, or how to read it.
function chartNote(chart, job) {
  if (chart.valid && !job.validation_file) {
    return `${chart.metric} is measured on the job's validation_file (every eval_interval steps and at the last); this job was created without one.`;
  }
  return chart.note ? chart.note(job.hyperparameters || {}) : "";
}

// A reinforcement job's loss with one pass over each batch (ppo_epochs 1): the importance ratio is
// exactly 1, and advantages that sum to zero within each group give a loss of about 0 (rounding,
// ~1e-9), whatever the gradient. Not so with token_mean (longer completions weigh more), plain
// REINFORCE, the KL as a loss term, or truncated completions masked out of the loss.
function onePassLossNote(hp) {
  const zeroSum = ["rloo", "grpo", "reinforce_mean"].includes(hp.advantage_estimator ?? "rloo");
  const onePass = (hp.ppo_epochs ?? 1) === 1 && (hp.loss_aggregation ?? "sequence_sum") !== "token_mean";
  if (!zeroSum || !onePass || hp.kl_in_reward === false || hp.mask_truncated_completions) return "";
  return "ppo_epochs is 1: each batch is used for one pass, where the importance ratio is exactly 1 and the " +
    "advantages of each group sum to zero, so this loss is about 0 (~1e-9) by construction. Its gradient is " +
    "not: the reward and KL curves show the learning.";
}

// The job's newest evaluation (POST /fine_tuning/jobs/{id}/evaluations): a row a model, the starting
// model first. On a reinforcement job a file chosen here starts a new one with the job's grader, on
// the server's inference workers; the picker offers the files an evaluation takes (fine-tune files of
// prompt lines, by the file objects' line_formats). A supervised or DPO job has no grader to score with.
function evaluationPanel(job, signal) {
  const files = el("select", { id: "eval-file" });
  const table = el("table", { id: "evaluations" });
  const state = el("p", { id: "eval-status" });
  const start = el("button", { id: "evaluate", disabled: "" }, "Evaluate checkpoints");
  const allowed = can("jobs:write") && can("files:read");
  const graded = job.method.type === "reinforcement" && allowed;
  const note = !allowed
    ? "This key may read evaluations, not start them (that takes the scopes jobs:write and files:read)."
    : `A ${job.method.type === "dpo" ? "DPO" : job.method.type} job trains without a grader, and an evaluation scores with one: start it through the API ` +
      `(POST /v1/fine_tuning/jobs/${job.id}/evaluations with a "grader" and a file of prompts).`;
  const panel = el("div", {}, graded ? el("p", {}, "File ", files, " ", start) : el("p", { class: "note", id: "eval-note", text: note }),
    state, table);
  const num = v => (v === null || v === undefined ? "n/a" : v.toFixed(3));
  let listed = false;
  const refresh = async () => {
    if (graded && !listed) { listed = true; await listEvaluationFiles(files, start, job); }
    const latest = (await api(`/fine_tuning/jobs/${job.id}/evaluations?limit=1`)).data[0];
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
      await api(`/fine_tuning/jobs/${job.id}/evaluations`, {
        method: "POST", body: { file: files.value, checkpoints: "all", samples: 20 },
      });
    } catch (e) { alert(e.message); return; }
    watch().catch(() => {});
  };
  return { panel, refresh: () => watch().catch(() => {}) };
}

// The files an evaluation can read: uploaded for fine-tuning, every line a prompt (a file stored
// before line formats were recorded holds prompts only). The job's validation file first.
async function listEvaluationFiles(select, start, job) {
  const prompts = f => f.purpose === "fine-tune" && Object.keys(f.line_formats || {}).every(k => k === "prompt");
  const usable = (await api("/files?limit=100")).data.filter(prompts);
  usable.sort((a, b) => (b.id === job.validation_file) - (a.id === job.validation_file));
  if (!usable.length) {
    select.replaceChildren(el("option", { value: "", text: "no file of prompts: upload one (a prompt a line)" }));
    select.disabled = true;
    return;
  }
  select.replaceChildren(...usable.map(f => el("option", { value: f.id, text: `${f.filename} (${f.id}, ${f.line_count} prompts)` })));
  start.disabled = false;
}

// Evals (OpenAI's Evals API) --------------------------------------------------------------------------
// An eval's runs side by side: a run a row, its pass rate overall and on each testing criterion,
// each drawn as a bar (the share of items that passed) beside its figure.
function passCell(passed, total) {
  if (!total) return el("td", { text: "-" });
  const share = passed / total;
  return el("td", { class: "pass", "data-share": share.toFixed(4) },
    el("span", { class: "bar" }, el("span", { class: "fill", style: `width:${(100 * share).toFixed(1)}%` })),
    ` ${(100 * share).toFixed(1)}%`);
}

function runsTable(runs, criteria, { evalName = null } = {}) {
  const head = [...(evalName ? ["eval"] : []), "run", "model", "status", "items", "passed", ...criteria];
  const rows = runs.map(({ run, evalObj }) => {
    const byName = Object.fromEntries(run.per_testing_criteria_results.map(r => [r.testing_criteria, r]));
    const counts = run.result_counts;
    return el("tr", { "data-run": run.id },
      ...(evalName ? [el("td", {}, el("a", { href: `#/evals/${evalObj.id}`, text: evalObj.name }))] : []),
      el("td", { text: run.id }), el("td", { text: run.model || "(the lines' samples)" }),
      el("td", { class: `status-${run.status}`, text: run.status }),
      el("td", { text: `${counts.total}/${run.progress ? run.progress.total : counts.total}` }),
      passCell(counts.passed, counts.total),
      ...criteria.map(name => byName[name] ? passCell(byName[name].passed, byName[name].passed + byName[name].failed) : el("td", { text: "" })));
  });
  return [el("tr", {}, ...head.map(h => el("th", { text: h }))), ...rows];
}

async function evalsPage() {
  const root = el("section", {}, el("h1", { text: "Evals" }),
    el("p", { class: "note", text: "OpenAI's Evals API (client.evals at this server's /v1): each eval's runs compare models on its testing criteria." }));
  main().replaceChildren(root);
  const evals = (await api("/evals?limit=100&order=desc")).data;
  const table = el("table", { id: "evals" });
  table.replaceChildren(el("tr", {}, ...["eval", "name", "testing criteria", "created"].map(h => el("th", { text: h }))),
    ...evals.map(e => el("tr", {},
      el("td", {}, el("a", { href: `#/evals/${e.id}`, text: e.id })), el("td", { text: e.name }),
      el("td", { text: e.testing_criteria.map(c => c.name).join(", ") }), el("td", { text: time(e.created_at) }))),
    ...(evals.length ? [] : [el("tr", {}, el("td", { text: "no eval in this project (POST /v1/evals)" }))]));
  root.append(table);
}

async function evalPage(evalId, signal) {
  const evalObj = await api(`/evals/${evalId}`);
  const criteria = evalObj.testing_criteria.map(c => c.name);
  const table = el("table", { id: "eval-runs" });
  const items = el("table", { id: "output-items", class: "samples" });
  const picked = el("p", { id: "items-of" });
  const root = el("section", {}, el("h1", { text: `${evalObj.name} (${evalObj.id})` }),
    el("p", { class: "note", text: `Testing criteria: ${criteria.join(", ")}. A bar is the share of items that passed.` }),
    table, el("h2", { text: "Output items" }), picked, items);
  main().replaceChildren(root);
  const showItems = async runId => {
    const data = (await api(`/evals/${evalId}/runs/${runId}/output_items?limit=50`)).data;
    picked.textContent = `${runId}: its first ${data.length} items`;
    items.replaceChildren(el("tr", {}, ...["item", "status", "answer", ...criteria].map(h => el("th", { text: h }))),
      ...data.map(i => el("tr", {}, el("td", { text: i.datasource_item_id }), el("td", { class: `status-${i.status}`, text: i.status }),
        el("td", { text: i.sample.output.map(m => m.content).join(" ") }),
        ...criteria.map(name => { const r = i.results.find(x => x.name === name); return el("td", { text: r ? r.score.toFixed(3) : "" }); }))));
  };
  const draw = async () => {
    const runs = (await api(`/evals/${evalId}/runs?limit=100`)).data;
    table.replaceChildren(...runsTable(runs.map(run => ({ run, evalObj })), criteria));
    for (const row of table.querySelectorAll("tr[data-run]")) row.onclick = () => showItems(row.dataset.run).catch(e => showError(root, e));
    return runs;
  };
  const runs = await draw();
  if (runs.length) await showItems(runs[runs.length - 1].id);
  const timer = setInterval(() => draw().catch(e => showError(root, e)), 3000);
  signal.addEventListener("abort", () => clearInterval(timer));
}

// A job page's eval runs: every run of the project's evals whose model is the job's starting model,
// its fine-tuned model or one of its checkpoints, side by side.
async function showJobEvalRuns(node, job) {
  const ours = m => m && (m === job.model || (job.fine_tuned_model && m === job.fine_tuned_model) || m.includes(`:${job.id}:ckpt-`) || m.endsWith(`:${job.id}`));
  const evals = (await api("/evals?limit=100")).data;
  const found = [];
  for (const evalObj of evals) {
    const runs = (await api(`/evals/${evalObj.id}/runs?limit=100`)).data.filter(r => ours(r.model));
    found.push(...runs.map(run => ({ run, evalObj })));
  }
  if (!found.length) {
    node.replaceChildren(el("p", { class: "note", text: `No eval run of ${job.model} or this job's models yet (POST /v1/evals/{id}/runs with a "completions" data source).` }));
    return;
  }
  const criteria = [...new Set(found.flatMap(f => f.run.per_testing_criteria_results.map(r => r.testing_criteria)))];
  node.replaceChildren(el("table", { id: "job-eval-table" }, ...runsTable(found, criteria, { evalName: true })));
}

async function download(jobId, ckpt) {
  const r = await fetch(`${API}/fine_tuning/jobs/${jobId}/checkpoints/${ckpt.id}/content`, { headers: headers() });
  if (!r.ok) { alert(`download failed: ${r.status}`); return; }
  const url = URL.createObjectURL(await r.blob());
  const a = el("a", { href: url, download: `${jobId}-step-${ckpt.step_number}.tar` });
  document.body.append(a); a.click(); a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

// Tinker runs --------------------------------------------------------------------------------------
// The project's Tinker training models ("training runs", GET /api/v1/training_runs, each with its
// loss_summary: the last step and a curve of at most 30 points, in the one request) and, on a run's
// page, its steps (GET /api/v1/training_runs/{id}/steps): the loss its forward_backward calls added
// up, drawn per step, and AdamW's metrics. A run's page follows new steps while it is open.
const TINKER = "/api/v1";
const TINKER_CHARTS = [
  { metric: "mean_loss", y: "loss (mean over what it counts)",
    note: "The summed loss of the step's forward_backward calls over what it counted: the weights' sum for cross_entropy (so the mean NLL a trained token), the tokens with an advantage for the RL losses." },
  { metric: "loss", y: "loss (sum)", note: "Tinker's loss:sum, added up over the step's forward_backward calls." },
  { metric: "grad_norm", y: "gradient norm", note: "Before clipping (grad_clip_norm), as optim_step reports it." },
  { metric: "learning_rate", y: "learning rate", note: "As the client's AdamParams set it." },
];
const stepValue = (row, metric) => (metric in row ? row[metric] : row.metrics[metric]);

async function tinkerRunsPage(signal) {
  const root = el("section", {}, el("h1", { text: "Tinker runs" }),
    el("p", { class: "note", text: "Training models of the Tinker protocol (TINKER_BASE_URL at this server; docs/tinker.md), newest first." }));
  main().replaceChildren(root);
  const table = el("table", { id: "tinker-runs" });
  root.append(table);
  const draw = async () => {
    const runs = (await api("/training_runs?limit=50", {}, TINKER)).training_runs;
    const rows = runs.map(run => {
      const summary = run.loss_summary;
      return el("tr", {},
        el("td", {}, el("a", { href: `#/tinker/${encodeURIComponent(run.training_run_id)}`, text: run.training_run_id })),
        el("td", { text: run.base_model }),
        el("td", { text: run.is_lora ? `LoRA ${run.lora_rank}` : "every weight" }),
        el("td", { text: summary.last_step ?? 0 }),
        el("td", { text: summary.last_mean_loss !== null ? `${summary.last_mean_loss.toFixed(3)} (${summary.loss_fn})` : "" }),
        el("td", { class: "spark", text: sparkline(summary.loss_curve) }),
        el("td", { text: run.last_request_time ? new Date(run.last_request_time).toLocaleString() : "" }));
    });
    table.replaceChildren(
      el("tr", {}, ...["run", "base model", "trains", "step", "last loss", "curve", "last request"].map(h => el("th", { text: h }))),
      ...rows, ...(runs.length ? [] : [el("tr", {}, el("td", { text: "no Tinker training model in this project" }))]));
  };
  await draw();
  const timer = setInterval(() => draw().catch(e => showError(root, e)), 5000);
  signal.addEventListener("abort", () => clearInterval(timer));
}

async function tinkerRunPage(runId, signal) {
  const path = `/training_runs/${encodeURIComponent(runId)}`;
  const run = await api(path, {}, TINKER);
  const root = el("section", {}, el("h1", { text: run.training_run_id }),
    el("p", { text: `${run.base_model} · ${run.is_lora ? `LoRA rank ${run.lora_rank}` : "every weight"} · steps as optim_step applied them` }));
  main().replaceChildren(root);
  const node = el("div", { class: "charts", style: "--columns: 2" });
  const charts = TINKER_CHARTS.map(chart => {
    const canvas = el("canvas", { "data-metric": chart.metric });
    node.append(el("div", { class: "chart" }, el("h3", { text: chart.metric }), canvas, el("p", { class: "note", text: chart.note })));
    return { ...chart, canvas };
  });
  const checkpoints = el("table", { id: "tinker-checkpoints" });
  root.append(node, el("h2", { text: "Checkpoints" }), checkpoints);
  let steps = [];
  const refresh = async () => {
    // All of them each time: a model loaded back rewrites the steps after its own.
    steps = (await api(`${path}/steps?limit=10000`, {}, TINKER)).data;
    for (const c of charts) {
      const points = steps.map(s => [s.step, stepValue(s, c.metric)]);
      plot(c.canvas, points, { x: "step", y: c.y, name: c.metric, empty: "no step yet: optim_step records one" });
    }
    const saved = (await api(`${path}/checkpoints`, {}, TINKER)).checkpoints;
    checkpoints.replaceChildren(
      el("tr", {}, ...["tinker path", "kind", "bytes", "created"].map(h => el("th", { text: h }))),
      ...saved.map(c => el("tr", {}, el("td", { text: c.tinker_path }), el("td", { text: c.checkpoint_type }),
        el("td", { text: c.size_bytes ?? "" }), el("td", { text: c.time ? new Date(c.time).toLocaleString() : "" }))),
      ...(saved.length ? [] : [el("tr", {}, el("td", { text: "none saved" }))]));
  };
  await refresh();
  const timer = setInterval(() => refresh().catch(() => {}), 3000);
  signal.addEventListener("abort", () => clearInterval(timer));
}

// Files --------------------------------------------------------------------------------------------
async function filesPage() {
  const files = (await api("/files")).data;
  main().replaceChildren(el("h1", { text: "Files" }), el("table", { id: "files" },
    el("tr", {}, ...["id", "filename", "purpose", "bytes", "lines", "created"].map(h => el("th", { text: h }))),
    ...files.map(f => el("tr", {}, el("td", { text: f.id }), el("td", { text: f.filename }), el("td", { text: f.purpose }),
      el("td", { text: f.bytes }), el("td", { text: f.line_count ?? "" }), el("td", { text: time(f.created_at) })))));
}

// Usage ---------------------------------------------------------------------------------------------
// What the project used the last 7 days (GET /v1/usage?group_by=day), a row a day, device-hours drawn
// as bars; what it stores now, and its quotas.
async function usagePage() {
  const usage = await api("/usage?group_by=day");
  const days = [...new Set(usage.data.map(u => u.day))].sort();
  const kinds = ["device_seconds", "tokens_trained", "tokens_sampled", "reward_model_tokens", "judge_tokens", "inference_tokens"];
  const of = (day, kind) => usage.data.find(u => u.day === day && u.kind === kind);
  const widest = Math.max(1e-9, ...days.map(d => (of(d, "device_seconds") || {}).device_hours || 0));
  const priced = usage.data.some(u => u.cost !== undefined);
  const head = ["day", "device-hours", "", ...(priced ? ["cost"] : []), "tokens trained", "tokens sampled", "reward-model tokens", "judge tokens", "inference tokens"];
  const quotas = Object.entries(usage.quotas || {}).filter(([, v]) => v !== null);
  main().replaceChildren(el("h1", { text: "Usage" }),
    el("p", { id: "stored", text: `Stored now: ${usage.stored_bytes} bytes (files, checkpoints, merged exports, Tinker checkpoints).` }),
    el("p", { id: "quotas", text: quotas.length ? "Quotas: " + quotas.map(([k, v]) => `${k} ${v}`).join(", ") : "No quotas set." }),
    el("table", { id: "usage" }, el("tr", {}, ...head.map(h => el("th", { text: h }))),
      ...days.map(d => {
        const hours = (of(d, "device_seconds") || {}).device_hours || 0;
        const bar = el("span", { class: "bar" }, el("span", { class: "fill", style: `width:${(100 * hours / widest).toFixed(1)}%` }));
        return el("tr", { "data-day": d },
          el("td", { text: new Date(d * 1000).toISOString().slice(0, 10) }), el("td", { class: "hours", text: hours.toFixed(4) }),
          el("td", {}, bar), ...(priced ? [el("td", { text: ((of(d, "device_seconds") || {}).cost || 0).toFixed(2) })] : []),
          ...kinds.slice(1).map(k => el("td", { text: Math.round((of(d, k) || {}).amount || 0) })));
      })));
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
    if (!me) await whoami();
    if (section === "jobs" && id) await jobPage(id, page.signal);
    else if (section === "evals" && id) await evalPage(id, page.signal);
    else if (section === "evals") await evalsPage();
    else if (section === "files") await filesPage();
    else if (section === "usage") await usagePage();
    else if (section === "graders") gradersPage();
    else if (section === "fleet") await fleetPage(page.signal);
    else if (section === "tinker" && id) await tinkerRunPage(decodeURIComponent(id), page.signal);
    else if (section === "tinker") await tinkerRunsPage(page.signal);
    else await jobsPage(page.signal);
  } catch (e) {
    showError(main(), e);
  }
}

window.addEventListener("hashchange", route);
route();
