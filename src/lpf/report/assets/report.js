/* lpf report page. Reads the JSON in #lpf-data and builds the DOM. Every string from the data (model
   text, request ids, sentences) goes in through textContent or a text node: innerHTML is never used. */
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("lpf-data").textContent);
  var app = document.getElementById("app");
  var TIP = document.getElementById("tip");
  var VERDICTS = ["clean", "noise", "divergent", "corrupt"];
  var COLORS = { clean: "#16a34a", noise: "#ca8a04", divergent: "#c026d3", systematic: "#ea580c", corrupt: "#dc2626", error: "#6b7280", unscored: "#9ca3af" };
  var SEVERITY = { clean: 0, noise: 1, divergent: 2, systematic: 3, corrupt: 4 };

  // -- tiny DOM helpers ------------------------------------------------------------------------------
  function h(tag, cls, kids) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    add(e, kids);
    return e;
  }
  function add(e, kids) {
    if (kids === undefined || kids === null) return e;
    if (!Array.isArray(kids)) kids = [kids];
    kids.forEach(function (k) {
      if (k === null || k === undefined || k === false) return;
      e.appendChild(typeof k === "object" ? k : document.createTextNode(String(k)));
    });
    return e;
  }
  function txt(tag, cls, s) { var e = document.createElement(tag); if (cls) e.className = cls; e.textContent = s == null ? "" : String(s); return e; }
  function isNum(x) { return typeof x === "number" && isFinite(x); }
  function fmt(x, digits) {
    if (x === null || x === undefined) return "–";
    if (typeof x === "boolean") return x ? "yes" : "no";
    if (typeof x !== "number") return String(x);
    if (!isFinite(x)) return "inf";
    if (x === 0) return "0";
    if (Number.isInteger(x) && Math.abs(x) < 1e7) return x.toLocaleString("en-US");
    var a = Math.abs(x);
    if (a >= 1e5 || a < 1e-3) return x.toExponential(digits || 2);
    return String(Number(x.toPrecision(digits || 3)));
  }
  function pct(a, b) { return b ? (100 * a / b) : 0; }
  function fmtPct(a, b) { return b ? (pct(a, b) < 0.1 && a > 0 ? pct(a, b).toFixed(2) : pct(a, b).toFixed(1)) + "%" : "–"; }
  function badge(v, small, colorAs) {
    var c = COLORS[v] ? v : (colorAs || "error");
    return txt("span", "badge v-" + c + (small ? " small" : ""), v || "?");
  }
  function kpi(k, v, d) { return h("div", "kpi", [txt("div", "k", k), txt("div", "v", v), d ? txt("div", "d", d) : null]); }
  function kv(obj, keys) {
    var box = h("div", "kv");
    function put(prefix, o, ks) {
      (ks || Object.keys(o || {})).forEach(function (k) {
        var v = o[k], name = prefix + k;
        if (v === undefined) return;
        if (v !== null && typeof v === "object" && !Array.isArray(v) && prefix.split(".").length < 3) { put(name + ".", v); return; }
        if (v !== null && typeof v === "object") v = JSON.stringify(v);
        add(box, [txt("div", "k", name), txt("div", "v", fmt(v))]);
      });
    }
    put("", obj, keys);
    return box;
  }
  function table(cols, rows) {
    var t = h("table", "t"), thead = h("thead"), tr = h("tr"), tb = h("tbody");
    cols.forEach(function (c) { tr.appendChild(txt("th", null, c)); });
    thead.appendChild(tr); t.appendChild(thead);
    rows.forEach(function (r) {
      var row = h("tr");
      r.forEach(function (cell) {
        if (cell && cell.nodeType) { var td = h("td"); td.appendChild(cell); row.appendChild(td); }
        else { row.appendChild(txt("td", typeof cell === "number" ? "num" : null, fmt(cell))); }
      });
      tb.appendChild(row);
    });
    t.appendChild(tb);
    return h("div", "scroll", t);
  }

  var sections = [];
  function section(id, title, lede, short) {
    var s = h("section", "card");
    s.id = id;
    add(s, [txt("h2", null, title), lede ? txt("p", "lede", lede) : null]);
    sections.push({ id: id, title: short || title });
    return s;
  }
  var plots = [];
  function plot(fig, cls) {
    var div = h("div", "plot" + (cls ? " " + cls : ""));
    if (!fig || !fig.data || !fig.data.length) return txt("div", "empty", "nothing to plot");
    plots.push([div, fig]);
    return div;
  }
  function drawPlots() {
    var config = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["lasso2d", "select2d"] };
    return Promise.all(plots.map(function (p) { return Plotly.newPlot(p[0], p[1].data, p[1].layout, config); }));
  }

  function hero(kicker, title, verdict, subParts, kpis, mix, colorAs) {
    var hdr = h("header", "hero"), w = h("div", "wrap");
    var h1 = h("h1", null, [txt("span", null, title), verdict ? badge(verdict, false, colorAs) : null]);
    var sub = h("div", "sub");
    subParts.forEach(function (p, i) {
      if (i) sub.appendChild(document.createTextNode("  ·  "));
      add(sub, [p[0] + " ", txt("b", null, p[1])]);
    });
    add(w, [txt("div", "kicker", kicker), h1, sub]);
    if (kpis && kpis.length) add(w, h("div", "kpis", kpis));
    if (mix) add(w, mix);
    hdr.appendChild(w);
    return hdr;
  }
  function mixbar(counts, extra) {
    var total = 0, keys = VERDICTS.concat(extra || []);
    keys.forEach(function (v) { total += counts[v] || 0; });
    var bar = h("div", "mixbar"), leg = h("div", "mixlegend");
    keys.forEach(function (v) {
      var c = counts[v] || 0;
      if (c) { var s = h("span"); s.style.width = pct(c, total) + "%"; s.style.background = COLORS[v]; s.title = v + ": " + c; bar.appendChild(s); }
      if (c || VERDICTS.indexOf(v) >= 0) {
        var i = h("i"); i.style.background = COLORS[v];
        add(leg, h("span", null, [i, v + " " + fmt(c) + (total ? " (" + fmtPct(c, total) + ")" : "")]));
      }
    });
    return h("div", null, [bar, leg]);
  }
  function nav() {
    var n = h("nav", "toc"), w = h("div", "wrap");
    sections.forEach(function (s) { var a = txt("a", null, s.title); a.href = "#" + s.id; w.appendChild(a); });
    n.appendChild(w);
    return n;
  }
  function footer() {
    var m = D.meta || {};
    return h("footer", "wrap", txt("div", null, "generated by lpf " + (m.lpf_version || "?") + " on " + (m.generated || "?") +
      " · one offline file (plotly.js " + (m.plotly_version || "?") + " inside; nothing is fetched)"));
  }

  // -- hypotheses table (runs and RL) ------------------------------------------------------------------
  function evidence(label, w, total, color) {
    var bar = h("div", "bar"), fill = h("span");
    fill.style.width = (total ? Math.max(pct(w, total), w ? 2 : 0) : 0) + "%";
    fill.style.background = color;
    bar.appendChild(fill);
    return h("div", "ev", [txt("span", null, label), bar, txt("span", "num", (isNum(w) ? w : "?") + "/" + (isNum(total) ? total : "?"))]);
  }
  function hypotheses(list, empty) {
    if (!list || !list.length) return txt("div", "empty", empty);
    var rows = list.map(function (hy, i) {
      var r = txt("span", "rank" + (i === 0 ? " top" : ""), hy.rank != null ? hy.rank : i + 1);
      var ev = h("div", null, [evidence("flagged", hy.flagged_with, hy.flagged_total, COLORS.corrupt),
                               evidence("clean", hy.clean_with, hy.clean_total, COLORS.clean)]);
      var sentence = h("div", null, [txt("div", null, hy.sentence || ""), txt("div", "note mono", hy.feature || "")]);
      return [r, sentence, ev, hy.p_value, hy.score];
    });
    return table(["#", "mechanism", "evidence", "p-value", "score"], rows);
  }

  // -- run page --------------------------------------------------------------------------------------
  function runPage() {
    var F = D.findings || {}, M = D.manifest || {}, C = F.counts || {}, S = F.shape || {}, TH = F.thresholds || {};
    var ad = (F.metrics || {}).abs_logprob_diff || {};
    var scoredReq = (F.n_requests || 0) - (F.errors || 0) - (F.unscored || 0);
    var rate = isNum(S.rate) ? S.rate : (scoredReq ? D.n_flagged / scoredReq : null);
    var o = F.oracle || {};
    var eng = M.engine || {};
    var kp = [
      kpi("requests", fmt(F.n_requests), (F.errors || F.unscored) ?
        [F.errors ? F.errors + " failed in the engine" : null, F.unscored ? F.unscored + " unscored" : null].filter(Boolean).join(" · ") : "all scored"),
      kpi("tokens", fmt(F.n_tokens), fmt(F.n_scored_tokens) + " scored"),
      kpi("flagged", fmt(D.n_flagged), rate === null ? "" : (100 * rate).toFixed(rate < 0.001 && rate > 0 ? 3 : 1) + "% of scored requests"),
      kpi("max |diff|", fmt(ad.max), "p99 " + fmt(ad.p99) + " · p50 " + fmt(ad.p50)),
    ];
    if (o.n) kp.push(kpi("oracle accuracy", (100 * o.accuracy).toFixed(1) + "%", o.correct + "/" + o.n + " exact answers"));
    var extra = []; if (F.errors) extra.push("error"); if (F.unscored) extra.push("unscored");
    var counts = Object.assign({}, C, { error: F.errors || 0, unscored: F.unscored || 0 });
    app.appendChild(hero("logprob forensics · run " + (F.run_id || M.run_id || ""), "Audit report", F.verdict,
      [["engine", (F.engine || eng.name || "?") + (eng.version ? " " + eng.version : "")], ["model", F.model || "?"],
       ["reference", (F.reference || "?") + ((M.reference || {}).dtype ? " (" + M.reference.dtype + ")" : "")],
       ["created", M.created || "?"]].concat(F.run_complete === false ? [["status", "INCOMPLETE run"]] : []),
      kp, mixbar(counts, extra)));
    var main = h("main", "wrap");

    // at a glance
    var g = section("glance", "At a glance", "The failure's shape: how often, from when, where in the output, how regular.", "Glance");
    var top = (F.hypotheses || [])[0];
    if (top && top.sentence) add(g, h("div", "lead", [txt("b", null, "Best explanation: "), top.sentence]));
    else if (!D.n_flagged) add(g, h("div", "lead ok", "No request diverged from the reference beyond the thresholds."));
    var facts = h("div", "facts");
    function fact(k, v, s) { facts.appendChild(h("div", "fact", [txt("div", "k", k), txt("div", "v", v), s ? txt("div", "s", s) : null])); }
    fact("rate", rate === null ? "–" : (100 * rate).toFixed(2) + "%", fmt(D.n_flagged) + " of " + fmt(scoredReq) + " scored requests flagged");
    var on = S.onset || {};
    if (on.seq != null || on.step != null) fact("onset", on.seq != null ? "arrival " + fmt(on.seq) : "step " + fmt(on.step),
      "first flagged request" + (on.step != null ? ", engine step " + fmt(on.step) : ""));
    var fd = S.first_divergence || {};
    if (fd.median != null || fd.at_zero_fraction != null) fact("first divergence", "median position " + fmt(fd.median),
      fd.at_zero_fraction != null ? (100 * fd.at_zero_fraction).toFixed(1) + "% diverge at position 0" : "");
    var per = S.periodicity || {};
    if (per.period != null) fact("periodicity", "every " + fmt(per.period) + " " + (per.over === "seq" ? "requests" : "steps"),
      "confidence " + fmt(per.confidence));
    else if (S.periodicity) fact("periodicity", "none found", "confidence " + fmt(per.confidence));
    var tr = F.trace;  // the step trace the mechanisms were ranked against, or why there is none
    var trFrom = { engine: "from the engine", "vllm-plugin": "from inside vLLM (lpf-vllm-trace)", joined: "joined from the server's trace directory" };
    if (tr) fact("step trace", tr.recorded ? fmt(tr.rows) + " rows" : "none",
      tr.recorded ? (trFrom[tr.source] || tr.source) + (tr.why ? " · " + tr.why : "") : (tr.why || ""));
    add(g, facts);
    var cl = (S.clusters || []).filter(function (c) { return c && c.sentence; });
    if (cl.length) add(g, h("ul", "sentences", cl.map(function (c) { return txt("li", null, c.sentence); })));
    main.appendChild(g);

    // the run-level test: is the engine's distribution the reference's, beyond its dtype's floor?
    var RT = F.run_test;
    if (RT) {
      var rts = section("run-test", "Run-level test",
        "Is this the model you claim? Every scored token against the floor an honest implementation at the engine's dtype has (never this run's own). Bars: observed (this run) and expected floor, log scale.", "Run test");
      add(rts, h("div", "lead" + (RT.result === "same" ? " ok" : ""), [txt("b", null, "Run test: "), RT.sentence || ""]));
      if (RT.floor_sentence) add(rts, txt("p", null, RT.floor_sentence));
      if (RT.arithmetic_sentence) add(rts, txt("p", "note", RT.arithmetic_sentence));
      if (RT.configured_sentence) add(rts, txt("p", "note", RT.configured_sentence));
      add(rts, D.charts.run_test ? plot(D.charts.run_test) : txt("div", "empty", "no floor to draw"));
      if (RT.floor_detail) add(rts, txt("p", "note", "expected floor: " + RT.floor_detail));
      main.appendChild(rts);
    }

    // distribution
    var dist = section("distribution", "Token error distribution",
      "|engine logprob − reference logprob| for every scored token, log scale; dashed lines are the verdict thresholds.", "Distribution");
    add(dist, plot(D.charts.histogram));
    if ((D.notes || {}).histogram_every > 1) add(dist, txt("p", "note", "drawn from one request in " + fmt(D.notes.histogram_every) +
      " (arrival order): a run this large is sampled for the histogram; the metrics below are over every token."));
    var mrows = [];
    Object.keys(F.metrics || {}).forEach(function (k) {
      var v = F.metrics[k];
      if (v && typeof v === "object") mrows.push([txt("span", "mono", k), v.p50, v.p90, v.p99, v.p99_9, v.max, v.mean]);
    });
    if (mrows.length) add(dist, table(["metric", "p50", "p90", "p99", "p99.9", "max", "mean"], mrows));
    var fm = F.metrics || {};
    if (fm.same_top1_pct != null || fm.greedy_flip_rate != null)
      add(dist, txt("p", "note", "same top-1 as the reference: " + fmt(fm.same_top1_pct) + "% of tokens · greedy flip rate " + fmt(fm.greedy_flip_rate)));
    main.appendChild(dist);
    if (F.prompt) main.appendChild(promptSection(F.prompt));

    var sc = section("requests", "Requests in arrival order",
      "Each request's largest |diff| against the order it reached the engine, coloured by verdict. Hover for the request id.", "Requests");
    add(sc, plot(D.charts.scatter));
    var nn = D.notes || {};
    if (nn.scatter_shown < nn.n_requests) add(sc, txt("p", "note", "showing " + fmt(nn.scatter_shown) + " of " + fmt(nn.n_requests) +
      " requests: every flagged one (the worst, when there are very many) and, per arrival-index bin, the largest |diff| of the rest."));
    main.appendChild(sc);

    var fdiv = section("position", "Where the lie starts",
      "Output position of each flagged request's first divergent token. A pile at position 0 means the state was wrong before the first decode.", "Position");
    add(fdiv, D.n_flagged ? plot(D.charts.first_divergence) : txt("div", "empty", "no flagged requests"));
    main.appendChild(fdiv);

    var st = section("steps", "Engine steps", "Batch composition per engine step (from the trace), and the flagged requests in each batch.", "Steps");
    add(st, D.charts.steps ? plot(D.charts.steps) : txt("div", "empty", "this engine wrote no per-step trace"));
    main.appendChild(st);

    var hy = section("hypotheses", "Mechanisms", "Trace and metadata features tested for association with flagged requests, best first.", "Mechanisms");
    add(hy, hypotheses(F.hypotheses, D.n_flagged ? "findings.json has no ranked hypotheses" : "nothing flagged, nothing to explain"));
    var MB = F.mechanisms;
    if (MB && MB.n_flagged) {
      var mrows = (MB.covered || []).map(function (c) {
        return [c.n, txt("span", "mono", c.feature || ""), c.rank != null ? c.rank : "–", c.sentence || ""];
      });
      if (MB.unexplained) mrows.push([MB.unexplained, txt("span", "mono", "unexplained"), "–", "no hypothesis significant among the requests left holds for them"]);
      add(hy, [txt("h4", null, "What explains each flagged request (" + MB.n_flagged + ")"),
        txt("p", "note", "Each flagged request gets the best-ranked significant hypothesis that holds for it; the requests it explains are set aside and the rest ranked again."),
        table(["requests", "mechanism", "hypothesis #", "why"], mrows)]);
    }
    main.appendChild(hy);

    var E = F.evidence;
    if (E && typeof E === "object") main.appendChild(evidenceSection(E));

    main.appendChild(drill(TH));

    var th = section("thresholds", "Thresholds and run", "The values that decided each verdict, and how this run was made.", "Thresholds & run");
    var thv = {}; Object.keys(TH).forEach(function (k) { if (k !== "source" && k !== "noise_floor") thv[k] = TH[k]; });
    var thHead = h("div", null, [txt("b", null, "verdict thresholds "),
      TH.source ? txt("span", "pill" + (TH.source === "default" ? " default" : ""), TH.source) : null]);
    var blocks = [h("div", null, [thHead, kv(thv)])];
    if (TH.noise_floor && typeof TH.noise_floor === "object") blocks.push(h("div", null, [txt("b", null, "noise floor"), kv(TH.noise_floor)]));
    add(th, h("div", "grid2", blocks));
    var cfg = h("div", "grid2", [
      h("div", null, [txt("b", null, "engine " + (eng.name || "")), kv(eng.options || {})]),
      h("div", null, [txt("b", null, "sampling"), kv(M.sampling || {}), txt("b", null, "workload"), kv(M.workload || {}),
        txt("b", null, "model"), kv(M.model || {}), txt("b", null, "reference"), kv(M.reference || {})])]);
    add(th, [h("hr"), cfg]);
    main.appendChild(th);
    app.appendChild(nav());
    app.appendChild(main);
    app.appendChild(footer());
  }

  // -- what the server said beyond its tokens (findings.evidence) ----------------------------------------
  function evidenceSection(E) {
    var ev = section("evidence", "Evidence from the server",
      "What the answers said beyond their tokens: answers that contradict themselves (kept as returned and scored), " +
      "failed attempts, and the requests in flight when a server died.", "Evidence");
    var inc = E.inconsistent || {}, fl = E.failed || {}, at = E.attempts || {};
    var facts = h("div", "facts");
    function fact(k, v, s) { facts.appendChild(h("div", "fact", [txt("div", "k", k), txt("div", "v", v), s ? txt("div", "s", s) : null])); }
    fact("inconsistent answers", fmt(inc.n || 0), fmt(inc.scored || 0) + " scored · " + fmt(inc.flagged || 0) + " flagged");
    fact("failed requests", fmt(fl.n || 0), fmt(fl.sent || 0) + " sent and failed · " + fmt(fl.never_sent || 0) + " never sent");
    fact("attempts", fmt(at.n || 0), fmt(at.retries || 0) + " retries");
    add(ev, facts);
    var reasons = Object.keys(inc.by_reason || {});
    if (reasons.length) add(ev, table(["inconsistency", "answers"], reasons.map(function (k) { return [txt("span", "mono", k), inc.by_reason[k]]; })));
    var st = Object.keys(at.by_status || {});
    if (st.length) add(ev, txt("p", "note", "attempts by HTTP status: " + st.map(function (k) { return k + " ×" + at.by_status[k]; }).join(", ")));
    var died = E.server_died;
    if (died && typeof died === "object") {
      add(ev, h("div", "lead", [txt("b", null, "The server died: "), txt("span", null, died.sentence || "")]));
      add(ev, h("ul", "sentences", (died.in_flight || []).map(function (id) { return txt("li", "mono", id); })));
    }
    return ev;
  }

  // -- drill-down ------------------------------------------------------------------------------------
  function drill(TH) {
    var dd = D.drill || { requests: [], vocab: {} };
    var s = section("worst", "Worst requests, token by token",
      "The " + dd.requests.length + " worst requests. Tokens are coloured by |diff|; hover one for both sides' top-k.", "Worst requests");
    if (dd.tokenizer_note) add(s, txt("p", "note warn", dd.tokenizer_note));
    if (!dd.requests.length) { add(s, txt("div", "empty", "no scored requests")); return s; }
    var clean = isNum(TH.clean_abs_diff) ? TH.clean_abs_diff : 1e-3, div = isNum(TH.divergent_abs_diff) ? TH.divergent_abs_diff : 0.5;
    var mid = Math.sqrt(clean * div);
    var conf = isNum(TH.confident_logprob) ? TH.confident_logprob : Math.log(0.5);
    var improb = isNum(TH.improbable_logprob) ? TH.improbable_logprob : Math.log(0.05);
    function level(d) { if (d === null) return "lx"; if (d <= clean) return "l0"; if (d <= mid) return "l1"; if (d <= div) return "l2"; if (d <= 5) return "l3"; return "l4"; }
    var legend = h("div", "legend", [txt("span", null, "|diff|:"),
      txt("span", "tok l0", "≤ " + fmt(clean)), txt("span", "tok l1", "≤ " + fmt(mid)), txt("span", "tok l2", "≤ " + fmt(div)),
      txt("span", "tok l3", "≤ 5"), txt("span", "tok l4", "> 5"), txt("span", "tok lx", "no reference"),
      txt("span", "tok first", "first divergence"), txt("span", "tok gib", "confident gibberish")]);
    add(s, legend);
    function tokText(id) {
      var t = dd.vocab[String(id)];
      if (t === undefined) return "#" + id;
      if (t === "") return "∅";
      return t.replace(/\n/g, "⏎").replace(/\t/g, "⇥");
    }
    dd.requests.forEach(function (r, idx) {
      var det = h("details", "req");
      det.id = "request-" + r.request_id;  // the anchor `lpf watch`'s live page links a flagged request to
      if (idx < 3) det.open = true;
      var sum = h("summary", null, [badge(r.verdict, true), txt("span", "rid", r.request_id),
        txt("span", "meta", "arrival " + fmt(r.seq) + " · first divergence " + fmt(r.first_divergence) +
          " · max |diff| " + fmt(r.max_abs_logprob_diff) + (r.gibberish_tokens ? " · " + r.gibberish_tokens + " gibberish token" + (r.gibberish_tokens === 1 ? "" : "s") : ""))]);
      det.appendChild(sum);
      var body = h("div", "reqbody");
      var meta = { prompt_id: r.prompt_id, rollout: r.rollout, output_tokens: r.n_output_tokens, prompt_tokens: r.n_prompt_tokens,
        finish_reason: r.finish_reason };
      if (r.gibberish_score != null) meta.gibberish_score = r.gibberish_score;
      if (r.error) meta.engine_error = r.error;
      var mech = (D.mechanism_of || {})[r.request_id];
      if (mech) {
        meta.mechanism = mech.feature || "unexplained";
        if (mech.writer) meta.state_overwritten_by = mech.writer;
      }
      if (r.oracle_expected != null) { meta.oracle_expected = r.oracle_expected; meta.oracle_ok = r.oracle_ok; }
      var left = h("div", null, [txt("h4", null, "request"), kv(meta)]);
      var right = h("div");
      var tr = r.trace;
      if (tr) {
        var phases = Object.keys(tr.phases || {}).map(function (p) { return p + " ×" + tr.phases[p]; }).join(", ");
        add(right, [txt("h4", null, "trace"), kv({ first_phase: tr.first_phase, steps: tr.first_step + " … " + tr.last_step,
          phases: phases, state_slots: (tr.state_slots || []).join(", "), preemptions: tr.preemptions })]);
        var tb = h("details", "tracebox", [txt("summary", null, "step by step (" + tr.n_rows + " rows" + (tr.rows.length < tr.n_rows ? ", first " + tr.rows.length + " shown" : "") + ")")]);
        tb.appendChild(table(tr.columns, tr.rows));
        right.appendChild(tb);
      }
      add(body, h("div", "grid2", [left, right]));
      add(body, [txt("h4", null, "prompt (decoded)"), txt("pre", "text", r.prompt_text),
                 txt("h4", null, "output text"), txt("pre", "text", r.output_text)]);
      var shown = r.shown || [0, r.tokens.length];
      add(body, txt("h4", null, "output tokens" + (shown[0] > 0 || shown[1] < r.n_output_tokens ?
        " (positions " + shown[0] + "–" + (shown[1] - 1) + " of " + r.n_output_tokens + ")" : "")));
      var strip = h("div", "strip");
      r.tokens.forEach(function (t, i) {
        var d = (t[2] === null || t[3] === null) ? null : Math.abs(t[2] - t[3]);
        var cls = "tok " + level(d);
        if (r.first_divergence !== null && t[0] === r.first_divergence) cls += " first";
        if (t[2] !== null && t[3] !== null && t[2] >= conf && t[3] <= improb) cls += " gib";
        var sp = txt("span", cls, tokText(t[1]));
        sp.dataset.r = idx; sp.dataset.i = i;
        strip.appendChild(sp);
      });
      strip.addEventListener("mouseover", function (ev) { var t = ev.target; if (t.classList.contains("tok")) showTip(t, ev); });
      strip.addEventListener("mousemove", function (ev) { if (!TIP.hidden) place(ev); });
      strip.addEventListener("mouseleave", function () { TIP.hidden = true; });
      body.appendChild(strip);
      det.appendChild(body);
      s.appendChild(det);
    });
    // #request-ID opens that request and brings it into view; one not drilled into says so, and how to see it
    var missing = txt("p", "note warn unseen", "");
    missing.hidden = true;
    s.insertBefore(missing, legend);
    function follow() {
      var id = decodeURIComponent((location.hash || "").slice(1));
      if (id.indexOf("request-") !== 0) return;
      var det = document.getElementById(id);
      missing.hidden = !!det;
      if (det) { det.open = true; det.scrollIntoView(); return; }
      missing.textContent = id.slice(8) + " is not among the " + dd.requests.length +
        " worst requests drawn here: `lpf inspect DIR " + id.slice(8) + "` shows it token by token.";
      missing.scrollIntoView();
    }
    window.addEventListener("hashchange", follow);
    setTimeout(follow, 0);  // once the page is in the document

    function showTip(el, ev) {
      var r = dd.requests[+el.dataset.r], t = r.tokens[+el.dataset.i];
      while (TIP.firstChild) TIP.removeChild(TIP.firstChild);
      var d = (t[2] === null || t[3] === null) ? null : Math.abs(t[2] - t[3]);
      add(TIP, [txt("div", "h", "position " + t[0] + "  " + JSON.stringify(dd.vocab[String(t[1])] || "") + "  #" + t[1]),
        txt("div", "row", "engine logprob " + fmt(t[2], 4) + "   reference " + fmt(t[3], 4) + "   |diff| " + fmt(d, 3) +
          (t[4] != null ? "   ref rank " + t[4] : ""))]);
      var n = Math.max(t[5].length, t[7].length);
      if (n) {
        var tab = h("table"), head = h("tr");
        add(head, [txt("th", null, "engine top-k"), txt("th", null, ""), txt("th", null, "reference top-k"), txt("th", null, "")]);
        tab.appendChild(head);
        for (var k = 0; k < n; k++) {
          var row = h("tr");
          [[t[5], t[6]], [t[7], t[8]]].forEach(function (side) {
            var id = side[0][k], lp = side[1][k];
            var cell = txt("td", id === t[1] ? "chosen" : null, id === undefined ? "" : JSON.stringify(dd.vocab[String(id)] === undefined ? "#" + id : dd.vocab[String(id)]));
            row.appendChild(cell);
            row.appendChild(txt("td", "lp", lp === undefined ? "" : fmt(lp, 3) + (isNum(lp) ? "  " + (100 * Math.exp(lp)).toFixed(1) + "%" : "")));
          });
          tab.appendChild(row);
        }
        TIP.appendChild(tab);
      } else {
        TIP.appendChild(txt("div", "row", "no top-k recorded for this token"));
      }
      TIP.hidden = false;
      place(ev);
    }
    function place(ev) {
      var w = TIP.offsetWidth, hh = TIP.offsetHeight, x = ev.clientX + 14, y = ev.clientY + 16;
      if (x + w > window.innerWidth - 8) x = Math.max(8, ev.clientX - w - 14);
      if (y + hh > window.innerHeight - 8) y = Math.max(8, ev.clientY - hh - 16);
      TIP.style.left = x + "px"; TIP.style.top = y + "px";
    }
    return s;
  }

  // the prompt (prefill) positions, judged apart from the outputs
  function promptSection(P) {
    var s = section("prompt", "Prompt positions (prefill)",
      "The engine's logprob of every prompt token against the reference's, kept apart from the sampled tokens: a chunked-prefill state hand-off shows here first.", "Prompt");
    var c = P.counts || {};
    add(s, h("div", "lead" + (P.verdict === "clean" ? " ok" : ""), [txt("b", null, "Prompt verdict: "), badge(P.verdict, true), " ",
      fmt(P.n_requests) + " requests · " + fmt(P.n_scored_tokens) + " positions · clean " + fmt(c.clean || 0) +
      " / noise " + fmt(c.noise || 0) + " / divergent " + fmt(c.divergent || 0)]));
    var sh = P.shape || {};
    if (sh.sentence) add(s, txt("p", null, sh.sentence));
    var rows = [];
    Object.keys(P.metrics || {}).forEach(function (k) {
      var v = P.metrics[k];
      if (v && typeof v === "object") rows.push([txt("span", "mono", k), v.p50, v.p90, v.p99, v.p99_9, v.max, v.mean]);
    });
    if (rows.length) add(s, table(["metric", "p50", "p90", "p99", "p99.9", "max", "mean"], rows));
    var fl = P.flagged || [];
    if (fl.length) add(s, [txt("h4", null, "prompt-divergent requests (worst first)"),
      table(["request", "first departure", "first divergence", "max |diff|"], fl.map(function (f) {
        return [txt("span", "mono", f.request_id), f.first_departure, f.first_divergence, f.max_abs_logprob_diff];
      }))]);
    return s;
  }

  // -- sweep page ------------------------------------------------------------------------------------
  function sweepPage() {
    var cells = D.cells || [], knobs = D.knobs || [];
    var worst = null, total = 0, flaggedCells = 0;
    cells.forEach(function (c) {
      if (c.verdict in SEVERITY && (worst === null || SEVERITY[c.verdict] > SEVERITY[worst])) worst = c.verdict;
      total += c.n_requests || 0;
      if (c.verdict === "divergent" || c.verdict === "corrupt") flaggedCells++;
    });
    app.appendChild(hero("logprob forensics · sweep", "Sweep report", worst,
      [["knobs", knobs.map(function (k) { return k.name + " = " + (k.values || []).join(", "); }).join("; ") || "–"]],
      [kpi("cells", fmt(cells.length)), kpi("requests", fmt(total), "over all cells"), kpi("flagged cells", fmt(flaggedCells), "divergent or corrupt")]));
    var main = h("main", "wrap");
    var mv = section("moves", "What moves the shape", "Which knob changes the failure's rate, onset, position or period.");
    // the moves that do move come first; the "does not move" ones stay, muted (they are evidence too)
    var moves = (D.moves || []).filter(function (m) { return m && m.sentence; });
    moves = moves.filter(function (m) { return m.moves !== false; }).concat(moves.filter(function (m) { return m.moves === false; }));
    if (moves.length) add(mv, h("ul", "sentences", moves.map(function (m) {
      return h("li", m.moves === false ? "muted" : null,
        [m.knob ? txt("span", "pill" + (m.moves === false ? " default" : ""), m.knob + (m.metric ? " → " + m.metric : "")) : null, " ", m.sentence]);
    })));
    else add(mv, txt("div", "empty", "no knob moved the shape beyond noise"));
    main.appendChild(mv);
    if (D.mix) { var mx = section("mix", "Verdicts per cell"); add(mx, plot(D.mix)); main.appendChild(mx); }
    var ch = section("metrics", "Shape metrics per cell", knobs.length > 1 ?
      "Against " + knobs[0].name + "; one line per combination of the other knobs." : "One point per knob value.");
    var grid = h("div", "grid2");
    (D.charts || []).forEach(function (c) { add(grid, h("div", null, [txt("h3", null, c.title), plot(c.figure)])); });
    add(ch, (D.charts || []).length ? grid : txt("div", "empty", "the cells carry no shape metrics"));
    main.appendChild(ch);
    var ct = section("cells", "Cells", "Each cell is an ordinary run directory with its own report.");
    var rows = cells.map(function (c) {
      var name = txt("span", "mono", c.name);
      if (c.link) { var a = txt("a", "mono", c.name); a.href = c.link; name = a; }
      var vals = Object.keys(c.values || {}).map(function (k) { return k + "=" + c.values[k]; }).join(", ");
      var cn = c.counts || {};
      return [name, vals, c.verdict ? badge(c.verdict, true) : "–", c.n_requests,
        VERDICTS.map(function (v) { return cn[v] || 0; }).join(" / "), isNum(c.rate) ? (100 * c.rate).toFixed(2) + "%" : null,
        c.onset_seq, c.onset_step,
        c.first_divergence_median, c.period, c.max_abs_logprob_diff];
    });
    add(ct, cells.length ? table(["cell", "knobs", "verdict", "requests", "clean / noise / div / corrupt", "rate", "onset seq", "onset step",
      "median first div", "period", "max |diff|"], rows) : txt("div", "empty", "no cells"));
    main.appendChild(ct);
    app.appendChild(nav()); app.appendChild(main); app.appendChild(footer());
  }

  // -- conformance page ------------------------------------------------------------------------------
  function conformancePage() {
    var rows = D.rows || [], cells = D.cells || [], by = {};
    rows.forEach(function (r) { by[r.architecture + "|" + r.cell] = r; });
    var worst = null, bad = 0;
    // a cell's conformance: its verdict, unless the engine's own judgement (llama.cpp per token, bf16 per
    // position against honest bf16 runs, or the older bf16 envelope) calls a non-clean verdict clean
    function judged(r) { return r.conformance || r.verdict; }
    function judgedHow(r) {
      var bp = r.bf16_paired || {}, ej = r.engine_judgement, pct = function (x) { return fmt(100 * x) + "%"; };
      if (bp.result) return "per position: " + pct(bp.share_worse_than_ensemble || 0) + " worse than every honest bf16 run" +
        (bp.p_value != null ? " (p " + Number(bp.p_value).toExponential(1) + ")" : "") + " · " + bp.result;
      if (judged(r) === "clean" && r.verdict !== "clean")
        return ej ? "clean* per token: " + ((ej.causes || []).map(function (c) { return c.name; }).join(", ") || "no named departure")
                  : "within the bf16 envelope";
      return null;
    }
    rows.forEach(function (r) {
      var v = judged(r);
      if (v in SEVERITY && (worst === null || SEVERITY[v] > SEVERITY[worst])) worst = v;
      if (v && v !== "clean") bad++;
    });
    app.appendChild(hero("logprob forensics · conformance", "Conformance matrix", worst,
      [["engine", (D.engine || "?") + " " + (D.engine_version || "")], ["reference", D.reference || "?"],
       ["grid", D.grid || "--knob"]].concat(D.complete === false ? [["status", "INCOMPLETE"]] : []),
      [kpi("architectures", fmt((D.audited || []).length), fmt((D.not_audited || []).length) + " more listed, not audited"),
       kpi("cells", fmt(rows.length), fmt(cells.length) + " per architecture"),
       kpi("not clean", fmt(bad), "cells whose verdict is above clean"), kpi("time", fmt(D.elapsed_s) + " s", "")]));
    var main = h("main", "wrap");
    var mx = section("matrix", "Architecture × cell",
      "Each cell: verdict (output / prompt positions), max |logprob diff| on prompt and output positions, first divergence, the lpf diff attribution; the name links to the cell's report.", "Matrix");
    var head = ["architecture"].concat(cells.map(function (c) { return c.name; }));
    var body = (D.audited || []).map(function (a) {
      return [txt("span", "mono", a.replace(/ForCausalLM$/, ""))].concat(cells.map(function (c) {
        var r = by[a + "|" + c.name];
        if (!r) return "–";
        if (r.status !== "ok") { var m = txt("span", "muted", r.status); m.title = r.error || ""; return m; }
        var box = h("div", "cellbox"), shown = judged(r);
        var v = r.link ? (function () { var l = h("a"); l.href = r.link; l.appendChild(badge(shown, true)); return l; })() : badge(shown, true);
        add(box, v);
        if (r.prompt_verdict && r.prompt_verdict !== r.verdict && shown === r.verdict) add(box, [" prompt ", badge(r.prompt_verdict, true)]);
        var how = judgedHow(r);
        if (how) add(box, txt("div", "cellnote", how));
        add(box, txt("div", "cellnote", "out " + fmt(r.max_abs_output) + " · prompt " + fmt(r.max_abs_prompt)));
        if (r.first_divergence != null || r.prompt_first_departure != null)
          add(box, txt("div", "cellnote", "first div " + fmt(r.first_divergence) + " · prompt " + fmt(r.prompt_first_departure)));
        var at = r.attribution || {};
        if (at.says) add(box, txt("div", "cellnote b", at.says));
        box.title = [at.sentence, r.top_hypothesis, r.prompt_shape].filter(Boolean).join("\n");
        return box;
      }));
    });
    add(mx, body.length ? table(head, body) : txt("div", "empty", "no architecture was audited"));
    main.appendChild(mx);
    function locateLine(lc) {  // the cell's `lpf locate` line, linked to its page
      if (!lc) return null;
      var el = h("div", "note", [txt("b", null, "locate: ")]);
      if (lc.link) { var a = txt("a", null, lc.sentence || "?"); a.href = lc.link; el.appendChild(a); }
      else el.appendChild(document.createTextNode(lc.sentence || ("not located: " + (lc.error || "?"))));
      return el;
    }
    var nc = section("findings", "Cells that are not clean", "Who departs (lpf diff against HF generate) and the best explanation.", "Findings");
    var badRows = rows.filter(function (r) { return r.status === "ok" && judged(r) && judged(r) !== "clean"; });
    add(nc, badRows.length ? h("ul", "sentences", badRows.map(function (r) {
      var at = r.attribution || {};
      return h("li", null, [txt("span", "pill", r.architecture.replace(/ForCausalLM$/, "") + " · " + r.cell), " ",
        txt("b", null, at.says || (at.error ? "not attributed: " + at.error : "not attributed")), " ",
        at.sentence || "", r.prompt_shape ? " · prompt: " + r.prompt_shape : "", r.top_hypothesis ? " · " + r.top_hypothesis : "",
        locateLine(r.locate)]);
    })) : txt("div", "empty", "every audited cell is clean"));
    var failed = rows.filter(function (r) { return r.status !== "ok"; });
    if (failed.length) add(nc, [txt("h4", null, "cells that did not run"), table(["architecture", "cell", "status", "reason"],
      failed.map(function (r) { return [r.architecture, r.cell, r.status, r.error]; }))]);
    var named = [];
    rows.forEach(function (r) {
      ((r.engine_judgement || {}).causes || []).forEach(function (c) {
        named.push([r.architecture.replace(/ForCausalLM$/, "") + " · " + r.cell, txt("b", null, c.name), c.says || "", c.evidence || ""]);
      });
    });
    if (named.length) add(nc, [txt("h4", null, "departures the engine's per-token judgement names (clean*)"),
      table(["cell", "cause", "what it is", "evidence"], named)]);
    main.appendChild(nc);
    var ref = D.reference_column || [];
    if (ref.length) {
      var rc = section("reference", "The reference on trial",
        "Each architecture's reference paths (decode, recurrent, float32 teacher-forced, eager) against its float64 teacher-forced gold: the largest |logprob diff| and, for a path that departs, the first position.", "Reference");
      var pathNames = [];
      ref.forEach(function (r) { Object.keys(r.paths || {}).forEach(function (n) { if (pathNames.indexOf(n) < 0) pathNames.push(n); }); });
      add(rc, table(["architecture", "status"].concat(pathNames, ["reason"]), ref.map(function (r) {
        var st = r.status === "reference inconsistent" ? txt("b", null, r.status) : (r.status || "?");
        return [txt("span", "mono", (r.architecture || "?").replace(/ForCausalLM$/, "")), st].concat(pathNames.map(function (n) {
          var p = (r.paths || {})[n];
          if (!p || p.max_abs == null) return "–";
          var fd = p.first_departure;  // {prompt, position}: where the path first departs from the gold
          var cellTxt = fmt(p.max_abs) + (fd ? " from position " + fmt(fd.position) + " of prompt " + fmt(fd.prompt) : "");
          return (r.departing || []).indexOf(n) >= 0 ? txt("b", null, cellTxt) : cellTxt;
        }), [r.reason || ""]);
      })));
      main.appendChild(rc);
    }
    var na = section("not-audited", "Architectures not audited", "Every stateful architecture either side lists, with the reason it was not audited.", "Not audited");
    add(na, (D.not_audited || []).length ? table(["architecture", "model type", "status", "reason"],
      D.not_audited.map(function (a) { return [txt("span", "mono", a.architecture), a.model_type, a.status, a.reason]; })) : txt("div", "empty", "none"));
    main.appendChild(na);
    var cs = section("cells", "Cell catalogue", "The knobs of each cell.", "Cells");
    add(cs, table(["cell", "dtype", "arguments", "stresses"], cells.map(function (c) { return [c.name, c.dtype, txt("span", "mono", (c.args || []).join(" ")), c.stresses]; })));
    main.appendChild(cs);
    app.appendChild(nav()); app.appendChild(main); app.appendChild(footer());
  }

  // -- RL page ---------------------------------------------------------------------------------------
  function rlPage() {
    var F = D.findings || {};
    var spikes = F.spikes || [], per = F.period || {};
    var verdict = typeof F.verdict === "string" ? F.verdict : (spikes.length ? "spikes" : "clean");
    app.appendChild(hero("logprob forensics · RL rollouts vs trainer", "RL report", verdict,
      [["steps", fmt(F.n_steps)], ["responses", fmt(F.n_responses)], ["tokens", fmt(F.n_tokens)]],
      [kpi("spike steps", fmt(spikes.length), spikes.length ? "first at step " + fmt(spikes[0].step) : "none"),
       kpi("period", per.period != null ? "every " + fmt(per.period) + " steps" : (per.note || "none"), "confidence " + fmt(per.confidence)),
       kpi("bad rows", fmt((F.bad_rows || []).length), "rows of the dump that could not be used")],
      null, spikes.length ? "corrupt" : "clean"));
    var main = h("main", "wrap");
    var top = (F.hypotheses || [])[0];
    var sr = section("series", "Per-step series", "One point per training step; red crosses mark spike steps.");
    if (typeof F.summary === "string" && F.summary) add(sr, h("div", "lead" + (spikes.length ? "" : " ok"), F.summary));
    if (top && top.sentence) add(sr, h("div", "lead", [txt("b", null, "Best explanation: "), top.sentence]));
    (D.charts || []).forEach(function (c) { add(sr, [txt("h3", null, c.title), plot(c.figure)]); });
    if (!(D.charts || []).length) add(sr, txt("div", "empty", "rl_steps.parquet has no metric columns"));
    main.appendChild(sr);
    var sp = section("spikes", "Spikes", "Steps whose robust z-score crossed the noise floor, with the requests behind them.");
    var ref = F.reference;  // the third opinion (lpf rl rescore): which side departs from the reference
    if (ref && ref.sentence) add(sp, h("div", "lead", [txt("b", null, "Third opinion: "), ref.sentence]));
    var head = ["step", "robust z", "requests", "positions"].concat(ref ? ["side"] : []);
    add(sp, spikes.length ? table(head, spikes.map(function (s) {
      var req = s.requests || [];
      var row = [s.step, s.robust_z, txt("span", "mono", req.slice(0, 8).join(", ") + (req.length > 8 ? " … (" + req.length + ")" : "")),
        txt("span", "mono", s.positions ? JSON.stringify(s.positions).slice(0, 160) : "")];
      return ref ? row.concat([s.side || "–"]) : row;
    })) : txt("div", "empty", "no spikes"));
    main.appendChild(sp);
    var C = F.causes;  // lpf rl explain: the mismatch split into named causes, each with its test and fix
    if (C && C.causes) {
      var cs = section("causes", "Causes", "The mismatch (" + C.mass + ") split into named causes; shares of sum |d| and of " +
        ((C.framework_metric || {}).name || "the framework's metric") + ".", "Causes");
      if (C.summary) add(cs, h("div", "lead" + (C.verdict === "inside-floor" ? " ok" : ""), C.summary));
      add(cs, table(["cause", "status", "share", "share (metric)", "evidence"], C.causes.map(function (c) {
        return [c.label, c.status, (100 * c.share).toFixed(1) + "%", (100 * c.share_metric).toFixed(1) + "%", c.evidence];
      })));
      C.causes.forEach(function (c) {
        if (c.status !== "named" || !c.fix) return;
        add(cs, [txt("h4", null, c.label + ": " + c.fix.why),
          table(["what", "setting"], (c.fix.fix || []).map(function (x) { return ["fix", txt("span", "mono", x)]; })
            .concat((c.fix.correction || []).map(function (x) { return ["correction", txt("span", "mono", x)]; })))]);
      });
      if ((C.wasted || []).length) add(cs, h("div", "lead", [txt("b", null, "Wasted on these causes: "), C.wasted.join("; ")]));
      (C.hints || []).forEach(function (x) { add(cs, txt("div", "lead", "hint: " + x)); });
      main.appendChild(cs);
    }
    var hy = section("hypotheses", "Mechanisms", "Features tested for association with spike steps, best first.");
    add(hy, hypotheses(F.hypotheses, "rl_findings.json has no ranked hypotheses"));
    main.appendChild(hy);
    var nf = section("noise", "Noise floor and input", "What counted as normal, and the dump rows that were skipped.");
    add(nf, kv(F.noise_floor || {}));
    var bad = F.bad_rows || [];
    if (bad.length) add(nf, [txt("h4", null, "bad rows"), table(["row", "reason"], bad.slice(0, 200).map(function (b) { return [b.row, b.reason]; }))]);
    main.appendChild(nf);
    app.appendChild(nav()); app.appendChild(main); app.appendChild(footer());
  }

  // a page with a script of its own (html.PAGE_SCRIPTS) gets the helpers it builds with
  var UI = { h: h, add: add, txt: txt, fmt: fmt, isNum: isNum, badge: badge, kpi: kpi, kv: kv, table: table,
             section: section, plot: plot, hero: hero, nav: nav, footer: footer, app: app, COLORS: COLORS };
  if (D.kind === "sweep") sweepPage();
  else if (D.kind === "conformance") conformancePage();
  else if (D.kind === "rl") rlPage();
  else if (window.lpfPages && window.lpfPages[D.kind]) window.lpfPages[D.kind](D, UI);
  else runPage();
  // data-ready tells a waiting reader (the browser tests) that every chart has been drawn
  drawPlots().then(function () { document.body.dataset.ready = "1"; },
                   function (e) { document.body.dataset.ready = "error"; console.error("lpf report: a chart failed", e); });
})();
