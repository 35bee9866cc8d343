// The page: controls in, planLayout (planner.js) out, drawn as tables and one bar. No numbers
// are computed here beyond unit conversions; custom sizes go through planner.js's modelRefusal,
// modelData and countRefusal first.
"use strict";

const DATA = JSON.parse(document.getElementById("plan-data").textContent);
const $ = (id) => document.getElementById(id);
const INTS = ["nodes", "gpus_per_node", "pp", "dp", "ep", "cp", "virtual_stages",
  "micro_batch_size", "global_batch_size", "seq_len"];
const TEXTS = ["model", "gpu", "recompute", "dispatcher", "precision"];
const CUSTOM = DATA.custom_model; // the model select's entry for sizes typed into the page
let seededFrom = null; // the model whose config the custom sizes started from
const PARTS = [
  ["weights", "weights", "#3b6fb6"],
  ["grad_buffers", "gradients at the peak", "#6a9fd8"],
  ["optimizer", "optimizer state", "#e0a030"],
  ["activations", "activations", "#4c9a6a"],
  ["ep_buffers", "EP receive buffers", "#a05cc0"],
  ["p2p_buffers", "pipeline send buffers", "#c0607a"],
  ["transient", "transient gradient", "#9aa3ad"],
  ["reserve", "runtime reserve", "#c8ced6"],
];

const fixed = (x, digits) =>
  x.toLocaleString("en-US", { minimumFractionDigits: digits, maximumFractionDigits: digits });
const gib = (bytes) => fixed(bytes / DATA.constants.gib, 2);
const count = (n) => {
  for (const [unit, scale] of [["T", 1e12], ["B", 1e9], ["M", 1e6], ["K", 1e3]])
    if (n >= scale) return (n / scale).toFixed(2) + unit;
  return String(n);
};

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function fill(tbody, rows) {
  tbody.replaceChildren(...rows.map(([cells, cls]) => {
    const tr = document.createElement("tr");
    if (cls) tr.className = cls;
    tr.append(...cells);
    return tr;
  }));
}

function setup() {
  const add = (select, value, text) => select.add(new Option(text ?? value, value));
  for (const [key, m] of Object.entries(DATA.models))
    add($("model"), key, `${key} (${count(m.total_params)})`);
  add($("model"), CUSTOM, `${CUSTOM}...`);
  for (const [key, g] of Object.entries(DATA.gpus))
    add($("gpu"), key, `${key} (${g.memory_gib} GiB)`);
  for (const key of Object.keys(DATA.precisions)) add($("precision"), key);
  for (const s of DATA.seq_lens) add($("seq_len"), String(s));
  for (const n of DATA.gpus_per_node) add($("gpus_per_node"), String(n));
  DATA.tour.forEach((step, i) => {
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = `${i + 1}. ${step.title}`;
    b.addEventListener("click", () => {
      document.querySelectorAll("#tour button").forEach((x) => x.classList.remove("on"));
      b.classList.add("on");
      $("tour-text").textContent = step.text;
      apply(step.layout);
    });
    $("tour").append(b);
  });
  $("model").addEventListener("input", () => { // before update runs: seed, then plan
    if ($("model").value !== CUSTOM) seededFrom = $("model").value;
    else seed(DATA.models[seededFrom].config);
  });
  for (const key of [...INTS, ...TEXTS]) $(key).addEventListener("input", update);
  for (const key of MODEL_SIZES) $(`m-${key}`).addEventListener("input", update);
  calibration();
  apply(DATA.initial);
}

function apply(layout) {
  for (const key of [...INTS, ...TEXTS]) $(key).value = String(layout[key]);
  seededFrom = layout.model;
  update();
}

// The custom sizes start as the config of the model picked before (its other fields too: the
// block options they keep); a head_dim of d_model / n_heads shows empty (it follows them).
function seed(config) {
  for (const key of MODEL_SIZES) {
    const own = key !== "head_dim" || config.head_dim * config.n_heads !== config.d_model;
    $(`m-${key}`).value = config[key] === null || !own ? "" : String(config[key]);
  }
  $("custom").dataset.base = JSON.stringify(config);
}

