// The planner's arithmetic (moe_core/plan.py: plan, step_time, fit_refusal and the config
// checks a layout can trip) over the numbers Python exports into the page: parameter shapes,
// activation bytes per token, FLOPs per token, all-to-all rows and every constant. It mirrors
// plan.py statement by statement; tests/test_plan_page.py runs it (QuickJS) against plan()
// on a grid of models x GPU types x layouts.
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

// The first config check the layout fails (the sentence moe_core.config raises), or null.
function configRefusal(m, L) {
  const fail = (name, value, allowed) => `${name}=${value} is not allowed: ${allowed}.`;
  const positive = (names) => {
    for (const [name, key] of names)
      if (!(L[key] > 0)) return fail(name, L[key], "it must be positive");
    return null;
  };
  const dpep = L.dp * L.ep;
  const train = positive([["train.seq_len", "seq_len"],
    ["train.micro_batch_size", "micro_batch_size"],
    ["train.global_batch_size", "global_batch_size"]]);
  if (train) return train;
  if (L.global_batch_size % L.micro_batch_size)
    return fail("train.global_batch_size", L.global_batch_size,
      `a multiple of train.micro_batch_size (${L.micro_batch_size})`);
  const par = positive([["parallel.pp", "pp"], ["parallel.dp", "dp"], ["parallel.ep", "ep"],
    ["parallel.virtual_stages", "virtual_stages"]]);
  if (par) return par;
  if (L.virtual_stages > 1 && L.pp < 2)
    return fail("parallel.pp", L.pp, "at least 2 with parallel.pp_schedule=interleaved_1f1b");
  const cluster = positive([["cluster.nodes", "nodes"],
    ["cluster.procs_per_node", "gpus_per_node"]]);
  if (cluster) return cluster;
  if (L.seq_len > m.max_seq_len)
    return fail("train.seq_len", L.seq_len, `at most model.max_seq_len (${m.max_seq_len})`);
  if (m.n_experts % L.ep)
    return fail("parallel.ep", L.ep, `a divisor of model.n_experts (${m.n_experts})`);
  const chunks = L.pp * L.virtual_stages;
  if (m.n_layers % chunks)
    return fail("parallel.pp", L.pp,
      `pp x virtual_stages (${chunks}) must divide model.n_layers (${m.n_layers}) ` +
      "so every stage gets whole blocks");
  const perStep = L.micro_batch_size * dpep;
  if (L.global_batch_size % perStep)
    return fail("train.global_batch_size", L.global_batch_size,
      `a multiple of micro_batch_size x dp x ep (${perStep})`);
  const nMicro = L.global_batch_size / perStep;
  if (L.virtual_stages > 1 && nMicro % L.pp)
    return fail("train.global_batch_size", L.global_batch_size,
      `interleaved 1F1B needs micro-batches per step (${nMicro}) divisible by ` +
      `parallel.pp (${L.pp})`);
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

// Memory per stage, communication, time per step and the refusal of layout L (see plan.py).
function planLayout(data, L) {
  const model = data.models[L.model];
  const m = model.config;
  const refusal = configRefusal(m, L);
  if (refusal) return { refusal };
  const C = data.constants;
  const prec = data.precisions[L.precision];
  const gpu = data.gpus[L.gpu];
  const bp = C.dtype_bytes[prec.param_dtype];
  const bc = C.dtype_bytes[prec.dtype];
  const bo = C.dtype_bytes[prec.optimizer_dtype];
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
  const headAct = T * (m.vocab_size * (bc + 8) + d * (4 + bp + bc));
  let epBuffers = 0, extraLayer = 0, extraFull = 0;
  if (L.ep > 1 && L.dispatcher === "nvshmem_rowwise") {
    const rows = L.ep * T; // dropless capacity (parallel.dispatch.rowwise_capacity)
    const assignments = L.ep * T * Math.min(k, E / L.ep);
    epBuffers = (rows + 1) * d * bp + (rows + 1) * 2 * k * 4 + L.ep * L.ep * 8;
    const moreRows = assignments - T * k;
    extraFull = moreRows * (bp * (d + 3 * h) + 4);
    extraLayer = extraFull - (L.recompute === "selective" ? moreRows * bp * h : 0);
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
    if (autogradGrads) {
      grads = bp * (dense + experts);
      transient = 0;
    }
    const stateBytes = 2 * bo + (bp < bo ? 4 : 0);
    const optimizer = stateBytes * (dense / dpep + experts / L.dp);
    const flight = inFlight(L.pp, v, s, nMb);
    let activations = block
      ? flight * perChunk * T * d * bp + T * aFull + extraFull
      : flight * perChunk * (T * aLayer + extraLayer);
    if (last) activations += headAct;
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
  const forward = rows * (d * bp + 12 * k) + rows * d * bp;
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

if (typeof module !== "undefined") module.exports = { planLayout, inFlight };
