// The run inspector's live refresh (runs/pages.py): while the run is live, ask for the page's
// live part every few seconds and swap it in, without reloading the page. Attempts a reader
// opened stay open, and the page does not jump. The answer for an ended run says
// data-live="false", and the polling stops. A file of this origin, so the
// Content-Security-Policy (script-src 'self') lets it run; no library is needed.
"use strict";
(function () {
  function schedule() {
    const live = document.getElementById("live");
    if (!live || live.dataset.live !== "true") return;
    const seconds = Number(live.dataset.refresh) || 2;
    window.setTimeout(refresh, seconds * 1000);
  }

  async function refresh() {
    const live = document.getElementById("live");
    if (!live) return;
    if (document.hidden) { schedule(); return; }
    try {
      const answer = await fetch(live.dataset.url, {
        credentials: "same-origin", headers: { "Accept": "text/html" }, cache: "no-store",
      });
      if (answer.ok) {
        const holder = document.createElement("template");
        holder.innerHTML = (await answer.text()).trim();
        const fresh = holder.content.getElementById("live");
        if (fresh) {
          live.querySelectorAll("details[open]").forEach(function (open) {
            const again = open.id && fresh.querySelector("#" + CSS.escape(open.id));
            if (again) again.open = true;
          });
          live.replaceWith(fresh);
        }
      }
    } catch (error) {
      // A network blip: try again at the next tick.
    }
    schedule();
  }

  // A graph node links to its latest attempt (#attempt-<id>): open those details.
  function openTarget() {
    const id = decodeURIComponent(window.location.hash.slice(1));
    const target = id && document.getElementById(id);
    if (target && target.tagName === "DETAILS") {
      target.open = true;
      target.scrollIntoView({ block: "start" });
    }
  }

  function start() {
    openTarget();
    schedule();
  }

  window.addEventListener("hashchange", openTarget);
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
