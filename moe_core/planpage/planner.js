// The planner's arithmetic (moe_core/plan/: plan.planner.plan, plan.timing.step_time,
// plan.checks.fit_refusal and the config checks a layout can trip) over the numbers Python
// exports into the page: parameter shapes, activation bytes per token, FLOPs per token,
// all-to-all rows and every constant. It mirrors plan.memory, plan.communication and
// plan.timing statement by statement; tests/test_plan_page.py runs it (QuickJS) against plan()
// on a grid of models x GPU types x layouts. Leading dense blocks (ModelConfig.n_dense_layers) are
// counted per chunk, apart from MoE blocks (plan.memory.chunk_blocks); only MoE layers send
// all-to-all traffic. For sizes typed into the page (the "custom sizes" model), modelData
// computes what planpage.model_data exports, mirroring the Python functions it calls, for the
// block options of the model they start from; the tests hold the two equal on a grid of configs.
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
    data_parallel: L.dp * L.ep, fp8_dispatch: prec.fp8_parts.includes("dispatch"),
    context: L.cp > 1, context_chunks: 2 * L.cp };
  for (const [name, v] of Object.entries(m)) q[`model.${name}`] = v;
  for (const [name, v] of Object.entries(prec)) q[`precision.${name}`] = v;
  for (const name of ["seq_len", "micro_batch_size", "global_batch_size"])
    q[`train.${name}`] = L[name];
  q["train.eval_batches"] = Math.max(q.data_parallel, 1); // as run_of sets it
  for (const name of ["pp", "dp", "ep", "cp", "virtual_stages", "dispatcher"])
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

// moe_core.config.fp8_linear_shapes: [part, projection, out, in] of each linear that the
// parts swap for FP8 (every layer alike, so each projection once).
function fp8LinearShapes(m, parts) {
  const q = m.n_heads * m.head_dim, kv = m.n_kv_heads * m.head_dim, d = m.d_model;
  // the dense SwiGLUs: the shared expert (when n_shared_experts > 0), the leading dense blocks'
  const widths = new Set([m.n_shared_experts * m.expert_hidden, m.dense_hidden || 0]);
  let attention = [["q_proj", q, d], ["k_proj", kv, d], ["v_proj", kv, d], ["o_proj", d, q]];
  if (m.kv_lora_rank !== null) { // multi-head latent attention's projections
    const H = m.n_heads, rank = m.kv_lora_rank;
    const queries = m.q_lora_rank === null ? [["q_proj", q, d]]
      : [["q_a_proj", m.q_lora_rank, d], ["q_b_proj", q, m.q_lora_rank]];
    attention = [...queries, ["kv_a_proj", rank + m.qk_rope_head_dim, d],
      ["kv_b_proj", H * (m.qk_nope_head_dim + m.v_head_dim), rank],
      ["o_proj", d, H * m.v_head_dim]];
  }
  const linears = {
    attention,
    dense: [...widths].filter((h) => h).flatMap((h) =>
      [["w_gate", h, d], ["w_up", h, d], ["w_down", d, h]]),
    lm_head: [["lm_head", m.vocab_size, d]],
  };
  return parts.flatMap((part) => (linears[part] || []).map((shape) => [part, ...shape]));
}

// The checks of moe_core.config.RunConfig that read the model beside the precision and the
// layout (after the rules), in its order: the sentence, or null. align: FP8_GEMM_ALIGN.
function runRefusal(m, L, prec, align) {
  const fail = (name, value, allowed) => `${name}=${pyValue(value)} is not allowed: ${allowed}.`;
  const parts = prec.fp8_parts;
  if (parts.includes("dense") && !(m.n_shared_experts || m.n_dense_layers))
    return fail("precision.fp8_parts", parts, "a list without 'dense' when " +
      "model.n_shared_experts=0 and model.n_dense_layers=0 ('dense' is the shared expert's " +
      "and the dense blocks' SwiGLU, which this model does not have)");
  if (parts.includes("attention") && m.attention_bias !== "none")
    return fail("precision.fp8_parts", parts, "a list without 'attention' when " +
      `model.attention_bias=${pyValue(m.attention_bias)} (FP8 projections are built for ` +
      "linears without bias)");
  if (m.tie_embeddings && parts.includes("lm_head"))
    return fail("precision.fp8_parts", parts, "a list without 'lm_head' when " +
      "model.tie_embeddings=true (the tied head is the embedding matrix, kept in the " +
      "weights' dtype)");
  if (m.tie_embeddings && L.pp > 1)
    return `model.tie_embeddings=true with parallel.pp=${L.pp} is not built yet: a tied LM ` +
      "head reads the embedding, which lives on the first pipeline stage; untie the " +
      "embeddings or train without pipeline stages.";
  for (const [part, name, nOut, nIn] of fp8LinearShapes(m, parts))
    if (nOut % align || nIn % align)
      return fail("precision.fp8_parts", parts, `part ${pyValue(part)} runs ${name}, a ` +
        `[${nOut}, ${nIn}] weight, as an FP8 GEMM, which needs both dimensions divisible by ` +
        `${align}; leave ${pyValue(part)} out (or choose model sizes that divide by ${align})`);
  return null;
}

