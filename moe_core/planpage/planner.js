// The planner's arithmetic (moe_core/plan/: plan.planner.plan, plan.timing.step_time,
// plan.checks.fit_refusal and the config checks a layout can trip) over the numbers Python
// exports into the page: parameter shapes, activation bytes per token, FLOPs per token,
// all-to-all rows and every constant. It mirrors plan.memory, plan.communication and
// plan.timing statement by statement; tests/test_plan_page.py runs it (QuickJS) against plan()
// on a grid of models x GPU types x layouts. For sizes typed into the page (the "custom sizes"
// model), modelData computes what planpage.model_data exports, mirroring the Python functions
// it calls; the tests hold the two equal on a grid of configs.
"use strict";

function ring(bytes, group) {
  return (bytes * (group - 1)) / group;
}

// Python's round(): halves to even.
function pyRound(x) {
  const r = Math.round(x);
  return Math.abs(x % 1) === 0.5 && r % 2 !== 0 ? r - 1 : r;
}

// The most chunk-forwards of a pipeline rank whose backward is pending (parallel.pipeline).
function inFlight(pp, v, s, nMb) {
  if (pp === 1) return 1;
  const total = nMb * v;
  const warmup =
    v === 1 ? Math.min(pp - s - 1, nMb) : Math.min((pp - s - 1) * 2 + (v - 1) * pp, total);
  return Math.min(warmup + 1, total);
}

// Python's repr() of a rule quantity: a number, a string, a boolean or a list of strings.
function pyValue(v) {
  if (Array.isArray(v)) return `[${v.map(pyValue).join(", ")}]`;
  if (typeof v === "boolean") return v ? "True" : "False";
  return typeof v === "string" ? `'${v}'` : String(v);
}

// The named checks of moe_core.config.RULE_CHECKS (each written once there, once here).
const RULE_CHECKS = {
  multiple_of: (a, b) => a % b === 0,
  divides: (a, b) => b % a === 0,
  at_most: (a, b) => a <= b,
  at_least: (a, b) => a >= b,
  equals: (a, b) => a === b,
};

// moe_core.config.rule_quantities of the run config planpage.run_of builds from layout L.
function ruleQuantities(m, L, prec) {
  const q = { interleaved: L.virtual_stages > 1, chunks: L.pp * L.virtual_stages,
    data_parallel: L.dp * L.ep, fp8_dispatch: prec.fp8_parts.includes("dispatch") };
  for (const [name, v] of Object.entries(m)) q[`model.${name}`] = v;
  for (const [name, v] of Object.entries(prec)) q[`precision.${name}`] = v;
  for (const name of ["seq_len", "micro_batch_size", "global_batch_size"])
    q[`train.${name}`] = L[name];
  q["train.eval_batches"] = Math.max(q.data_parallel, 1); // as run_of sets it
  for (const name of ["pp", "dp", "ep", "virtual_stages", "dispatcher"])
    q[`parallel.${name}`] = L[name];
  q.per_step = L.micro_batch_size * q.data_parallel;
  q.micro_batches = Math.floor(L.global_batch_size / q.per_step);
  return q;
}

// moe_core.config._check_rules: the sentence of the first rule of section that q breaks, or
// null (rules: moe_core.config.RULES, as the page data carries them).
function ruleRefusal(rules, section, q) {
  const fill = (t) => t.replace(/\{([\w.]+)(!r)?\}/g, (_, name, r) =>
    r ? pyValue(q[name]) : String(q[name]));
  for (const rule of rules) {
    if (rule.section !== section || (rule.when !== null && !q[rule.when])) continue;
    const b = typeof rule.b === "string" && rule.b in q ? q[rule.b] : rule.b;
    if (RULE_CHECKS[rule.check](q[rule.a], b)) continue;
    if (rule.sentence !== null) return fill(rule.sentence);
    return `${rule.field}=${pyValue(q[rule.field])} is not allowed: ${fill(rule.allowed)}.`;
  }
  return null;
}