// The typed sizes: a number where the field holds one, the text otherwise (refused as the
// config refuses it); an empty nullable size is null (n_kv_heads: as many as n_heads,
// head_dim: d_model / n_heads, dense_hidden: none).
function readCustom() {
  const config = { ...JSON.parse($("custom").dataset.base), name: "custom" };
  for (const key of MODEL_SIZES) {
    const text = $(`m-${key}`).value.trim();
    config[key] = text === "" ? (NULLABLE_SIZES.includes(key) ? null : text) : Number(text);
  }
  return config;
}

function readLayout() {
  const L = {};
  for (const key of INTS) L[key] = Number($(key).value);
  for (const key of TEXTS) L[key] = $(key).value;
  return L;
}

function linkOf(span, L) {
  return span <= L.gpus_per_node ? "NVLink" : "network";
}

// The page's data with the custom model in it, or the sentence refusing its sizes.
function withCustom() {
  const config = readCustom();
  const bad = modelRefusal(DATA, config);
  if (bad) return { refusal: bad };
  const model = modelData(DATA, config);
  const big = countRefusal(model);
  if (big) return { refusal: big };
  return { data: { ...DATA, models: { ...DATA.models, [CUSTOM]: model } } };
}

// The mixture's table (data.sources): it follows the global batch and sequence length typed.
function showMixture(L) {
  $("mixture").hidden = !DATA.mixture;
  if (!DATA.mixture) return;
  $("mix-steps").textContent = `(over the run's ${DATA.mixture.steps} steps)`;
  fill(document.querySelector("#mix-table tbody"), mixtureRows(DATA.mixture, L).map((r) => [[
    cell(r.name), cell(`${fixed(100 * r.share, 1)}%`, "num"), cell(fixed(r.tokens, 0)),
    cell(epochsText(r.epochs, r.instances), "num"),
  ]]));
}