// The first config check the layout fails (the sentence moe_core.config raises), or null;
// prec: the layout's precision section; the layout rules come from the table (rules);
// constants: the page's (FP8_GEMM_ALIGN).
function configRefusal(m, L, prec, rules, constants) {
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
    ["parallel.cp", "cp"], ["parallel.virtual_stages", "virtual_stages"]]) ||
    ruleRefusal(rules, "parallel", q);
  if (par) return par;
  const cluster = positive([["cluster.nodes", "nodes"],
    ["cluster.procs_per_node", "gpus_per_node"]]);
  if (cluster) return cluster;
  const run = ruleRefusal(rules, "run", q) || runRefusal(m, L, prec, constants.fp8_gemm_align);
  if (run) return run;
  const world = L.pp * dpep * L.cp;
  const procs = L.nodes * L.gpus_per_node;
  if (procs !== world) {
    const axes = L.cp > 1 ? ["pp", "dp", "cp", "ep"] : ["pp", "dp", "ep"];
    const hint = world % L.gpus_per_node === 0
      ? `set cluster.nodes=${world / L.gpus_per_node}`
      : `change cluster.nodes/procs_per_node or parallel.${axes.join("/")}`;
    return `cluster 'page' starts cluster.nodes x cluster.procs_per_node = ${L.nodes} x ` +
      `${L.gpus_per_node} = ${procs} processes but the layout parallel.${axes.join(" x ")} = ` +
      `${axes.map((a) => L[a]).join(" x ")} needs ${world}: ${hint}.`;
  }
  return null;
}

// plan.checks.layout_text: "pp 1 x dp 2 x ep 4", with "x cp 2" before ep under context
// parallelism.
function layoutText(L) {
  return `pp ${L.pp} x dp ${L.dp}${L.cp > 1 ? ` x cp ${L.cp}` : ""} x ep ${L.ep}`;
}

// Context parallelism (layout L's cp > 1), per attention layer and micro-batch of T tokens a
// rank holds, bc bytes per compute element: what plan.memory.context_activation_bytes keeps
// (the gathered keys and values; latent attention: its gathered compressed key-value and the
// other ranks' expansions, none under selective recompute) and what
// plan.communication.context_bytes_per_layer sends (all-gather + gradient reduce-scatter, the
// forward again where it is recomputed).
function contextBytes(m, L, T, bc) {
  if (L.cp === 1) return { kept: 0, sent: 0 };
  const latent = m.kv_lora_rank !== null;
  const kv = m.n_kv_heads === null ? m.n_heads : m.n_kv_heads;
  const hd = latent ? m.qk_nope_head_dim + m.qk_rope_head_dim
    : m.head_dim === null ? Math.floor(m.d_model / m.n_heads) : m.head_dim;
  let kept = (L.cp - 1) * T * 2 * kv * hd * bc;
  if (latent) {
    const expanded = m.n_heads * hd + m.n_heads * (m.qk_nope_head_dim + m.v_head_dim);
    kept = L.recompute === "selective" ? 0
      : T * bc * ((L.cp - 1) * expanded + L.cp * m.kv_lora_rank);
  }
  const width = latent ? m.kv_lora_rank + m.qk_rope_head_dim : 2 * kv * hd;
  const again = L.recompute === "block" || (L.recompute === "selective" && latent);
  return { kept, sent: (L.cp - 1) * T * width * bc * (again ? 3 : 2) };
}