// The first config check the layout fails (the sentence moe_core.config raises), or null;
// prec: the layout's precision section; the layout rules come from the table (rules).
function configRefusal(m, L, prec, rules) {
  const fail = (name, value, allowed) => `${name}=${value} is not allowed: ${allowed}.`;
  const q = ruleQuantities(m, L, prec);
  const positive = (names) => {
    for (const [name, key] of names)
      if (!(L[key] > 0)) return fail(name, L[key], "it must be positive");
    return null;
  };
  const dpep = L.dp * L.ep;
  const train = positive([["train.seq_len", "seq_len"],
    ["train.micro_batch_size", "micro_batch_size"],
    ["train.global_batch_size", "global_batch_size"]]) || ruleRefusal(rules, "train", q);
  if (train) return train;
  const par = positive([["parallel.pp", "pp"], ["parallel.dp", "dp"], ["parallel.ep", "ep"],
    ["parallel.virtual_stages", "virtual_stages"]]) || ruleRefusal(rules, "parallel", q);
  if (par) return par;
  const cluster = positive([["cluster.nodes", "nodes"],
    ["cluster.procs_per_node", "gpus_per_node"]]);
  if (cluster) return cluster;
  const run = ruleRefusal(rules, "run", q);
  if (run) return run;
  const world = L.pp * dpep;
  const procs = L.nodes * L.gpus_per_node;
  if (procs !== world) {
    const hint = world % L.gpus_per_node === 0
      ? `set cluster.nodes=${world / L.gpus_per_node}`
      : "change cluster.nodes/procs_per_node or parallel.pp/dp/ep";
    return `cluster 'page' starts cluster.nodes x cluster.procs_per_node = ${L.nodes} x ` +
      `${L.gpus_per_node} = ${procs} processes but the layout parallel.pp x dp x ep = ` +
      `${L.pp} x ${L.dp} x ${L.ep} needs ${world}: ${hint}.`;
  }
  return null;
}

