/* lpf report page of a locate directory (locate.json, via locate_page.py). report.js calls
   window.lpfPages.locate(D, UI) with its DOM helpers; every string goes in as text, never as HTML. */
(function () {
  "use strict";
  window.lpfPages = window.lpfPages || {};
  window.lpfPages.locate = function (D, UI) {
    var L = D.doc || {}, h = UI.h, add = UI.add, txt = UI.txt, fmt = UI.fmt;
    var T = L.target || {}, E = L.engine || {}, R = L.reference || {}, P = L.replay || {}, V = L.verdict || {};
    var loc = L.located, M = L.mamba, tr = L.trials || {};
    function sci(x) { return (typeof x === "number" && isFinite(x)) ? x.toExponential(2) : "–"; }
    var suspectColor = { engine: "corrupt", reference: "divergent", both: "systematic", nobody: "clean" }[V.suspect] || "noise";
    UI.app.appendChild(UI.hero("logprob forensics · locate", "Where the lie is born", V.suspect || "?",
      [["request", L.request_id || "?"], ["engine", (E.name || "?") + " " + (E.version || "")], ["model", E.model || "?"],
       ["reference", R.implementation || R.spec || "?"]],
      [UI.kpi("output position", fmt(T.output_position), T.why || ""),
       UI.kpi("first departure", loc ? loc.op : "none", loc ? loc.token : "nothing departs beyond its floor"),
       UI.kpi("beyond its floor", loc ? fmt(loc.ratio) + "×" : "–", loc ? "rel error " + sci(loc.rel_error) : ""),
       UI.kpi("steps replayed", fmt(P.steps_replayed) + " / " + fmt(P.steps_scheduled),
              P.reproduces === true ? "reproduces the run's logprobs" : P.reproduces === false ? "does NOT reproduce the run" : "")],
      null, suspectColor));
    var main = h("main", "wrap");

    var fs = UI.section("finding", "Finding", "The first op, in execution order and token order, whose engine value departs from the reference beyond that op's own dtype floor.", "Finding");
    add(fs, h("div", "lead" + (V.suspect === "nobody" ? " ok" : ""), [txt("b", null, "Suspect: " + (V.suspect || "?") + ". "), L.sentence || ""]));
    if (L.details) add(fs, txt("p", "note", L.details));
    if (loc) add(fs, UI.table(["op", "what", "token", "rel error", "floor", "engine norm", "reference norm"],
      [[txt("span", "mono", loc.op), loc.description, loc.token, sci(loc.rel_error), sci(loc.floor), sci(loc.engine_norm), sci(loc.reference_norm)]]));
    if (M) add(fs, UI.table(["Mamba layer", "step starts at", "input state", "engine state norm", "reference state norm", "rel error"],
      [[M.layer, M.start_token, txt("span", "pill" + (M.input_state === "differed" ? "" : " default"), M.input_state),
        sci(M.engine_state_norm), sci(M.reference_state_norm), sci(M.state_in_rel_error)]]));
    if (L.input) add(fs, txt("p", "note", "its input (" + L.input.op + ") " + (L.input.agreed ? "agreed" : "already differed") +
      " there: rel error " + sci(L.input.rel_error)));
    main.appendChild(fs);

    var ch = UI.section("departure", "The departure along the forward pass", "Per op in execution order: the largest relative error of the engine against the reference's teacher-forced pass, the op's floor, and the reference's own trials beside it.", "Departure");
    if (D.chart) add(ch, UI.plot(D.chart));
    if (D.map) add(ch, [txt("h3", null, "per op and token position: log10(error / floor)"), UI.plot(D.map)]);
    main.appendChild(ch);

    var rt = UI.section("trials", "The reference on trial", "Is the reference itself consistent? float32 against the float64 gold, its decode path (one token at a time with its cache) against its teacher-forced pass, its attention implementations against each other.", "Reference");
    var g = tr.gold || {};
    var rows = [["float64 gold", g.agrees === true ? "agrees" : g.agrees === false ? "departs" : "–",
                 g.worst_op ? g.worst_op + ": " + fmt(g.worst_epsilons) + " ε (tolerance " + fmt(g.tolerance_epsilons) + ")" : "–"]];
    [["decode_path", "decode path"], ["attention", "attention implementations"], ["engine_vs_decode_path", "engine vs decode path"]].forEach(function (k) {
      var t = tr[k[0]];
      if (!t) return;
      var f = t.first_departure;
      rows.push([k[1], f ? "departs" : "agrees", f ? f.op + " at " + f.token + ": rel error " + sci(f.rel_error) + ", " + fmt(f.ratio) + "× floor" : "no op beyond its floor"]);
    });
    add(rt, UI.table(["trial", "result", "first departure"], rows));
    main.appendChild(rt);

    var rp = UI.section("replay", "The replay", "The request's exact tokens through the engine under test, with the run's own schedule where the engine allows.", "Replay");
    var chk = P.check || {};
    add(rp, txt("p", "note", (E.schedule || "") + (chk.positions ? " · replayed logprobs vs the run's: max |diff| " + sci(chk.max_abs_logprob_diff) + " over " + chk.positions + " output positions" : "")));
    var steps = P.steps || [];
    if (steps.length) add(rp, UI.table(["step", "phase", "tokens", "batch", "slot", "state read at", "last written by"], steps.slice(0, 200).map(function (s) {
      var w = (s.state_last_written_by || []).map(function (x) { return x ? x.request_id + "@" + x.step : "zeros"; }).join(", ");
      return [s.step, s.phase, s.first_position + ".." + s.last_position, s.batch_size, s.state_slot,
              s.state_read_offset === null || s.state_read_offset === undefined ? "–" : s.state_read_offset, txt("span", "mono", w || "–")];
    })));
    main.appendChild(rp);

    var md = UI.section("modules", "Every op", "Engine against reference, per op in execution order.", "Ops");
    add(md, UI.table(["op", "what", "max rel error", "at", "floor", "× floor", "first departs", "gold", "decode path"], (D.modules || []).map(function (m) {
      return [txt("span", "mono", m.op), m.description, sci(m.max_rel_error), m.at, sci(m.floor), fmt(m.ratio), m.first_departure === null ? "–" : m.first_departure,
              sci(m.gold_max_rel_error), sci(m.decode_path_max_rel_error)];
    })));
    main.appendChild(md);
    UI.app.appendChild(UI.nav()); UI.app.appendChild(main); UI.app.appendChild(UI.footer());
  };
})();