// Memory per stage, communication, time per step and the refusal of layout L (see
// plan.planner.plan).
function planLayout(data, L) {
  const model = data.models[L.model];
  const m = model.config;
  const prec = data.precisions[L.precision];
  const refusal = configRefusal(m, L, prec, data.rules, data.constants);
  if (refusal) return { refusal };
  const C = data.constants;
  const gpu = data.gpus[L.gpu];
  const bp = C.dtype_bytes[prec.params];
  const bc = C.dtype_bytes[prec.compute];
  const bo = C.dtype_bytes[prec.optimizer];
  const sh = model.shapes;
  const d = m.d_model, k = m.top_k, E = m.n_experts, h = m.expert_hidden;
  const T = Math.floor((L.micro_batch_size * L.seq_len) / L.cp); // a rank's share (cp)
  const dpep = L.dp * L.ep;
  // parallel.ddp.reduce_groups: dense weights over dp x cp x ep ranks, experts over dp x cp
  const denseGroup = dpep * L.cp, expertGroup = L.dp * L.cp;
  const context = contextBytes(m, L, T, C.dtype_bytes[prec.compute]);
  const gathered = context.kept; // every block's attention, each layer
  const nMb = L.global_batch_size / (L.micro_batch_size * dpep);
  const v = L.virtual_stages;
  const nChunks = L.pp * v;
  const perChunk = m.n_layers / nChunks;
  const block = L.recompute === "block";
  const autogradGrads = denseGroup === 1 && (nMb === 1 || bp === bo);
  const acts = model.activation[L.precision];
  // counted for one EP rank, where FP8 experts with rowwise scales quantize in the permute
  // and keep the tokens, not k rows each; under EP they keep the received rows
  // (plan.memory.experts_keep)
  const rowsBack = L.ep > 1 && fp8InPermute(prec) ? (k - 1) * d * bp : 0;
  const aLayer = acts[block ? "none" : L.recompute] + rowsBack;
  const aFull = acts.none + rowsBack;
  // a leading dense block's, per token and micro-batch (plan.memory.activation_bytes)
  const denseActs = model.dense_activation[L.precision];
  const denseFull = m.n_dense_layers ? T * denseActs.none + gathered : 0;
  const denseLayer = m.n_dense_layers
    ? T * denseActs[block ? "none" : L.recompute] + gathered : 0;
  // plan.memory.chunk_blocks: [dense, MoE] blocks of a chunk (the leading layers are dense)
  const chunkBlocks = (c) => {
    const dense = Math.max(0, Math.min((c + 1) * perChunk, m.n_dense_layers) - c * perChunk);
    return [dense, perChunk - dense];
  };
  const headAct = T * (2 * m.vocab_size * bc + d * (bp + bc)); // compiled (GPU runs)
  let epBuffers = 0, extraLayer = 0, extraFull = 0;
  if (L.ep > 1 && L.dispatcher === "nvshmem_rowwise") {
    const rows = L.ep * T; // dropless capacity (parallel.dispatch.rowwise_capacity)
    const assignments = L.ep * T * Math.min(k, E / L.ep);
    // parallel.dispatch.RowwiseExchange.buffer_shapes: FP8 rows' scales in the routing rows
    const routeWidth = 2 * k + (prec.fp8_parts.includes("dispatch") ? 1 : 0);
    epBuffers = (rows + 1) * d * bp + (rows + 1) * routeWidth * 4 + L.ep * L.ep * 8;
    const moreRows = assignments - T * k;
    // plan.memory.rowwise_buffers: FP8 experts keep no SwiGLU output (experts_keep)
    const swigluOut = prec.fp8_parts.includes("experts") ? 0 : 1;
    extraFull = moreRows * (bp * (d + (2 + swigluOut) * h) + 4);
    extraLayer = extraFull - (swigluOut && L.recompute === "selective" ? moreRows * bp * h : 0);
  }
  // plan.memory.pipeline_send_bytes: with MTP the token embeddings travel beside the hidden
  const message = (m.mtp_depth ? 2 : 1) * T * d * bp + 4;
  // plan.memory.mtp_activation_bytes: per MTP depth an MoE block, the head's share, its inputs
  const mtpActs = m.mtp_depth * ((block ? T * d * bp : T * aLayer + extraLayer) + headAct +
    T * d * (2 * (4 + bp) + 2 * bc));
  const reserve = pyRound(C.reserve_gib * C.gib);

  const stages = [];
  const sent = [];
  for (let s = 0; s < L.pp; s++) {
    const chunks = Array.from({ length: v }, (_, i) => s + i * L.pp);
    const blocks = chunks.map(chunkBlocks);
    const denseBlocks = blocks.reduce((a, [n]) => a + n, 0);
    let moeLayers = blocks.reduce((a, [, n]) => a + n, 0);
    let dense = moeLayers * sh.layer_dense + denseBlocks * sh.dense_block;
    let largest = 0;
    if (moeLayers) largest = Math.max(sh.largest_dense, Math.floor(sh.largest_expert / L.ep));
    if (denseBlocks) largest = Math.max(largest, sh.largest_dense_block);
    if (chunks.includes(0)) {
      dense += sh.embedding;
      largest = Math.max(largest, sh.embedding);
    }
    const last = chunks.includes(nChunks - 1);
    if (last) {
      dense += sh.final_norm + sh.head;
      largest = Math.max(largest, sh.head);
      if (m.mtp_depth) { // the MTP modules: MoE blocks with their own norms and projection
        moeLayers += m.mtp_depth;
        dense += m.mtp_depth * (sh.layer_dense + sh.mtp_own);
        largest = Math.max(largest, sh.largest_dense, Math.floor(sh.largest_expert / L.ep),
          sh.largest_mtp_own);
      }
    }
    const experts = Math.floor((moeLayers * sh.layer_expert) / L.ep);
    // plan.memory.fp8_copy_bytes: FP8 experts with the weight cache (a precision option) keep
    // two E4M3 copies and their scales
    const fp8Copies = prec.fp8_weight_cache && prec.fp8_parts.includes("experts")
      ? 2 * experts + moeLayers * 4 * Math.floor(E / L.ep) * (3 * h + 2 * d) : 0;
    const denseShard = denseGroup > 1 ? dense / denseGroup : 0;
    const expertShard = expertGroup > 1 ? experts / expertGroup : 0;
    let grads = bo * (dense + experts) + bo * (denseShard + expertShard);
    let transient = largest * bp;
    const stateBytes = 2 * bo + (bp < bo ? 4 : 0);
    const optimizer = stateBytes * (dense / denseGroup + experts / expertGroup);
    const flight = inFlight(L.pp, v, s, nMb);
    // block recompute: backward's two phases, the head's beside the blocks' kept inputs, then
    // one block at a time rematerialized (the largest kind held), its backward holding its
    // activations and their gradients (plan.memory.recomputed_block_bytes); else in-flight
    // forwards of the rank's largest chunk
    const kept = flight * perChunk * T * d * bp;
    const remat = block ? kept + C.remat_backward * Math.max(
      moeLayers ? T * aFull + extraFull + gathered : 0, denseBlocks ? denseFull : 0) : 0;
    const headPart = last ? headAct + mtpActs : 0;
    const activations = block
      ? Math.max(kept + headPart, remat)
      : flight * Math.max(...blocks.map(([nDense, nMoe]) =>
        nMoe * (T * aLayer + extraLayer + gathered) + nDense * denseLayer)) + headPart;
    if (autogradGrads) {
      grads = bp * (dense + experts);
      // one micro-batch: written as backward frees the activations, except under block
      // recompute, where they stand beside the rematerialized block
      // (plan.memory.gradients_follow_activations, recomputed_block_bytes)
      if (nMb === 1) grads = Math.max(0, grads - (activations - remat));
      transient = 0;
    }
    const messages =
      chunks.filter((c) => c < nChunks - 1).length + chunks.filter((c) => c > 0).length;
    sent.push(messages * nMb * message);
    const parts = {
      weights: (dense + experts) * bp + fp8Copies,
      grad_buffers: pyRound(grads),
      optimizer: pyRound(optimizer),
      activations,
      p2p_buffers: L.pp > 1 ? sent[s] : 0,
      ep_buffers: epBuffers,
      transient,
      reserve,
    };
    const total = Object.values(parts).reduce((a, b) => a + b, 0);
    const layers = denseBlocks + moeLayers;
    stages.push({ stage: s, dense, experts, layers, moeLayers, parts, total });
  }
  const busiest = stages.reduce((a, b) => (b.total > a.total ? b : a));
  const heaviest = stages.reduce((a, b) => (b.dense + b.experts > a.dense + a.experts ? b : a));

  const rows = model.rows_per_token[L.ep];
  // plan.communication.communication: where a token's rows go, and under plain top-k
  const rule = routingRule(m);
  const reach = routingReach(rule, L.ep, L.gpus_per_node);
  const plain = routingReach({ ...rule, G: 1, kg: 1 }, L.ep, L.gpus_per_node);
  const rowOut = prec.fp8_parts.includes("dispatch") ? d + 4 : d * bp; // FP8 rows: E4M3 + scale
  const forward = rows * (rowOut + 12 * k) + rows * d * bp;
  const backward = rows * d * bp + rows * (d * bp + 4 * k);
  const sizes = L.ep > 1 ? ring(L.ep * (1 + Math.floor(E / L.ep)) * 8, L.ep) : 0;
  let perLayer = T * (forward + backward) + sizes;
  if (block) perLayer += T * forward + sizes;
  const moeLayers = Math.max(...stages.map((st) => st.moeLayers)); // only MoE layers dispatch
  const comm = {
    all_to_all: pyRound(perLayer * moeLayers * nMb),
    reduce_scatter: pyRound(ring(bo * heaviest.dense, denseGroup) +
      ring(bo * heaviest.experts, expertGroup)),
    all_gather: pyRound(ring(bp * heaviest.dense, denseGroup) +
      ring(bp * heaviest.experts, expertGroup)),
    pipeline: L.pp > 1 ? Math.max(...sent) : 0,
    context_per_layer: pyRound(context.sent),
    context: pyRound(context.sent * Math.max(...stages.map((st) => st.layers)) * nMb),
  };

  // step_time
  const perNode = Math.max(L.gpus_per_node, 1);
  const world = L.pp * denseGroup;
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
    reduce_scatter: ringSeconds(comm.reduce_scatter, denseGroup),
    all_gather: ringSeconds(comm.all_gather, denseGroup),
    pipeline: ringSeconds(comm.pipeline, world),
    // a context-parallel group spans its cp x ep consecutive ranks (mesh order)
    context: L.cp > 1 ? ringSeconds(comm.context, L.cp * L.ep) : 0,
  };
  const idle = (L.pp - 1) / v;
  time.bubble = idle / (nMb + idle);
  time.step = (compute + a2a + time.pipeline + time.context) / (1 - time.bubble) +
    time.reduce_scatter + time.all_gather;
  time.tokens_per_s_per_gpu = tokens / L.pp / time.step;
  time.mfu = (time.tokens_per_s_per_gpu * model.flops_per_token[L.seq_len]) /
    (gpu.peak_tflops * 1e12);

  let fit = null;
  if (busiest.total > gpu.memory_gib * C.gib) {
    fit = `model ${m.name} with layout ${layoutText(L)} needs ` +
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
    reach,
    plain,
    time,
  };
}