// Memory per stage, communication, time per step and the refusal of layout L (see
// plan.planner.plan).
function planLayout(data, L) {
  const model = data.models[L.model];
  const m = model.config;
  const prec = data.precisions[L.precision];
  const refusal = configRefusal(m, L, prec, data.rules);
  if (refusal) return { refusal };
  const C = data.constants;
  const gpu = data.gpus[L.gpu];
  const bp = C.dtype_bytes[prec.params];
  const bc = C.dtype_bytes[prec.compute];
  const bo = C.dtype_bytes[prec.optimizer];
  const sh = model.shapes;
  const d = m.d_model, k = m.top_k, E = m.n_experts, h = m.expert_hidden;
  const T = L.micro_batch_size * L.seq_len;
  const dpep = L.dp * L.ep;
  const nMb = L.global_batch_size / (L.micro_batch_size * dpep);
  const v = L.virtual_stages;
  const nChunks = L.pp * v;
  const perChunk = m.n_layers / nChunks;
  const block = L.recompute === "block";
  const autogradGrads = dpep === 1 && (nMb === 1 || bp === bo);
  const acts = model.activation[L.precision];
  const aLayer = acts[block ? "none" : L.recompute];
  const aFull = acts.none;
  const headAct = T * (2 * m.vocab_size * bc + d * (bp + bc)); // compiled (GPU runs)
  let epBuffers = 0, extraLayer = 0, extraFull = 0;
  if (L.ep > 1 && L.dispatcher === "nvshmem_rowwise") {
    const rows = L.ep * T; // dropless capacity (parallel.dispatch.rowwise_capacity)
    const assignments = L.ep * T * Math.min(k, E / L.ep);
    epBuffers = (rows + 1) * d * bp + (rows + 1) * 2 * k * 4 + L.ep * L.ep * 8;
    const moreRows = assignments - T * k;
    // plan.memory.rowwise_buffers: FP8 experts keep no SwiGLU output (experts_keep)
    const swigluOut = prec.fp8_parts.includes("experts") ? 0 : 1;
    extraFull = moreRows * (bp * (d + (2 + swigluOut) * h) + 4);
    extraLayer = extraFull - (swigluOut && L.recompute === "selective" ? moreRows * bp * h : 0);
  }
  const message = T * d * bp + 4;
  const reserve = pyRound(C.reserve_gib * C.gib);

  const stages = [];
  const sent = [];
  for (let s = 0; s < L.pp; s++) {
    const chunks = Array.from({ length: v }, (_, i) => s + i * L.pp);
    const layers = perChunk * chunks.length;
    let dense = layers * sh.layer_dense;
    let largest = sh.largest_dense;
    if (chunks.includes(0)) {
      dense += sh.embedding;
      largest = Math.max(largest, sh.embedding);
    }
    const last = chunks.includes(nChunks - 1);
    if (last) {
      dense += sh.final_norm + sh.head;
      largest = Math.max(largest, sh.head);
    }
    const experts = Math.floor((layers * sh.layer_expert) / L.ep);
    largest = Math.max(largest, Math.floor(sh.largest_expert / L.ep));
    const denseShard = dpep > 1 ? dense / dpep : 0;
    const expertShard = L.dp > 1 ? experts / L.dp : 0;
    let grads = bo * (dense + experts) + bo * (denseShard + expertShard);
    let transient = largest * bp;
    const stateBytes = 2 * bo + (bp < bo ? 4 : 0);
    const optimizer = stateBytes * (dense / dpep + experts / L.dp);
    const flight = inFlight(L.pp, v, s, nMb);
    let activations = block
      ? flight * perChunk * T * d * bp + T * aFull + extraFull
      : flight * perChunk * (T * aLayer + extraLayer);
    if (last) activations += headAct;
    if (autogradGrads) {
      grads = bp * (dense + experts);
      // one micro-batch: written as backward frees the activations
      // (plan.memory.gradients_follow_activations)
      if (nMb === 1) grads = Math.max(0, grads - activations);
      transient = 0;
    }
    const messages =
      chunks.filter((c) => c < nChunks - 1).length + chunks.filter((c) => c > 0).length;
    sent.push(messages * nMb * message);
    const parts = {
      weights: (dense + experts) * bp,
      grad_buffers: pyRound(grads),
      optimizer: pyRound(optimizer),
      activations,
      p2p_buffers: L.pp > 1 ? sent[s] : 0,
      ep_buffers: epBuffers,
      transient,
      reserve,
    };
    const total = Object.values(parts).reduce((a, b) => a + b, 0);
    stages.push({ stage: s, dense, experts, parts, total });
  }
  const busiest = stages.reduce((a, b) => (b.total > a.total ? b : a));
  const heaviest = stages.reduce((a, b) => (b.dense + b.experts > a.dense + a.experts ? b : a));

  const rows = model.rows_per_token[L.ep];
  const rowOut = prec.fp8_parts.includes("dispatch") ? d + 4 : d * bp; // FP8 rows: E4M3 + scale
  const forward = rows * (rowOut + 12 * k) + rows * d * bp;
  const backward = rows * d * bp + rows * (d * bp + 4 * k);
  const sizes = L.ep > 1 ? ring(L.ep * (1 + Math.floor(E / L.ep)) * 8, L.ep) : 0;
  let perLayer = T * (forward + backward) + sizes;
  if (block) perLayer += T * forward + sizes;
  const layersPerRank = Math.floor(m.n_layers / L.pp);
  const comm = {
    all_to_all: pyRound(perLayer * layersPerRank * nMb),
    reduce_scatter: pyRound(ring(bo * heaviest.dense, dpep) + ring(bo * heaviest.experts, L.dp)),
    all_gather: pyRound(ring(bp * heaviest.dense, dpep) + ring(bp * heaviest.experts, L.dp)),
    pipeline: L.pp > 1 ? Math.max(...sent) : 0,
  };

  // step_time
  const perNode = Math.max(L.gpus_per_node, 1);
  const world = L.pp * dpep;
  const nv = gpu.nvlink_gb_s * 1e9, net = gpu.network_gb_s * 1e9;
  const ringSeconds = (bytes, span) => bytes / (span <= perNode ? nv : net);
  let a2a = 0;
  if (L.ep > 1) {
    const local = Math.min(L.ep, perNode);
    const inside = (comm.all_to_all * (local - 1)) / (L.ep - 1);
    const outside = (comm.all_to_all * (L.ep - local)) / (L.ep - 1);
    a2a = Math.max(inside / nv, outside / net);
  }
  const tokens = nMb * T;
  const flops = ((tokens * model.flops_per_token[L.seq_len]) / L.pp) *
    (block ? C.block_recompute_flops : 1);
  const compute = flops / (gpu.peak_tflops * 1e12 * data.measured.fraction_of_peak);
  const time = {
    compute,
    all_to_all: a2a,
    reduce_scatter: ringSeconds(comm.reduce_scatter, dpep),
    all_gather: ringSeconds(comm.all_gather, dpep),
    pipeline: ringSeconds(comm.pipeline, world),
  };
  const idle = (L.pp - 1) / v;
  time.bubble = idle / (nMb + idle);
  time.step = (compute + a2a + time.pipeline) / (1 - time.bubble) +
    time.reduce_scatter + time.all_gather;
  time.tokens_per_s_per_gpu = tokens / L.pp / time.step;
  time.mfu = (time.tokens_per_s_per_gpu * model.flops_per_token[L.seq_len]) /
    (gpu.peak_tflops * 1e12);

  let fit = null;
  if (busiest.total > gpu.memory_gib * C.gib) {
    fit = `model ${m.name} with layout pp ${L.pp} x dp ${L.dp} x ep ${L.ep} needs ` +
      `${(busiest.total / C.gib).toFixed(1)} GiB per GPU but a ${L.gpu} has ` +
      `${gpu.memory_gib} GiB: raise parallel.ep or parallel.pp, lower ` +
      "train.micro_batch_size or turn on parallel.recompute.";
  }
  return {
    refusal: fit,
    micro_batches: nMb,
    memory: busiest.parts,
    busiest_stage: busiest.stage,
    total: busiest.total,
    stages: stages.map((s) => s.total),
    comm,
    time,
  };
}

