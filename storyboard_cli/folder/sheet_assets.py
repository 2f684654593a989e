"""The contact sheet's constant parts: its style sheet, its picking script, the content security policy that lets
only those two run, and the JSON island the script reads its state from. No torch."""

from __future__ import annotations

import base64
import hashlib
import json

STYLE = """
:root { color-scheme: light dark; --fg: #222; --bg: #fafafa; --card: #fff; --line: #ddd; --pick: #2e8b57;
  --bad: #c0392b; --warn: #b9770e; }
@media (prefers-color-scheme: dark) { :root { --fg: #eee; --bg: #1b1b1b; --card: #262626; --line: #444; } }
body { font: 14px/1.4 system-ui, sans-serif; color: var(--fg); background: var(--bg); margin: 0 1.5rem 4rem; }
header { position: sticky; top: 0; background: var(--bg); padding: .6rem 0; border-bottom: 1px solid var(--line);
  z-index: 1; display: flex; gap: 1rem; align-items: center; flex-wrap: wrap; }
header h1 { font-size: 1.2rem; margin: 0; }
.running { color: var(--warn); font-weight: bold; }
.figures { display: flex; flex-wrap: wrap; gap: 1rem; margin: 1rem 0; align-items: flex-start; }
.figures svg { background: var(--card); border: 1px solid var(--line); padding: 6px; max-width: 100%; height: auto; }
.figures svg text { fill: var(--fg); }
.shot { display: grid; grid-template-columns: minmax(16rem, 24rem) 1fr; gap: 1rem; padding: 1rem 0;
  border-bottom: 1px solid var(--line); }
.shot h2 { font-size: 1rem; margin: 0 0 .3rem; font-family: ui-monospace, monospace; }
.prompt { margin: .2rem 0; white-space: pre-wrap; overflow-wrap: anywhere; }
.negative { color: #888; white-space: pre-wrap; overflow-wrap: anywhere; }
dl { display: grid; grid-template-columns: auto 1fr; gap: 0 .6rem; margin: .4rem 0; font-size: 12px; }
dt { color: #888; } dd { margin: 0; overflow-wrap: anywhere; }
.control img { border: 1px solid var(--line); }
.guides { display: flex; flex-wrap: wrap; gap: .5rem; margin: .4rem 0; align-items: flex-start; }
.guide { margin: 0; font-size: 12px; }
.guide img { display: block; border: 1px solid var(--line); }
.guide.reference img { border: 2px solid #4a78c2; }
.guide figcaption { max-width: 9rem; overflow-wrap: anywhere; }
.guide .hole { width: 6rem; height: 6rem; }
.cands { display: flex; flex-wrap: wrap; gap: .8rem; align-items: flex-start; }
.cand { margin: 0; padding: 4px; border: 3px solid transparent; background: var(--card); border-radius: 4px; }
.cand:has(input:checked) { border-color: var(--pick); }
.cand img { display: block; }
.cand a { position: relative; display: block; }
.cand.refine { border-left: 3px solid var(--line); }
.mask-outline { position: absolute; left: 0; top: 0; pointer-events: none; }
.mask-outline rect { fill: none; stroke: #ff3b6b; stroke-width: 2px; stroke-dasharray: 4 3; }
.cand figcaption { font-size: 12px; display: flex; justify-content: space-between; gap: .5rem; }
.hole { width: 10rem; height: 8rem; display: flex; align-items: center; justify-content: center; text-align: center; padding: .5rem;
  box-sizing: border-box; border: 2px dashed var(--line); font-size: 12px; overflow-wrap: anywhere; }
.failed .hole { border-color: var(--bad); color: var(--bad); }
.stale { color: var(--warn); font-size: 12px; }
.choice { display: flex; gap: 1rem; font-size: 12px; margin-top: .4rem; }
.shot:has(.reroll:checked) .cands { opacity: .45; }
textarea { width: 100%; max-width: 48rem; height: 8rem; font-family: ui-monospace, monospace; }
.draft-mark { background: var(--warn); color: #fff; font-weight: bold; font-size: 11px; letter-spacing: .05em;
  padding: 0 .35rem; border-radius: 3px; text-transform: uppercase; }
.cand.draft img { outline: 2px dashed var(--warn); outline-offset: -2px; }
.frame { position: relative; }
.frame svg.boxes { position: absolute; left: 0; top: 0; pointer-events: none; overflow: visible; }
.boxes rect { fill: none; stroke: #ffd23f; stroke-width: 2; }
.boxes text { fill: #ffd23f; font-size: 11px; font-family: system-ui, sans-serif; paint-order: stroke;
  stroke: #000; stroke-width: 3px; }
"""