// ---- custom sizes: planpage.model_data in the page --------------------------------------

// The ModelConfig fields the page's custom model takes (in the dataclass's order); the others
// (QK-norm, rotary share, attention biases, router and groups, tied embeddings, losses, init)
// keep the values of the model it started from, and the counts below follow them.
const MODEL_SIZES = ["vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
  "n_experts", "top_k", "expert_hidden", "n_shared_experts", "n_dense_layers", "dense_hidden",
  "max_seq_len"];
// Sizes that may be null (None in Python): n_kv_heads as many as n_heads, head_dim d_model /
// n_heads, dense_hidden none (no dense blocks).
const NULLABLE_SIZES = ["n_kv_heads", "head_dim", "dense_hidden"];

// Python's repr() of a value the page can read from an input or a config: a number, a string
// or null (None).
function pyRepr(value) {
  if (value === null) return "None";
  return typeof value === "string" ? `'${value}'` : String(value);
}

// Python's repr() of a float (the fractions a config holds: 1.0, 0.5).
function pyFloat(x) {
  return Number.isInteger(x) ? x.toFixed(1) : String(x);
}

// Python's f"{n:,}".
function commas(n) {
  return String(n).replace(/\B(?=(\d{3})+(?!\d))/g, ",");
}

// The first sentence moe_core.config raises for these sizes, or null: from_dict's type check
// of each field, then ModelConfig.__post_init__'s checks of them (and of the fields they meet:
// rotary_fraction, the expert groups), in its order; limits: config.MAX_SIZES.
function modelRefusal(data, c) {
  const p = "model.";
  const fail = (name, value, allowed) => `${p}${name}=${pyRepr(value)} is not allowed: ${allowed}.`;
  for (const name of MODEL_SIZES) {
    const v = c[name];
    if (NULLABLE_SIZES.includes(name) && v === null) continue;
    if (typeof v !== "number" || !Number.isInteger(v)) return fail(name, v, "an integer");
  }
  for (const name of ["vocab_size", "d_model", "n_layers", "n_heads", "n_experts", "top_k",
    "expert_hidden", "max_seq_len"])
    if (!(c[name] > 0)) return fail(name, c[name], "it must be positive");
  for (const name of ["n_shared_experts", "n_dense_layers"])
    if (c[name] < 0) return fail(name, c[name], "it must be zero or positive");
  const kv = c.n_kv_heads === null ? c.n_heads : c.n_kv_heads;
  if (!(kv > 0)) return fail("n_kv_heads", kv, "it must be positive");
  let hd = c.head_dim;
  if (c.kv_lora_rank !== null) { // ModelConfig._check_latent (the latent sizes are the model's)
    const qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
    const mla = "multi-head latent attention (model.kv_lora_rank set)";
    if (hd !== null && hd !== qk)
      return fail("head_dim", hd, `unset or ${qk} (qk_nope + qk_rope) with ${mla}`);
    hd = qk;
    if (kv !== c.n_heads) return fail("n_kv_heads", kv, `model.n_heads or unset with ${mla}`);
  }
  if (hd === null) {
    if (c.d_model % c.n_heads)
      return fail("n_heads", c.n_heads,
        `it must divide model.d_model (${c.d_model}), or set model.head_dim`);
    hd = c.d_model / c.n_heads;
  }
  if (!(hd > 0)) return fail("head_dim", hd, "it must be positive");
  const sized = { ...c, n_kv_heads: kv, head_dim: hd };
  for (const [name, limit] of Object.entries(data.constants.max_sizes))
    if (sized[name] !== null && sized[name] > limit)
      return fail(name, sized[name], `at most ${commas(limit)}, as no real model is larger`);
  if (c.top_k > c.n_experts)
    return fail("top_k", c.top_k, `at most model.n_experts (${c.n_experts})`);
  if (c.n_heads % kv) return fail("n_kv_heads", kv, `it must divide model.n_heads (${c.n_heads})`);
  const rotary = c.kv_lora_rank !== null ? c.qk_rope_head_dim
    : Math.floor(hd * c.rotary_fraction);
  if (rotary === 0 || rotary % 2)
    return fail("head_dim", hd, `head_dim x rotary_fraction (${hd} x ` +
      `${pyFloat(c.rotary_fraction)}, rounded down) must be a positive even number of rotated ` +
      "dimensions");
  if (c.n_dense_layers >= c.n_layers)
    return fail("n_dense_layers", c.n_dense_layers, `fewer than model.n_layers ` +
      `(${c.n_layers}), so at least one block has experts`);
  if ((c.dense_hidden === null) !== (c.n_dense_layers === 0))
    return fail("dense_hidden", c.dense_hidden, "a positive width exactly when " +
      `model.n_dense_layers > 0 (it ${c.dense_hidden === null ? "is unset" : "is set"} with ` +
      `n_dense_layers=${c.n_dense_layers})`);
  if (c.dense_hidden !== null && !(c.dense_hidden > 0))
    return fail("dense_hidden", c.dense_hidden, "it must be positive");
  // ModelConfig._check_groups
  const groups = c.n_expert_groups, perGroup = Math.floor(c.n_experts / groups);
  if (c.n_experts % groups)
    return fail("n_expert_groups", groups, `it must divide model.n_experts (${c.n_experts})`);
  if (groups > 1 && perGroup < 2)
    return fail("n_expert_groups", groups,
      "at most model.n_experts / 2: each group is scored by its two best experts");
  if (c.top_k_groups > groups)
    return fail("top_k_groups", c.top_k_groups, `at most model.n_expert_groups (${groups})`);
  if (c.top_k > c.top_k_groups * perGroup)
    return fail("top_k", c.top_k,
      `at most top_k_groups x experts per group (${c.top_k_groups} x ${perGroup})`);
  return null;
}