// ---- custom sizes: planpage.model_data in the page --------------------------------------

// The ModelConfig fields the page's custom model takes (in the dataclass's order); the others
// (router kind, losses, init) change no count and keep the values of the model it started from.
const MODEL_SIZES = ["vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "n_experts",
  "top_k", "expert_hidden", "n_shared_experts", "max_seq_len"];

// Python's repr() of a value the page can read from an input: a number or a string.
function pyRepr(value) {
  return typeof value === "string" ? `'${value}'` : String(value);
}

// The first sentence moe_core.config raises for these sizes, or null: from_dict's type check
// of each field, then ModelConfig.__post_init__'s checks of them, in its order. n_kv_heads
// null means as many as n_heads (None in Python).
function modelRefusal(c) {
  const p = "model.";
  const fail = (name, value, allowed) => `${p}${name}=${pyRepr(value)} is not allowed: ${allowed}.`;
  for (const name of MODEL_SIZES) {
    const v = c[name];
    if (name === "n_kv_heads" && v === null) continue;
    if (typeof v !== "number" || !Number.isInteger(v)) return fail(name, v, "an integer");
  }
  for (const name of ["vocab_size", "d_model", "n_layers", "n_heads", "n_experts", "top_k",
    "expert_hidden", "max_seq_len"])
    if (!(c[name] > 0)) return fail(name, c[name], "it must be positive");
  if (c.n_shared_experts < 0)
    return fail("n_shared_experts", c.n_shared_experts, "it must be zero or positive");
  const kv = c.n_kv_heads === null ? c.n_heads : c.n_kv_heads;
  if (!(kv > 0)) return fail("n_kv_heads", kv, "it must be positive");
  if (c.top_k > c.n_experts)
    return fail("top_k", c.top_k, `at most model.n_experts (${c.n_experts})`);
  if (c.d_model % c.n_heads)
    return fail("n_heads", c.n_heads, `it must divide model.d_model (${c.d_model})`);
  if (c.n_heads % kv) return fail("n_kv_heads", kv, `it must divide model.n_heads (${c.n_heads})`);
  if ((c.d_model / c.n_heads) % 2)
    return fail("n_heads", c.n_heads, "d_model / n_heads must be even for rotary embeddings");
  return null;
}

// plan.memory.parameter_counts: the tensors of one transformer.Block (attention.Attention:
// q, k, v, o projections, q and k norms; moe.MoE: router, Experts, the shared SwiGLU) and the
// model's ends, by place, as the Python function reads them off a one-layer meta-device model.
function parameterCounts(c) {
  const d = c.d_model, hd = c.d_model / c.n_heads, h = c.expert_hidden, E = c.n_experts;
  const q = c.n_heads * hd, kv = c.n_kv_heads * hd, hs = c.n_shared_experts * h;
  const dense = [d, q * d, kv * d, kv * d, d * q, q, kv, d, E * d]; // attn_norm .. router
  if (hs) dense.push(hs * d, hs * d, d * hs); // shared SwiGLU: gate, up, down
  const experts = [E * 2 * h * d, E * d * h]; // w_gate_up, w_down
  const sum = (xs) => xs.reduce((a, b) => a + b, 0);
  return {
    layer_dense: sum(dense),
    layer_expert: sum(experts),
    largest_dense: Math.max(...dense),
    largest_expert: Math.max(...experts),
    embedding: c.vocab_size * d,
    head: d * c.vocab_size,
    final_norm: d,
  };
}

// moe_core.model.flops.count at seqLen: the same sums over the whole model's parameters.
function modelCounts(c, seqLen) {
  const sh = parameterCounts(c);
  const total = sh.embedding + c.n_layers * (sh.layer_dense + sh.layer_expert) +
    sh.final_norm + sh.head;
  const experts = c.n_layers * sh.layer_expert;
  const embedding = sh.embedding;
  // experts * (n_experts - top_k) // n_experts, exact: experts is a multiple of n_experts
  const inactive = (experts / c.n_experts) * (c.n_experts - c.top_k);
  const active = total - inactive;
  const hd = c.d_model / c.n_heads;
  const normsRouter = 2 * c.d_model + c.n_heads * hd + c.n_kv_heads * hd +
    c.n_experts * c.d_model; // RMSNorm and Router parameters of one block
  const notMatmul = embedding + c.n_layers * normsRouter + sh.final_norm;
  const matmulActive = active - notMatmul;
  const flops = 6 * matmulActive + 6 * c.n_layers * seqLen * c.d_model;
  return {
    total_params: total,
    active_params: active,
    matmul_active_params: matmulActive,
    expert_params: experts,
    embedding_params: embedding,
    flops_per_token: flops,
  };
}

