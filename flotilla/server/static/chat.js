// flotilla chat page: one websocket to /ws, replies streamed as "delta" frames.
(() => {
  "use strict";
  const $ = (id) => document.getElementById(id);
  const els = {
    model: $("model"), status: $("status"), messages: $("messages"), empty: $("empty"), input: $("input"),
    form: $("form"), send: $("send"), stop: $("stop"), stats: $("stats"), banner: $("banner"),
    system: $("system"), temperature: $("temperature"), maxTokens: $("max-tokens"), apiKey: $("api-key"),
    keyRow: $("key-row"), settings: $("settings"), settingsToggle: $("settings-toggle"), newChat: $("new-chat"),
  };
  const store = window.localStorage;
  const state = { ws: null, history: [], reply: null, retry: 0, maxModelLen: null, maxFrameBytes: null };
  const DEFAULT_MAX_TOKENS = 512;
  const DEFAULT_TEMPERATURE = 0.7;  // the settings field's own default: an emptied field means it, not the API's 1.0

  // ---------------------------------------------------------------------- settings
  for (const [el, key] of [[els.system, "system"], [els.temperature, "temperature"],
                           [els.maxTokens, "maxTokens"], [els.apiKey, "apiKey"]]) {
    const saved = store.getItem("flotilla." + key);
    if (saved !== null) el.value = saved;
    el.addEventListener("change", () => store.setItem("flotilla." + key, el.value));
  }
  if (els.apiKey.value) els.keyRow.hidden = false;
  els.settingsToggle.addEventListener("click", () => {
    els.settings.hidden = !els.settings.hidden;
    els.settingsToggle.setAttribute("aria-expanded", String(!els.settings.hidden));
  });

  // -------------------------------------------------------------------- connection
  function connect() {
    const proto = location.protocol === "https:" ? "wss" : "ws";
    const key = els.apiKey.value.trim();
    const url = `${proto}://${location.host}/ws` + (key ? `?api_key=${encodeURIComponent(key)}` : "");
    const ws = new WebSocket(url);
    state.ws = ws;
    setStatus("connecting");
    ws.onopen = () => {
      if (state.retry >= 2) showBanner("");  // back after a reconnecting notice
      state.retry = 0;
    };
    ws.onmessage = (ev) => onFrame(JSON.parse(ev.data));
    ws.onclose = (ev) => {
      setStatus("closed");
      if (state.reply) finishReply({ finish_reason: "disconnected" });
      if (ev.code === 1009) showBanner("The server closed the connection: that message is too large for it.");
      if (ev.code === 4003) {  // this page's origin is refused (a proxy that does not pass the Host header on)
        showBanner(`The server refused this page: ${ev.reason}`);
        return;
      }
      if (ev.code === 1008) {
        els.keyRow.hidden = false;
        els.settings.hidden = false;
        showBanner(key ? "The server refused that API key — check it in Settings."
                       : `${ev.reason || "unauthorized"} — enter the API key in Settings.`);
        els.apiKey.addEventListener("change", connect, { once: true });
        return;
      }
      // the server is down or restarting: say so while the page tries again (from the second failed try on)
      if (state.retry >= 1 && ev.code !== 1009) showBanner("The server is not answering; reconnecting…");
      const delay = Math.min(8000, 500 * 2 ** state.retry++);
      setTimeout(connect, delay);
    };
  }

  function setStatus(s) {
    els.status.dataset.state = s;
    els.status.title = s;
    updateButtons();
  }

  function showBanner(text) {
    els.banner.textContent = text;
    els.banner.hidden = !text;
  }

  // ------------------------------------------------------------------------ frames
  function onFrame(f) {
    switch (f.type) {
      case "ready":
        els.model.textContent = f.model;
        state.maxModelLen = f.max_model_len;
        state.maxFrameBytes = f.max_frame_bytes || null;
        els.maxTokens.title = `at most ${replyCap()} here: half of the model's ${f.max_model_len}-token context`;
        setStatus("open");
        showBanner("");
        break;
      case "start":
        if (!state.reply || state.reply.id) break;
        state.reply.id = f.id;
        if (f.dropped_messages > 0 && !state.reply.discard) dropOldest(f.dropped_messages);
        break;
      case "delta":
        if (!state.reply || state.reply.discard || f.id !== state.reply.id) break;
        if (state.reply.first === null) state.reply.first = performance.now();
        const follow = atBottom();  // follow the stream only while the reader is at its end
        if (f.reasoning) showReasoning(state.reply, f.reasoning);
        state.reply.text += f.text;
        state.reply.deltas += 1;
        state.reply.body.textContent = state.reply.text;
        showLiveStats();
        if (follow) scrollDown();
        break;
      case "done":
        if (state.reply && f.id === state.reply.id) finishReply(f);
        break;
      case "error": {  // the request was refused (no id), or the reply failed (its "done" follows: ignored)
        const r = state.reply;
        if (r && ((!f.id && !r.id) || f.id === r.id)) {  // an id-less error ends only a reply not yet started
          r.el.classList.add("error");
          finishReply({ finish_reason: "error" }, f.message);
        }
        if (!r || !r.discard) showBanner(f.message);
        break;
      }
    }
  }

  // ----------------------------------------------------------------------- replies
  // serve --reasoning-parser: the reply's <think> block, folded above its answer (open while it streams)
  // and never sent back to the model with the conversation
  function showReasoning(r, text) {
    if (!r.thinking) {
      const box = document.createElement("details");
      box.className = "thinking";
      box.open = true;
      const summary = document.createElement("summary");
      summary.textContent = "Thinking…";
      const body = document.createElement("div");
      box.append(summary, body);
      r.el.insertBefore(box, r.body);
      r.thinking = { box, summary, body, text: "" };
    }
    r.thinking.text += text;
    r.thinking.body.textContent = r.thinking.text;
  }

  function addMessage(role, text) {
    els.empty.hidden = true;
    const el = document.createElement("div");
    el.className = `msg ${role}`;
    const body = document.createElement("span");
    body.className = "body";
    body.textContent = text;
    el.appendChild(body);
    els.messages.appendChild(el);
    scrollDown();
    return { el, body };
  }

  // The longest reply asked for: half the context, as `runtime chat` keeps; the server drops the oldest
  // turns ("fit_context") so that the prompt leaves room for it.
  function replyCap() { return state.maxModelLen ? Math.max(1, Math.floor(state.maxModelLen / 2)) : Infinity; }

  function dropOldest(n) {  // the server left out the n oldest messages: so do later sends
    const gone = state.history.splice(0, n);
    for (const m of gone) {
      m.el.classList.add("dropped");
      m.el.title = "no longer sent to the model: the conversation outgrew its context";
    }
    const note = document.createElement("div");
    note.className = "notice";
    note.textContent = `The ${n} oldest message${n === 1 ? "" : "s"} no longer fit the model's ` +
      `${state.maxModelLen}-token context and ${n === 1 ? "was" : "were"} dropped from the conversation.`;
    const current = state.history[state.history.length - 1];
    els.messages.insertBefore(note, current ? current.el : state.reply.el);
  }

  function send(text) {
    if (!text.trim() || state.reply || !isOpen()) return false;
    const messages = [];
    const system = els.system.value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...state.history.map(({ role, content }) => ({ role, content })), { role: "user", content: text });
    const frame = { type: "chat", messages, fit_context: true };
    const t = parseFloat(els.temperature.value);
    frame.temperature = Number.isNaN(t) ? DEFAULT_TEMPERATURE : t;
    const m = parseInt(els.maxTokens.value, 10);
    frame.max_tokens = Math.min(Number.isNaN(m) || m < 1 ? DEFAULT_MAX_TOKENS : m, replyCap());
    const data = JSON.stringify(frame);
    const size = new TextEncoder().encode(data).length;
    if (state.maxFrameBytes && size > state.maxFrameBytes) {  // the server would refuse it (or drop the socket)
      showBanner(`That message is too large for this server: the conversation is ${size} bytes and the limit ` +
                 `is ${state.maxFrameBytes}. Shorten it, or start a new chat.`);
      return false;
    }
    showBanner("");
    state.history.push({ role: "user", content: text, el: addMessage("user", text).el });
    const { el, body } = addMessage("assistant", "");
    el.classList.add("streaming");
    state.reply = { id: null, el, body, text: "", deltas: 0, start: performance.now(), first: null };
    state.ws.send(data);
    updateButtons();
    return true;
  }

  function finishReply(f, error) {
    const r = state.reply;
    if (!r) return;
    state.reply = null;
    if (r.discard) { updateButtons(); return; }
    r.el.classList.remove("streaming");
    r.el.dataset.finish = f.finish_reason || "";
    if (r.thinking) {
      r.thinking.summary.textContent = "Thought";
      r.thinking.box.open = !r.text;  // folded once there is an answer
    }
    if (r.text) state.history.push({ role: "assistant", content: r.text, el: r.el });
    else {  // nothing came back (refused, stopped at once, or only thinking): later sends leave the question out
      const asked = state.history.pop();
      if (f.finish_reason === "error" && !r.id && asked) {  // refused: the text back in the box, not in the chat
        asked.el.remove();
        if (!els.input.value) {
          els.input.value = asked.content;
          autosize();
        }
      }
    }
    const meta = document.createElement("span");
    meta.className = "meta";
    const tokens = f.usage ? f.usage.completion_tokens : r.deltas;
    const rate = f.timing && f.timing.tokens_per_second;
    const label = { stop: "", length: " · hit max tokens", cancelled: " · stopped", abort: " · cancelled by server",
                    disconnected: " · connection lost",
                    error: r.id ? ` · failed: ${error || "error"}` : " · refused" }[f.finish_reason] ?? "";
    meta.textContent = `${tokens} tokens` + (rate ? ` · ${rate.toFixed(1)} tok/s` : "") + label;
    r.el.appendChild(meta);
    els.stats.textContent = meta.textContent + (f.timing && f.timing.ttft != null
      ? ` · first token ${(f.timing.ttft * 1000).toFixed(0)} ms` : "");
    updateButtons();
  }

  function showLiveStats() {
    const r = state.reply;
    const secs = (performance.now() - r.first) / 1000;
    const rate = r.deltas > 1 && secs > 0 ? (r.deltas - 1) / secs : 0;
    els.stats.textContent = `${r.deltas} tokens · ${rate.toFixed(1)} tok/s`;
  }

  function isOpen() { return state.ws && state.ws.readyState === WebSocket.OPEN; }

  function updateButtons() {
    const streaming = !!state.reply;
    els.send.hidden = streaming;
    els.stop.hidden = !streaming;
    els.send.disabled = !isOpen();
  }

  function scrollDown() { els.messages.scrollTop = els.messages.scrollHeight; }
  // within a line of the end: a reader who scrolled up to read is left where they are
  function atBottom() {
    const m = els.messages;
    return m.scrollHeight - m.scrollTop - m.clientHeight < 24;
  }

  // ------------------------------------------------------------------------ inputs
  els.form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = els.input.value;
    if (!text.trim() || state.reply || !isOpen()) return;
    if (!send(text)) return;  // refused here: the text stays in the box
    els.input.value = "";
    autosize();
  });
  els.input.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      els.form.requestSubmit();
    }
  });
  function autosize() {
    els.input.style.height = "auto";
    els.input.style.height = Math.min(200, els.input.scrollHeight) + "px";
  }
  els.input.addEventListener("input", autosize);
  els.stop.addEventListener("click", () => { if (state.reply && isOpen()) state.ws.send('{"type":"cancel"}'); });
  els.newChat.addEventListener("click", () => {
    if (state.reply) {  // the old reply ends with its "done" frame; until then Send waits
      state.reply.discard = true;
      if (isOpen()) state.ws.send('{"type":"cancel"}');
    }
    state.history = [];
    for (const el of [...els.messages.querySelectorAll(".msg, .notice")]) el.remove();
    els.empty.hidden = false;
    els.stats.textContent = "";
    showBanner("");
    updateButtons();
    els.input.focus();
  });

  connect();
  els.input.focus();
})();