// plan.memory.parameter_counts: the tensors of an MoE transformer.Block (attention.Attention:
// q, k, v, o projections, their biases and QK-norm as the config says; moe.MoE: router,
// Experts, the shared SwiGLU), of a leading dense Block (attention, its SwiGLU) and the
// model's ends (no LM head when tied), by place, as the Python function reads them off
// meta-device modules. c: a config with n_kv_heads and head_dim resolved.
function parameterCounts(c) {
  const d = c.d_model, hd = c.head_dim, h = c.expert_hidden, E = c.n_experts;
  const q = c.n_heads * hd, kv = c.n_kv_heads * hd, hs = c.n_shared_experts * h;
  const biases = { none: [], qkv: [q, kv, kv], qkvo: [q, kv, kv, d] }[c.attention_bias];
  const qkNorm = { none: [], projection: [q, kv], head: [hd, hd] }[c.qk_norm];
  // attn_norm, q, k, v, o, their biases, q_norm and k_norm, the feed-forward's norm
  let attention = [d, q * d, kv * d, kv * d, d * q, ...biases, ...qkNorm, d];
  if (c.kv_lora_rank !== null) { // attention.LatentAttention's, in its order
    const rq = c.q_lora_rank, rkv = c.kv_lora_rank, H = c.n_heads;
    const queries = rq === null ? [q * d] : [rq * d, rq, q * rq];
    attention = [d, ...queries, (rkv + c.qk_rope_head_dim) * d, rkv,
      H * (c.qk_nope_head_dim + c.v_head_dim) * rkv, d * H * c.v_head_dim, d];
  }
  const moe = [...attention, E * d]; // + router
  if (hs) moe.push(hs * d, hs * d, d * hs); // shared SwiGLU: gate, up, down
  const experts = [E * 2 * h * d, E * d * h]; // w_gate_up, w_down
  const hDense = c.dense_hidden;
  const dense = c.n_dense_layers ? [...attention, hDense * d, hDense * d, d * hDense] : [0];
  const sum = (xs) => xs.reduce((a, b) => a + b, 0);
  return {
    layer_dense: sum(moe),
    layer_expert: sum(experts),
    largest_dense: Math.max(...moe),
    largest_expert: Math.max(...experts),
    dense_block: sum(dense),
    largest_dense_block: Math.max(...dense),
    embedding: c.vocab_size * d,
    head: c.tie_embeddings ? 0 : d * c.vocab_size,
    final_norm: d,
    // an MTP module beside its block: enorm, hnorm, eh_proj [d, 2d], its output norm
    mtp_own: c.mtp_depth ? d + d + 2 * d * d + d : 0,
    largest_mtp_own: c.mtp_depth ? 2 * d * d : 0,
  };
}