// plan.memory.layer_activation_bytes (recompute "none" or "selective", compiled: the page's
// runs are on GPUs), term by term, with plan.memory.experts_keep for the page's runs
// (expert_gemm auto, no gathered rows): FP8 experts keep no SwiGLU output.
function layerActivationBytes(data, c, paramDtype, computeDtype, recompute, fp8Experts) {
  const bp = data.constants.dtype_bytes[paramDtype], bc = data.constants.dtype_bytes[computeDtype];
  const hd = c.d_model / c.n_heads;
  const d = c.d_model, dKv = c.n_kv_heads * hd, h = c.expert_hidden, k = c.top_k, e = c.n_experts;
  const hShared = c.n_shared_experts * h;
  const norms = 3 * d * bp + (d + dKv) * bc + 16;
  const attention = bc * (3 * d + 2 * dKv) + 4 * c.n_heads;
  const router = 12 * e + 20 * k;
  let experts = bp * k * (d + 3 * h) + 4 * k;
  if (recompute === "selective" || fp8Experts) experts -= bp * k * h;
  const sharedInput = bp === 4 && bc === 4 ? 0 : bc * d;
  const shared = hShared ? bc * 4 * hShared + sharedInput : 0;
  return norms + attention + router + experts + shared;
}

// plan.communication.all_to_all_rows_per_token: (ep - 1) (1 - q), q = C(E - E/ep, k) /
// C(E, k), here as the equal C(E - k, E/ep) / C(E, E/ep) multiplied out over the fewer
// factors; once q is below 2^-60, 1 - q is 1.0 in floating point, as it is for Python's exact
// ratio.
function allToAllRowsPerToken(c, ep) {
  if (ep === 1) return 0.0;
  const E = c.n_experts, perRank = E / ep, k = c.top_k;
  let q = 1;
  if (perRank + k > E) q = 0;
  else
    for (let i = 0; i < Math.min(k, perRank) && q >= 2 ** -60; i++)
      q *= (E - Math.max(k, perRank) - i) / (E - i);
  return (ep - 1) * (1.0 - q);
}

// planpage.model_data: what planLayout reads of one model, for the config c of custom sizes.
function modelData(data, c) {
  const config = { ...c, n_kv_heads: c.n_kv_heads === null ? c.n_heads : c.n_kv_heads };
  const counts = modelCounts(config, config.max_seq_len);
  const flops = {};
  for (const s of data.seq_lens)
    if (s <= config.max_seq_len) flops[s] = modelCounts(config, s).flops_per_token;
  const activation = {};
  for (const [name, p] of Object.entries(data.precisions)) {
    activation[name] = {};
    for (const r of ["none", "selective"])
      activation[name][r] = layerActivationBytes(
        data, config, p.params, p.compute, r, p.fp8_parts.includes("experts"));
  }
  const divisors = [];
  for (let i = 1; i * i <= config.n_experts; i++)
    if (config.n_experts % i === 0) divisors.push(i, config.n_experts / i);
  const rows = {};
  for (const ep of [...new Set(divisors)].sort((a, b) => a - b))
    rows[ep] = allToAllRowsPerToken(config, ep);
  return {
    config,
    shapes: parameterCounts(config),
    total_params: counts.total_params,
    active_params: counts.active_params,
    flops_per_token: flops,
    activation,
    rows_per_token: rows,
  };
}

// The page computes in doubles: sizes whose counts pass 2^53 - 1 are refused rather than
// rounded (moe plan counts them in Python's integers). One sentence, or null.
function countRefusal(md) {
  const counts = [["total parameters", md.total_params],
    ...Object.entries(md.flops_per_token).map(([s, f]) => [`FLOPs per token at ${s}`, f]),
    ...Object.values(md.activation).flatMap((a) =>
      Object.values(a).map((b) => ["activation bytes per token", b]))];
  for (const [what, n] of counts)
    if (!Number.isSafeInteger(n))
      return `the custom model's ${what}, ${n.toExponential(3)}, are not allowed: this page ` +
        "counts exactly up to 2^53 - 1; plan larger models with moe plan and model.* overrides.";
  return null;
}

if (typeof module !== "undefined")
  module.exports = { planLayout, inFlight, modelData, configRefusal };
