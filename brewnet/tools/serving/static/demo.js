// brewnet serve's demo page: the image goes to POST /predict as it is (its own content type),
// the top classes come back as JSON; the server's time is its Server-Timing header. With
// --heatmap-blob, POST /heatmap answers owl's heatmap over the image as a PNG. Errors are the
// server's own messages ({"error": ...}).
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const body = document.body;
  const heatmapBlob = body.dataset.heatmap;
  let previewUrl = null;
  let heatmapUrl = null;

  function state(s, text) {
    body.dataset.state = s;
    $("status").textContent = text;
  }

  function serverMs(resp) {
    const m = /dur=([0-9.]+)/.exec(resp.headers.get("Server-Timing") || "");
    return m ? parseFloat(m[1]) : null;
  }

  async function errorOf(resp) {
    try {
      const j = await resp.json();
      if (j && j.error) return j.error;
    } catch (e) { /* not JSON */ }
    return resp.status + " " + resp.statusText;
  }

  function show(top) {
    const list = $("top");
    list.replaceChildren();
    const probabilities = top.every((t) => t.score >= 0 && t.score <= 1);
    for (const t of top) {
      const li = document.createElement("li");
      li.dataset.index = t.index;
      li.dataset.score = t.score;
      const row = document.createElement("div");
      row.className = "row";
      const label = document.createElement("span");
      label.className = "label";
      label.textContent = t.label;
      const score = document.createElement("span");
      score.className = "score";
      score.textContent = probabilities ? (100 * t.score).toFixed(2) + " %" : t.score.toPrecision(4);
      row.append(label, score);
      li.append(row);
      if (probabilities) {
        const bar = document.createElement("div");
        bar.className = "bar";
        bar.style.width = (100 * t.score).toFixed(1) + "%";
        li.append(bar);
      }
      list.append(li);
    }
  }

  async function heatmap(file) {
    const resp = await fetch("/heatmap", { method: "POST", body: file,
                                          headers: { "Content-Type": file.type || "application/octet-stream" } });
    if (!resp.ok) throw new Error(await errorOf(resp));
    if (heatmapUrl) URL.revokeObjectURL(heatmapUrl);
    heatmapUrl = URL.createObjectURL(await resp.blob());
    const img = $("heatmap");
    await new Promise((done) => { img.onload = done; img.onerror = done; img.src = heatmapUrl; });
    const ms = serverMs(resp);
    $("heatmap-caption").textContent = "owl's heatmap of " + heatmapBlob + " over the image as the net sees it" +
      (ms === null ? "" : " (" + ms.toFixed(1) + " ms)");
    $("heatmap-box").hidden = false;
  }

  async function send(file) {
    if (!file) return;
    if (previewUrl) URL.revokeObjectURL(previewUrl);
    previewUrl = URL.createObjectURL(file);
    $("preview").src = previewUrl;
    $("preview").hidden = false;
    $("hint").hidden = true;
    $("error").hidden = true;
    $("top").replaceChildren();
    $("timing").hidden = true;
    $("heatmap-box").hidden = true;
    state("busy", "Classifying " + file.name + "...");
    const t0 = performance.now();
    try {
      const resp = await fetch("/predict", { method: "POST", body: file,
                                            headers: { "Content-Type": file.type || "application/octet-stream" } });
      const wall = performance.now() - t0;
      if (!resp.ok) throw new Error(await errorOf(resp));
      const answer = await resp.json();
      show(answer.top);
      const ms = serverMs(resp);
      $("timing").textContent = "Server: " + (ms === null ? "?" : ms.toFixed(1)) + " ms for the request; " +
        "round trip " + wall.toFixed(1) + " ms.";
      $("timing").dataset.serverMs = ms === null ? "" : ms;
      $("timing").hidden = false;
      if (heatmapBlob) await heatmap(file);
      state("done", "Top " + answer.top.length + " of " + answer.model + " for " + file.name + ":");
    } catch (e) {
      $("error").textContent = e.message;
      $("error").hidden = false;
      state("error", "The server could not classify " + file.name + ".");
    }
  }

  $("file").addEventListener("change", (e) => send(e.target.files[0]));
  const drop = $("drop");
  for (const name of ["dragenter", "dragover"]) {
    drop.addEventListener(name, (e) => { e.preventDefault(); drop.classList.add("over"); });
  }
  for (const name of ["dragleave", "drop"]) {
    drop.addEventListener(name, () => drop.classList.remove("over"));
  }
  drop.addEventListener("drop", (e) => {
    e.preventDefault();
    if (e.dataTransfer.files.length) send(e.dataTransfer.files[0]);
  });
})();