// moe_core.model.flops.count at seqLen, term by term.
function modelCounts(c, seqLen) {
  const d = c.d_model, nLayers = c.n_layers, vocab = c.vocab_size;
  const nDense = c.n_dense_layers, nMoe = nLayers - nDense;
  const q = c.n_heads * c.head_dim, kv = c.n_kv_heads * c.head_dim;
  let attention = 2 * d * q + 2 * d * kv; // q, o; k, v projections
  let vDim = q; // what attention's weighted sum of values spans, over the heads
  const biases = { none: 0, qkv: q + 2 * kv, qkvo: q + 2 * kv + d }[c.attention_bias];
  let qkNorm = { none: 0, head: 2 * c.head_dim, projection: q + kv }[c.qk_norm];
  if (c.kv_lora_rank !== null) { // latent attention: its projections and latent norms
    const rank = c.kv_lora_rank, rq = c.q_lora_rank, H = c.n_heads;
    vDim = H * c.v_head_dim;
    const queries = rq === null ? d * q : d * rq + rq * q;
    attention = queries + d * (rank + c.qk_rope_head_dim) +
      rank * H * (c.qk_nope_head_dim + c.v_head_dim) + vDim * d;
    qkNorm = rank + (rq || 0);
  }
  const layerOther = 2 * d + qkNorm + biases; // no FLOPs counted for these
  const shared = 3 * d * c.n_shared_experts * c.expert_hidden;
  const expert = 3 * d * c.expert_hidden;
  const router = c.n_experts * d;
  const denseMlp = 3 * d * (c.dense_hidden || 0);
  const embedding = vocab * d, finalNorm = d, head = d * vocab;
  // MTP depths: each an MoE block with its two input norms, projection and output norm
  const nMtp = c.mtp_depth, mtpProj = 2 * d * d, mtpNorms = 3 * d;
  const nMoeAll = nMoe + nMtp, nBlocks = nLayers + nMtp;
  const experts = nMoeAll * c.n_experts * expert;
  const total = embedding + nBlocks * (attention + layerOther) + nMoeAll * (router + shared) +
    experts + nDense * denseMlp + finalNorm + (c.tie_embeddings ? 0 : head) +
    nMtp * (mtpProj + mtpNorms);
  const active = total - nMoeAll * (c.n_experts - c.top_k) * expert;
  const matmulActive = nBlocks * attention + nMoeAll * (shared + c.top_k * expert) +
    nDense * denseMlp + (1 + nMtp) * head + nMtp * mtpProj;
  const flops = 6 * matmulActive + 3 * nBlocks * seqLen * (q + vDim);
  return {
    total_params: total,
    active_params: active,
    matmul_active_params: matmulActive,
    expert_params: experts,
    embedding_params: embedding,
    flops_per_token: flops,
  };
}

// plan.memory.attention_activation_bytes, compiled (the page's runs are on GPUs): norms,
// attention (a copy of its output where RoPE rotates part of each head).
function attentionActivationBytes(c, bp, bc, selective) {
  if (c.kv_lora_rank !== null) return latentAttentionActivationBytes(c, bp, bc, selective);
  const d = c.d_model, q = c.n_heads * c.head_dim, kv = c.n_kv_heads * c.head_dim;
  const qk = c.qk_norm !== "none" ? q + kv : 0;
  const stats = { none: 0, projection: 2, head: c.n_heads + c.n_kv_heads }[c.qk_norm];
  const norms = 3 * d * bp + qk * bc + 4 * (2 + stats);
  let attention = bc * (d + 2 * q + 2 * kv) + 4 * c.n_heads;
  if (Math.floor(c.head_dim * c.rotary_fraction) < c.head_dim) attention += bc * q;
  return norms + attention;
}

// plan.memory.latent_attention_activation_bytes, compiled: the block norms, the latent norms'
// inputs, the full q and k, the expanded key-value projection, the output, the log-sum-exp;
// under selective recompute q, the rotated rotary key and the output.
function latentAttentionActivationBytes(c, bp, bc, selective) {
  const d = c.d_model, r = c.qk_rope_head_dim, H = c.n_heads;
  const q = H * c.head_dim, v = H * c.v_head_dim;
  const latent = (c.q_lora_rank || 0) + c.kv_lora_rank;
  const norms = 3 * d * bp + (latent + r) * bc + 4 * (3 + (c.q_lora_rank !== null ? 1 : 0));
  if (selective) return norms + bc * (d + q + r + v);
  return norms + bc * (d + 2 * q + H * (c.qk_nope_head_dim + c.v_head_dim) + v) + 4 * H;
}

// moe_core.planpage.fp8_in_permute
function fp8InPermute(prec) {
  return prec.fp8_parts.includes("experts") && prec.fp8_scaling === "rowwise";
}