function update() {
  const L = readLayout();
  showMixture(L);
  const custom = L.model === CUSTOM;
  $("custom").hidden = !custom;
  const own = custom ? withCustom() : { data: DATA };
  const data = own.data;
  const r = data ? planLayout(data, L) : { refusal: own.refusal };
  const world = L.pp * L.dp * L.cp * L.ep;
  const m = data ? data.models[L.model] : null;
  $("world").textContent = (m ? `${L.model}: ${count(m.total_params)} parameters, ` +
    `${count(m.active_params)} active. ` : "") + `Layout ${layoutText(L)} = ` +
    `${world} GPUs; cluster ${L.nodes} x ${L.gpus_per_node} = ${L.nodes * L.gpus_per_node}.`;
  $("refusal").hidden = !r.refusal;
  $("refusal").textContent = r.refusal ? `Refused: ${r.refusal}` : "";
  if (!r.memory) {
    $("mem-bar").replaceChildren();
    for (const id of ["mem-table", "comm-table", "step-table"])
      fill(document.querySelector(`#${id} tbody`), []);
    $("mem-where").textContent = $("mem-stages").textContent = $("reach").textContent = "";
    return;
  }
  const gpu = DATA.gpus[L.gpu];
  const cap = gpu.memory_gib * DATA.constants.gib;
  const scale = Math.max(cap, r.total);
  const bar = PARTS.filter(([k]) => r.memory[k] > 0).map(([k, name, color]) => {
    const s = document.createElement("span");
    s.style.width = `${(100 * r.memory[k]) / scale}%`;
    s.style.background = color;
    s.title = `${name}: ${gib(r.memory[k])} GiB`;
    return s;
  });
  const line = document.createElement("span");
  line.className = "cap";
  line.style.left = `${(100 * cap) / scale}%`;
  line.title = `${L.gpu}: ${gpu.memory_gib} GiB`;
  $("mem-bar").replaceChildren(...bar, line);
  $("mem-where").textContent = `(the busiest rank: pipeline stage ${r.busiest_stage})`;
  const fits = r.total <= cap;
  const rows = PARTS.map(([k, name, color]) => {
    const sw = cell("");
    const dot = document.createElement("span");
    dot.className = "swatch";
    dot.style.background = color;
    sw.replaceChildren(dot, name);
    return [[sw, cell(`${gib(r.memory[k])} GiB`, "num")]];
  });
  const total = cell(`${gib(r.total)} GiB`, "num");
  total.id = "mem-total";
  rows.push([[cell("total per GPU"), total], "total"]);
  const verdict = cell(`${fits ? "fits" : "does not fit"}: ${L.gpu} has ${gpu.memory_gib} GiB`,
    fits ? "num fits" : "num over");
  verdict.id = "mem-verdict";
  rows.push([[cell(""), verdict]]);
  fill(document.querySelector("#mem-table tbody"), rows);
  $("mem-stages").textContent = L.pp > 1
    ? `per stage (GiB): ${r.stages.map((s) => fixed(s / DATA.constants.gib, 1)).join(", ")}`
    : "";

  const t = r.time;
  const a2aLink = L.ep <= L.gpus_per_node
    ? "NVLink"
    : L.gpus_per_node > 1 ? "NVLink + network" : "network";
  const reduced = L.dp * L.cp * L.ep; // the dense weights' group (dp x cp x ep)
  const comm = [
    ["EP dispatch + combine (all-to-all)", r.comm.all_to_all, L.ep > 1 ? a2aLink : "-", t.all_to_all],
    ["DP gradient reduce-scatter", r.comm.reduce_scatter, linkOf(reduced, L), t.reduce_scatter],
    ["DP weight all-gather", r.comm.all_gather, linkOf(reduced, L), t.all_gather],
    ["PP activation and gradient sends", r.comm.pipeline, linkOf(world, L), t.pipeline],
    [`CP key/value all-gather + gradient reduce-scatter (${gib(r.comm.context_per_layer)} GiB ` +
      "per layer and micro-batch)", r.comm.context, linkOf(L.cp * L.ep, L), t.context],
  ];
  fill(document.querySelector("#comm-table tbody"), comm.map(([name, bytes, link, s]) => [[
    cell(name), cell(gib(bytes), "num"), cell(bytes ? link : "-"), cell(fixed(s * 1e3, 1), "num"),
  ]]));
  $("reach").textContent = reachLine(r.reach, r.plain);
  const step = [
    ["micro-batches per GPU and step", String(r.micro_batches)],
    ["compute (busiest rank, calibrated rate)", `${fixed(t.compute * 1e3, 1)} ms`],
    ["pipeline bubble", `${fixed(100 * t.bubble, 1)} % of the step`],
    ["step time", `${fixed(t.step * 1e3, 1)} ms`],
    ["tokens/s per GPU", fixed(t.tokens_per_s_per_gpu, 0)],
    ["MFU", `${fixed(100 * t.mfu, 1)} %`],
  ];
  fill(document.querySelector("#step-table tbody"), step.map(([name, value]) => {
    const v = cell(value, "num");
    v.id = `step-${name.split(" ")[0].replace(/\W/g, "")}`;
    return [[cell(name), v]];
  }));
}

// Where a token's rows go (plan.report's "EP rows" or "group-limited routing" line): the bound
// on ranks and nodes it reaches, the rows it is expected to send, and under expert groups the
// same for plain top-k beside them.
function reachLine(r, plain) {
  if (r.ep === 1) return "";
  const nodes = r.nodes > 1;
  const most = `at most ${r.max_ranks} of ${r.ep} ranks` +
    (nodes ? `, ${r.max_nodes} of ${r.nodes} nodes` : "");
  const rows = `rows per token ${fixed(r.rows_per_token, 2)}`;
  const across = `${fixed(r.cross_node_rows, 2)} across nodes`;
  const same = ["max_ranks", "max_nodes", "rows_per_token"].every((k) => r[k] === plain[k]);
  if (same) return `Expert-parallel rows: a token reaches ${most}; ${rows}${nodes ? `, ${across}` : ""}.`;
  const fewer = 100 * (1 - r.rows_per_token / plain.rows_per_token);
  let line = `Group-limited routing: a token reaches ${most} (top-k alone: ${plain.max_ranks} ` +
    `ranks${nodes ? `, ${plain.max_nodes} nodes` : ""}); ${rows} instead of ` +
    `${fixed(plain.rows_per_token, 2)} (${fixed(fewer, 1)} % fewer)`;
  if (nodes) line += `, ${across} instead of ${fixed(plain.cross_node_rows, 2)}`;
  const loose = r.nests_ranks ? [] : [`a group touches up to ${r.group_ranks} ranks`];
  if (nodes && !r.nests_nodes) loose.push(`up to ${r.group_nodes} nodes`);
  if (loose.length) line += `; groups do not nest in this layout: ${loose.join(", ")}`;
  return `${line}.`;
}

