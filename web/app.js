// The upload page: images + a question -> POST /v1/chat/completions (stream) -> the answer.
// Plain JS, no dependencies, no network beyond this server.
"use strict";

const MAX_IMAGE_BYTES = 20 * 1024 * 1024; // refuse larger files before sending them

const state = { model: null, history: [], pending: [], busy: false };
const $ = (id) => document.getElementById(id);

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

async function loadModel() {
  try {
    const response = await fetch("/v1/models");
    const body = await response.json();
    state.model = body.data[0].id;
    $("model-line").textContent = `Model: ${state.model}`;
  } catch (err) {
    $("model-line").textContent = "The server is not reachable. Is mm-serve running?";
  }
}

// ---- images: choose, drop, paste ---------------------------------------------------------

function readAsDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(new Error(`Could not read ${file.name}.`));
    reader.readAsDataURL(file);
  });
}

async function addFiles(files) {
  showError("");
  for (const file of files) {
    if (!file.type.startsWith("image/")) {
      showError(`${file.name || "That file"} is not an image (${file.type || "unknown type"}).`);
      continue;
    }
    if (file.size > MAX_IMAGE_BYTES) {
      const mb = (file.size / 1048576).toFixed(1);
      showError(`${file.name} is too large (${mb} MB); the limit is 20 MB.`);
      continue;
    }
    state.pending.push({ name: file.name || "pasted image", url: await readAsDataUrl(file) });
  }
  renderPreviews();
}

function renderPreviews() {
  const list = $("previews");
  list.replaceChildren();
  state.pending.forEach((image, index) => {
    const item = document.createElement("li");
    const img = document.createElement("img");
    img.src = image.url;
    img.alt = `Preview of ${image.name}`;
    const remove = document.createElement("button");
    remove.type = "button";
    remove.textContent = "×";
    remove.setAttribute("aria-label", `Remove ${image.name}`);
    remove.onclick = () => { state.pending.splice(index, 1); renderPreviews(); };
    item.append(img, remove);
    list.append(item);
  });
}

function setUpImageInputs() {
  const zone = $("drop-zone");
  $("file-input").addEventListener("change", (e) => { addFiles([...e.target.files]); e.target.value = ""; });
  zone.addEventListener("click", (e) => { if (e.target.tagName !== "LABEL") $("file-input").click(); });
  zone.addEventListener("keydown", (e) => {
    if (e.key === "Enter" || e.key === " ") { e.preventDefault(); $("file-input").click(); }
  });
  zone.addEventListener("dragover", (e) => { e.preventDefault(); zone.classList.add("dragging"); });
  zone.addEventListener("dragleave", () => zone.classList.remove("dragging"));
  zone.addEventListener("drop", (e) => {
    e.preventDefault();
    zone.classList.remove("dragging");
    addFiles([...e.dataTransfer.files]);
  });
  document.addEventListener("paste", (e) => {
    const files = [...e.clipboardData.items].filter((i) => i.kind === "file").map((i) => i.getAsFile());
    if (files.length) addFiles(files);
  });
}

// ---- the conversation ----------------------------------------------------------------------

function addMessage(role, text, images = []) {
  const box = document.createElement("article");
  box.className = `message ${role}`;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role === "user" ? "You" : "Assistant";
  box.append(label);
  for (const image of images) {
    const img = document.createElement("img");
    img.src = image.url;
    img.alt = image.name;
    box.append(img);
  }
  const body = document.createElement("p");
  body.className = "text";
  body.textContent = text;
  const stats = document.createElement("div");
  stats.className = "stats";
  box.append(body, stats);
  $("conversation").append(box);
  return { box, body, stats };
}

function userContent(text, images) {
  if (!images.length) return text;
  const parts = images.map((image) => ({ type: "image_url", image_url: { url: image.url } }));
  return [...parts, { type: "text", text }];
}

async function errorMessage(response) {
  let message = `The server answered ${response.status}.`;
  try {
    const body = await response.json();
    if (body.error && body.error.message) message = body.error.message;
  } catch (_) { /* not JSON */ }
  if (response.status === 413) message = `The upload is too large: ${message}`;
  return message;
}

// Reads the SSE stream; calls onChunk(json) per event until [DONE].
async function readEvents(response, onChunk) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onChunk(JSON.parse(data));
      }
    }
  }
}

function describeStats(started, firstToken, usage) {
  const end = performance.now();
  const parts = [];
  if (firstToken !== null) parts.push(`TTFT ${Math.round(firstToken - started)} ms`);
  if (usage && firstToken !== null && usage.completion_tokens > 1) {
    const seconds = (end - firstToken) / 1000;
    parts.push(`${((usage.completion_tokens - 1) / seconds).toFixed(1)} tokens/s`);
  }
  if (usage) {
    const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
    parts.push(`${usage.prompt_tokens} prompt tokens, ${cached} from cache`);
    parts.push(cached > 0 ? "image from cache: yes" : "image from cache: no");
  }
  return parts.join(" · ");
}

async function ask(question) {
  const images = state.pending.splice(0);
  renderPreviews();
  addMessage("user", question, images);
  state.history.push({ role: "user", content: userContent(question, images) });
  const answer = addMessage("assistant", "…");
  const started = performance.now();
  let firstToken = null;
  let usage = null;
  let text = "";
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({
      model: state.model,
      messages: state.history,
      stream: true,
      stream_options: { include_usage: true },
      max_tokens: 256,
    }),
  });
  if (!response.ok) {
    state.history.pop();
    answer.box.remove();
    throw new Error(await errorMessage(response));
  }
  await readEvents(response, (chunk) => {
    if (chunk.error) throw new Error(chunk.error.message);
    if (chunk.usage) usage = chunk.usage;
    const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
    if (delta && delta.content) {
      if (firstToken === null) firstToken = performance.now();
      text += delta.content;
      answer.body.textContent = text;
    }
  });
  state.history.push({ role: "assistant", content: text });
  answer.stats.textContent = describeStats(started, firstToken, usage);
}

function setUpForm() {
  const form = $("ask-form");
  const question = $("question");
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    const text = question.value.trim();
    if (!text || state.busy) return;
    state.busy = true;
    $("send").disabled = true;
    showError("");
    try {
      await ask(text);
      question.value = "";
    } catch (err) {
      const offline = err instanceof TypeError;
      showError(offline ? "The server is not reachable. Is mm-serve running?" : err.message);
    } finally {
      state.busy = false;
      $("send").disabled = false;
      question.focus();
    }
  });
  question.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); form.requestSubmit(); }
  });
  $("new-chat").addEventListener("click", () => {
    state.history = [];
    $("conversation").replaceChildren();
    showError("");
    question.focus();
  });
}

setUpImageInputs();
setUpForm();
loadModel();