// plan.memory.layer_activation_bytes (recompute "none" or "selective", compiled: the page's
// runs are on GPUs), term by term, with plan.memory.experts_keep for the page's runs
// (expert_gemm auto, no gathered rows, one EP rank): FP8 experts keep no SwiGLU output, and
// with rowwise scales the tokens instead of their expert-ordered rows.
function layerActivationBytes(data, c, paramDtype, computeDtype, recompute, fp8Experts,
  fp8RowsIn) {
  const bp = data.constants.dtype_bytes[paramDtype], bc = data.constants.dtype_bytes[computeDtype];
  const d = c.d_model, h = c.expert_hidden, k = c.top_k, e = c.n_experts;
  const hShared = c.n_shared_experts * h;
  const groups = c.n_expert_groups > 1 ? 17 * c.n_expert_groups : 0;
  const router = 12 * e + 20 * k + groups;
  let experts = bp * k * (d + 3 * h) + 4 * k;
  if (recompute === "selective" || fp8Experts) experts -= bp * k * h;
  if (fp8RowsIn) experts -= bp * (k - 1) * d;
  const sharedInput = bp === 4 && bc === 4 ? 0 : bc * d;
  const shared = hShared ? bc * 4 * hShared + sharedInput : 0;
  const selective = recompute === "selective";
  return attentionActivationBytes(c, bp, bc, selective) + router + experts + shared;
}

// plan.memory.dense_layer_activation_bytes, compiled: a leading dense block's (recompute
// "none" or "selective").
function denseLayerActivationBytes(data, c, paramDtype, computeDtype, recompute) {
  const bp = data.constants.dtype_bytes[paramDtype], bc = data.constants.dtype_bytes[computeDtype];
  const selective = recompute === "selective";
  return attentionActivationBytes(c, bp, bc, selective) + 4 * bc * c.dense_hidden -
    bp * c.d_model;
}

// C(N - a, b) / C(N, b), which equals C(N - b, a) / C(N, a), multiplied out over the fewer
// factors; once it is below 2^-60, 1 - it is 1.0 in floating point, as it is for Python's exact
// ratio, so the product stops there.
function combRatio(N, a, b) {
  if (a + b > N) return 0;
  let r = 1;
  for (let i = 0; i < Math.min(a, b) && r >= 2 ** -60; i++) r *= (N - Math.max(a, b) - i) / (N - i);
  return r;
}

// parallel.placement.RoutingRule.of: what routing decides about placement.
function routingRule(c) {
  return { E: c.n_experts, k: c.top_k, G: c.n_expert_groups, kg: c.top_k_groups };
}

// parallel.placement._miss_of: the probability that a token picks none of a block's experts,
// the block meeting f groups wholly and others by the (sorted) partial overlaps: the sum over
// the partly met groups kept (A) and j of the whole ones of C(f, j) C(G - t, kg - |A| - j) /
// C(G, kg) (those kept, the other met groups not) times C(M - c, k) / C(M, k), M = kg g, c the
// block's experts among the kept groups'. The first factor as a product of ratios at the
// smallest j possible, then step by step in j.
function missOf(rule, f, partial) {
  const { E, k, G, kg } = rule;
  const g = E / G, t = f + partial.length, M = kg * g;
  let q = 0;
  for (let mask = 0; mask < 1 << partial.length; mask++) {
    const kept = partial.filter((_, i) => (mask >> i) & 1);
    const a = kept.length, o = kept.reduce((x, y) => x + y, 0);
    const j0 = Math.max(0, kg - a - (G - t));
    const j1 = Math.min(f, kg - a);
    if (j0 > j1) continue;
    let w = 1; // C(f, j0) C(G - t, kg - a - j0) / C(G, kg)
    for (let i = 0; i < j0; i++) w *= (f - i) / (i + 1);
    const s0 = a + j0;
    for (let i = 0; i < s0; i++) w *= (kg - i) / (G - i);
    for (let i = 0; i < t - s0; i++) w *= (G - kg - i) / (G - s0 - i);
    for (let j = j0; j <= j1; j++) {
      const s = a + j;
      q += w * combRatio(M, o + j * g, k);
      w *= ((f - j) / (j + 1)) * ((kg - s) / (G - t - kg + s + 1));
    }
  }
  return q;
}

// parallel.placement._miss: the same for the experts [start, start + size).
function miss(rule, start, size) {
  const g = rule.E / rule.G;
  const first = Math.floor(start / g), last = Math.floor((start + size - 1) / g);
  const overlaps = first === last ? [size] : [(first + 1) * g - start, start + size - last * g];
  const partial = overlaps.filter((o) => o < g).sort((x, y) => x - y);
  return missOf(rule, last - first + 1 - partial.length, partial);
}

// parallel.placement.visit_probabilities: each rank's chance of receiving a token's row.
function visitProbabilities(rule, ep) {
  const n = rule.E / ep;
  const memo = new Map(); // a rank's chance depends on where it starts in its group
  return Array.from({ length: ep }, (_, p) => {
    const at = (p * n) % (rule.E / rule.G);
    if (!memo.has(at)) memo.set(at, 1.0 - miss(rule, p * n, n));
    return memo.get(at);
  });
}

const addUp = (xs) => xs.reduce((x, y) => x + y, 0);
const smallest = (xs) => xs.reduce((x, y) => Math.min(x, y), Infinity);

// parallel.placement.rows_per_token: the busiest source rank's expected rows to the others.
function rowsPerToken(rule, ep) {
  if (ep === 1) return 0.0;
  const visit = visitProbabilities(rule, ep);
  if (new Set(visit).size === 1) return (ep - 1) * visit[0];
  return addUp(visit) - smallest(visit);
}

// parallel.placement._touched and _bound: the most blocks of unit experts one group touches,
// and the most a token reaches (the kg largest counts added, at most units and k).
function touchBound(rule, unit, units) {
  const g = rule.E / rule.G;
  const touched = Array.from({ length: rule.G }, (_, i) =>
    Math.floor(((i + 1) * g - 1) / unit) - Math.floor((i * g) / unit) + 1).sort((x, y) => y - x);
  return [touched[0], Math.min(units, rule.k, addUp(touched.slice(0, rule.kg)))];
}