function calibration() {
  const m = DATA.measured;
  const peak = DATA.gpus[m.gpu].peak_tflops;
  const li = (text) => {
    const e = document.createElement("li");
    e.textContent = text;
    return e;
  };
  const measured = document.createElement("ul");
  measured.append(
    li(`Compute rate: ${fixed(m.model_tflops, 1)} model TFLOP/s per GPU on one ${m.gpu}, ` +
      `${fixed(100 * m.fraction_of_peak, 1)} % of its ${peak} TFLOP/s peak: ${m.what} ` +
      `(${m.source}; benchmarks/RESULTS.md).`),
    li(`Memory: that run allocated at most ${fixed(m.peak_gib, 1)} GiB; the planner gives ` +
      `${gib(planLayout(DATA, DATA.tour[0].layout).total)} GiB for the same layout (tour step ` +
      `1), of which ${DATA.constants.reserve_gib} GiB runtime reserve (the CUDA context and ` +
      "libraries, outside PyTorch's count). It counts the experts unfused, as parallel." +
      "expert_gemm=auto plans them (an upper bound: that run fused its MLP with QuACK, which " +
      "keeps no SwiGLU output), and what compiled blocks keep, as that run " +
      "ran them, and, on one GPU with one micro-batch, only the gradients beyond the " +
      "activations that backward frees as it writes them (benchmarks/plan_memory.py)."),
    li("Memory formulas: weights, gradients and optimizer state equal what the trainer " +
      "allocates for each precision preset; activations are within a few percent of what " +
      "eager autograd keeps and within 10 % of what a compiled block keeps (tests/test_plan.py, " +
      "on CPU tensors), and within 0.3 % per layer on one H200 (benchmarks/RESULTS.md)."),
  );
  const assumed = document.createElement("ul");
  assumed.append(
    li("Other GPUs and models run at the same fraction of their peak as the measured H200 " +
      "step; peaks are dense bf16 datasheet figures: " +
      Object.entries(DATA.gpus).map(([k, g]) => `${k} ${g.peak_tflops}`).join(", ") + " TFLOP/s."),
    li("Memory and links are datasheet figures, per GPU and direction: " +
      Object.entries(DATA.gpus).map(([k, g]) =>
        `${k} ${g.memory_gib} GiB, NVLink ${g.nvlink_gb_s} GB/s, network ${g.network_gb_s} GB/s`)
        .join("; ") + ". No multi-GPU rate has been measured for these layouts yet."),
    li("Nothing overlaps: compute, all-to-all, pipeline sends and the CP key/value exchange " +
      "add up and the bubble " +
      "stretches them; reduce-scatter and all-gather follow. Routing is uniform (group-limited: " +
      "its groups uniformly, then its experts among theirs); block " +
      `recompute costs ${fixed(DATA.constants.block_recompute_flops, 2)}x the FLOPs; ` +
      `${DATA.constants.reserve_gib} GiB per GPU are kept for the CUDA context, NCCL and ` +
      "workspaces."),
  );
  const h = (text) => {
    const e = document.createElement("h3");
    e.textContent = text;
    return e;
  };
  $("calibration-body").replaceChildren(h("Measured"), measured, h("Assumed"), assumed);
}

setup();
