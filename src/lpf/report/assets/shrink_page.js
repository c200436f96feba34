/* lpf report page of a shrink directory (shrink.json, via shrink_page.py). report.js calls
   window.lpfPages.shrink(D, UI) with its DOM helpers; every string goes in as text, never as HTML. */
(function () {
  "use strict";
  window.lpfPages = window.lpfPages || {};
  window.lpfPages.shrink = function (D, UI) {
    var S = D.shrink || {}, steps = D.steps || [], h = UI.h, add = UI.add, txt = UI.txt, fmt = UI.fmt;
    var O = S.original || {}, M = S.minimal || null, row = S.target_row || {};
    var os = O.size || [], ms = (M && M.size) || [];
    function knobs(c) {
      var k = (c && c.config && c.config.knobs) || {};
      return Object.keys(k).sort().map(function (n) { return n + "=" + k[n]; }).join(", ") || "engine defaults";
    }
    var status = { "done": "a minimum", "budget-spent": "budget spent (best so far)", "not-reproduced": "did not reproduce",
                   "running": "running" }[S.status] || S.status;
    UI.app.appendChild(UI.hero("logprob forensics · shrink", "Shrink report", row.verdict,
      [["target", S.target || "?"], ["engine", ((S.engine || {}).name || "?") + " " + ((S.engine || {}).version || "")],
       ["model", S.model || "?"], ["status", status]],
      [UI.kpi("requests", fmt(os[0]) + " → " + (M ? fmt(ms[0]) : "–"), "original → minimal"),
       UI.kpi("tokens", fmt(os[1]) + " → " + (M ? fmt(ms[1]) : "–"), "prompt + max_tokens"),
       UI.kpi("knobs off default", fmt(os[2]) + " → " + (M ? fmt(ms[2]) : "–"), "the drill itself not counted"),
       UI.kpi("runs", fmt(S.runs_used) + " / " + fmt(S.budget_runs), "k-of-n " + fmt(S.need) + "-of-" + fmt(S.tries))]));
    var main = h("main", "wrap");

    var sum = UI.section("minimal", "Original vs minimal", "The same lie, with as little as it needs.", "Minimal");
    add(sum, h("div", "lead", [txt("b", null, "The lie: "), S.signature_description || "?"]));
    if (S.signature_note) add(sum, txt("p", "note", S.signature_note));
    add(sum, UI.table(["", "original", "minimal"], [
      ["requests", os[0], M ? ms[0] : null], ["tokens (prompt + max_tokens)", os[1], M ? ms[1] : null],
      ["knobs off the engine's default", knobs(O), M ? knobs(M) : "–"]]));
    var conf = S.confirmation || {};
    if (conf.note) add(sum, txt("p", "note", "reproducibility: " + conf.note));
    else if (S.deterministic !== null && S.deterministic !== undefined)
      add(sum, txt("p", "note", S.deterministic ? "the engine was deterministic here" : "the engine was not deterministic here"));
    if (S.status === "not-reproduced") add(sum, h("div", "lead", "The lie did not reproduce in " + fmt(S.tries) +
      " tries of the original configuration, nor in any smaller one: a one-off, not a minimum."));
    if ((D.files || []).length) {
      var files = h("div", null, [txt("b", null, "files: ")]);
      D.files.forEach(function (f, i) { var a = txt("a", "mono", f); a.href = f; add(files, [i ? " · " : null, a]); });
      add(sum, files);
    }
    main.appendChild(sum);

    var se = UI.section("steps", "The search", "Every configuration tried, in order: requests (ddmin), then lengths, then knobs toward the engine's defaults.", "Steps");
    if (D.chart) add(se, UI.plot(D.chart));
    add(se, steps.length ? UI.table(["candidate", "phase", "tried", "size", "outcome", "runs"], steps.map(function (s) {
      var runs = h("div");
      (s.tries || []).forEach(function (t) {
        var label = (t.dir || "?") + ": " + (t.seen || "");
        var el = t.link ? txt("a", "mono", label) : txt("span", "mono", label);
        if (t.link) el.href = t.link;
        add(runs, h("div", null, el));
      });
      var outcome = h("span", null, [txt("span", "pill" + (s.status === "reproduces" ? "" : " default"), s.status || "?"),
                                     s.adopted ? " adopted" : null]);
      return [txt("span", "mono", s.id), s.phase, s.step, s.description, outcome, runs];
    })) : txt("div", "empty", "no candidate ran yet"));
    main.appendChild(se);
    UI.app.appendChild(UI.nav()); UI.app.appendChild(main); UI.app.appendChild(UI.footer());
  };
})();