// parallel.placement.reach: where a token's rows go over ep ranks, perNode to a node.
function routingReach(rule, ep, perNodeGiven) {
  const n = rule.E / ep, perNode = Math.max(1, Math.min(perNodeGiven, ep));
  const nodes = Math.ceil(ep / perNode);
  const [groupRanks, maxRanks] = touchBound(rule, n, ep);
  const [groupNodes, maxNodes] = touchBound(rule, n * perNode, nodes);
  const g = rule.E / rule.G;
  const nests = (size, unit) => size % unit === 0 || unit % size === 0;
  const visit = visitProbabilities(rule, ep);
  const reached = Array.from({ length: nodes }, (_, i) =>
    1.0 - miss(rule, i * n * perNode, n * Math.min(perNode, ep - i * perNode)));
  let cross;
  if (new Set(visit).size === 1) {
    cross = (ep - Math.min(perNode, ep - (nodes - 1) * perNode)) * visit[0];
  } else {
    const nodeSums = Array.from({ length: nodes }, (_, i) =>
      addUp(visit.slice(i * perNode, (i + 1) * perNode)));
    cross = addUp(visit) - smallest(nodeSums);
  }
  return {
    ep,
    nodes,
    group_ranks: groupRanks,
    group_nodes: groupNodes,
    nests_ranks: nests(g, n),
    nests_nodes: nests(g, n * perNode),
    max_ranks: maxRanks,
    max_nodes: maxNodes,
    rows_per_token: rowsPerToken(rule, ep),
    cross_node_rows: nodes > 1 ? cross : 0.0,
    nodes_per_token: nodes > 1 ? addUp(reached) - smallest(reached) : 0.0,
  };
}

// plan.communication.all_to_all_rows_per_token: (ep - 1) (1 - q) for plain top-k, q = C(E -
// E/ep, k) / C(E, k); group-limited, parallel.placement's rows of the busiest source rank.
function allToAllRowsPerToken(c, ep) {
  return rowsPerToken(routingRule(c), ep);
}

// planpage.model_data: what planLayout reads of one model, for the config c of custom sizes
// (modelRefusal accepts it): its sizes resolved as ModelConfig resolves them.
function modelData(data, c) {
  const kv = c.n_kv_heads === null ? c.n_heads : c.n_kv_heads;
  let hd = c.head_dim === null ? c.d_model / c.n_heads : c.head_dim;
  if (c.kv_lora_rank !== null) hd = c.qk_nope_head_dim + c.qk_rope_head_dim;
  const config = { ...c, n_kv_heads: kv, head_dim: hd };
  const counts = modelCounts(config, config.max_seq_len);
  const flops = {};
  for (const s of data.seq_lens)
    if (s <= config.max_seq_len) flops[s] = modelCounts(config, s).flops_per_token;
  const activation = {};
  const denseActivation = {};
  for (const [name, p] of Object.entries(data.precisions)) {
    activation[name] = {};
    for (const r of ["none", "selective"])
      activation[name][r] = layerActivationBytes(
        data, config, p.params, p.compute, r, p.fp8_parts.includes("experts"), fp8InPermute(p));
    if (config.n_dense_layers) {
      denseActivation[name] = {};
      for (const r of ["none", "selective"])
        denseActivation[name][r] = denseLayerActivationBytes(data, config, p.params, p.compute, r);
    }
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
    dense_activation: denseActivation,
    rows_per_token: rows,
  };
}

// The page computes in doubles: sizes whose counts pass 2^53 - 1 are refused rather than
// rounded (moe plan counts them in Python's integers). One sentence, or null.
function countRefusal(md) {
  const counts = [["total parameters", md.total_params],
    ...Object.entries(md.flops_per_token).map(([s, f]) => [`FLOPs per token at ${s}`, f]),
    ...Object.values(md.activation).flatMap((a) =>
      Object.values(a).map((b) => ["activation bytes per token", b])),
    ...Object.values(md.dense_activation).flatMap((a) =>
      Object.values(a).map((b) => ["activation bytes per token", b]))];
  for (const [what, n] of counts)
    if (!Number.isSafeInteger(n))
      return `the custom model's ${what}, ${n.toExponential(3)}, are not allowed: this page ` +
        "counts exactly up to 2^53 - 1; plan larger models with moe plan and model.* overrides.";
  return null;
}

// ---- a mixture's sources (data.sources) ---------------------------------------------------

// plan.mixture.mixture_plan for layout L: each source's share, the instances the run's steps
// draw from it (half up, as Python's math.floor(x + 0.5)), the tokens trained on, its instances
// of seq_len + 1 tokens (null: its size unknown) and its epochs (null: unknown or no instance).
// mix: the page data's mixture (null for one folder).
function mixtureRows(mix, L) {
  if (!mix) return [];
  const slots = mix.steps * L.global_batch_size;
  return mix.sources.map((s) => {
    const drawn = Math.floor(slots * s.share + 0.5);
    const instances = s.tokens === null ? null : Math.floor(s.tokens / (L.seq_len + 1));
    const epochs = instances ? drawn / instances : null;
    return { name: s.name, share: s.share, drawn, tokens: drawn * L.seq_len, instances, epochs };
  });
}

// plan.mixture.epochs_text: a source's epochs in words.
function epochsText(epochs, instances) {
  if (instances === null) return "unknown (not readable)";
  if (epochs === null) return "none: it holds no whole sequence";
  return epochs.toFixed(2) + (epochs > 1 ? " (repeats)" : "");
}

if (typeof module !== "undefined")
  module.exports = { planLayout, inFlight, modelData, configRefusal, mixtureRows };