# The picking script. It reads the recorded picks from the JSON island, keeps no state of its own
# (the radio buttons are the state), and writes picks.yaml with JSON-quoted scalars: valid YAML,
# and a shot id like 001 or true stays a string.
SCRIPT = """
(function () {
  "use strict";
  var state = JSON.parse(document.getElementById("bcg-state").textContent);
  var shots = Array.prototype.slice.call(document.querySelectorAll("section.shot"));
  var out = document.getElementById("picks-yaml");
  var count = document.getElementById("picks-count");
  shots.forEach(function (sec) {
    var id = sec.dataset.shot, want = state.picks[id];
    var reroll = state.reroll.indexOf(id) >= 0;
    sec.querySelectorAll("input[type=radio]").forEach(function (r) {
      if ((reroll && r.classList.contains("reroll")) || (!reroll && want && r.value === want)) r.checked = true;
    });
  });
  function yaml() {
    var picks = [], rerolls = [];
    shots.forEach(function (sec) {
      var c = sec.querySelector("input[type=radio]:checked");
      if (!c || c.classList.contains("none")) return;
      if (c.classList.contains("reroll")) rerolls.push(sec.dataset.shot);
      else picks.push([sec.dataset.shot, c.value]);
    });
    var lines = ["# bcg picks for " + JSON.stringify(state.out),
                 state.draft ? "# drafts: bcg render JOB --final picks.yaml renders the picks at full quality; " +
                               "reroll: bcg render JOB --draft --reroll picks.yaml"
                             : "# apply: bcg pick OUT_DIR picks.yaml    reroll: bcg render JOB --reroll picks.yaml"];
    lines.push(picks.length ? "picks:" : "picks: {}");
    picks.forEach(function (p) { lines.push("  " + JSON.stringify(p[0]) + ": " + JSON.stringify(p[1])); });
    lines.push(rerolls.length ? "reroll:" : "reroll: []");
    rerolls.forEach(function (s) { lines.push("  - " + JSON.stringify(s)); });
    count.textContent = picks.length + " of " + shots.length + " shots picked, " + rerolls.length + " to reroll";
    return lines.join("\\n") + "\\n";
  }
  function refresh() { out.value = yaml(); }
  document.addEventListener("change", refresh);
  document.getElementById("save-picks").addEventListener("click", function () {
    refresh();
    var url = URL.createObjectURL(new Blob([out.value], {type: "text/yaml"}));
    var a = document.createElement("a");
    a.href = url; a.download = "picks.yaml";
    document.body.appendChild(a); a.click(); a.remove();
    setTimeout(function () { URL.revokeObjectURL(url); }, 1000);
  });
  refresh();
})();
"""


def csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


# Only our own script and style run: an injected <script> would be blocked even if escaping failed.
CSP = (f"default-src 'none'; img-src 'self' file: data:; style-src {csp_hash(STYLE)}; "
       f"script-src {csp_hash(SCRIPT)}; base-uri 'none'; form-action 'none'")


def json_island(data: object) -> str:
    # inside <script type=application/json>: '<' escaped so no text can close the element
    return json.dumps(data, ensure_ascii=False).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
