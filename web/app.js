// The upload page: images + a question -> POST /v1/chat/completions (stream) -> the answer.
// Plain JS, no dependencies, no network beyond this server.
"use strict";

const MAX_IMAGE_BYTES = 20 * 1024 * 1024; // refuse larger files before sending them
const KEY_STORAGE = "mm_serve.api_key"; // sessionStorage: forgotten when the tab closes
const UNREACHABLE = "The server is not reachable. Is mm-serve running?";
const CUT_OFF = "The connection to the server was lost before the answer was complete.";

// history: the messages sent with the next question; retry: what the Retry button repeats.
const state = { model: null, history: [], pending: [], busy: false, retry: null };
const $ = (id) => document.getElementById(id);

// A request that failed: its message is for people; `status` is the HTTP status (0: none).
class RequestFailed extends Error {
  constructor(message, { status = 0, retryable = false } = {}) {
    super(message);
    this.status = status;
    this.retryable = retryable;
  }
}

function showError(message, retry = null) {
  $("error").textContent = message;
  $("error-box").hidden = !message;
  state.retry = retry;
  $("retry").hidden = !retry;
}

// Shows a failed request's message; a connection failure offers `retry`, a 401 the key field.
function report(err, retry) {
  if (!(err instanceof RequestFailed)) {
    showError(`Something went wrong in the page: ${err.message}`);
    return;
  }
  if (err.status === 401) showKeyForm();
  showError(err.message, err.retryable ? retry : null);
}

// ---- talking to the server -----------------------------------------------------------------

function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

function showKeyForm() {
  $("key-form").hidden = false;
  $("api-key").focus();
}

async function httpError(response) {
  let message = `The server answered ${response.status}.`;
  try {
    const body = await response.json();
    if (body.error && body.error.message) message = body.error.message;
  } catch (_) { /* not JSON */ }
  const status = response.status;
  if (status === 401 && apiKey()) message = "Unauthorized: the server did not accept this API key.";
  if (status === 401 && !apiKey()) {
    message = "Unauthorized: this server needs an API key (mm-serve serve --api-key): "
      + "enter it in the API key field.";
  }
  if (status === 413) message = `The upload is too large: ${message}`;
  return new RequestFailed(message, { status, retryable: status === 429 || status >= 500 });
}

// fetch with the API key; throws RequestFailed for a network failure or an error status.
async function send(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  if (apiKey()) headers.Authorization = `Bearer ${apiKey()}`;
  let response;
  try {
    response = await fetch(path, { ...options, headers });
  } catch (_) {
    throw new RequestFailed(UNREACHABLE, { retryable: true });
  }
  if (!response.ok) throw await httpError(response);
  return response;
}

// The model's name in the header; a failure is told there, with Reconnect when it may pass.
async function loadModel() {
  const line = $("model-line");
  $("reconnect").hidden = true;
  try {
    const body = await (await send("/v1/models")).json();
    state.model = body.data[0].id;
    line.textContent = `Model: ${state.model}`;
    line.className = "muted";
    showError("");
  } catch (err) {
    line.textContent = err.message;
    line.className = "error";
    if (err.status === 401) showKeyForm();
    $("reconnect").hidden = !err.retryable;
  }
}

function setUpKeyForm() {
  $("api-key").value = apiKey();
  if (apiKey()) $("key-form").hidden = false;
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const key = $("api-key").value.trim();
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    else sessionStorage.removeItem(KEY_STORAGE);
    loadModel();
  });
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

function countImages(messages) {
  const parts = messages.flatMap((m) => (Array.isArray(m.content) ? m.content : []));
  return parts.filter((part) => part.type === "image_url").length;
}

// Reads the SSE stream; calls onChunk(json) per event until [DONE].
// Throws RequestFailed when the connection breaks or closes before [DONE].
async function readEvents(response, onChunk) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    let chunk;
    try {
      chunk = await reader.read();
    } catch (_) {
      throw new RequestFailed(CUT_OFF, { retryable: true });
    }
    if (chunk.done) throw new RequestFailed(CUT_OFF, { retryable: true });
    buffer += decoder.decode(chunk.value, { stream: true });
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

// A chunk carries a generated token as vLLM counts them: text, or "" without a role (a token
// with no text of its own); the first chunk of a choice has the role alone.
function isTokenChunk(delta) {
  return Boolean(delta) && (Boolean(delta.content) || (delta.content === "" && !("role" in delta)));
}

// TTFT: from sending to the first token. tokens/s: the tokens after the first over the time
// from the first to the last; shown only when at least 2 tokens follow the first (a short
// answer's last token, often the end-of-text one, arrives at once: no rate to speak of).
function describeTiming(timing, usage) {
  const parts = [];
  if (timing.first !== null) parts.push(`TTFT ${Math.round(timing.first - timing.started)} ms`);
  if (!usage) return parts;
  let tokens = `${usage.completion_tokens} tokens`;
  const following = usage.completion_tokens - 1;
  const seconds = (timing.last - timing.first) / 1000;
  if (following >= 2 && seconds > 0) tokens += `, ${(following / seconds).toFixed(1)} tokens/s`;
  parts.push(tokens);
  return parts;
}

// The prefix-cache hit in tokens; "image from cache" when an image was not encoded again
// (its embeddings were in the encoder cache, or its KV in the prefix cache).
function describeCache(usage, numImages) {
  const details = usage.prompt_tokens_details || {};
  const cachedImages = details.cached_images || 0;
  const cachedTokens = details.cached_tokens || 0;
  const parts = [`${usage.prompt_tokens} prompt tokens, ${cachedTokens} from the prefix cache`];
  if (numImages === 1) parts.push(`image from cache: ${cachedImages ? "yes" : "no"}`);
  if (numImages > 1) parts.push(`images from cache: ${cachedImages} of ${numImages}`);
  return parts;
}

// Streams the answer to state.history into `answer`; returns its text.
async function streamAnswer(answer) {
  const numImages = countImages(state.history);
  const timing = { started: performance.now(), first: null, last: null };
  let usage = null;
  let text = "";
  const response = await send("/v1/chat/completions", {
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
  await readEvents(response, (chunk) => {
    if (chunk.error) {
      const retryable = chunk.error.type === "server_error";
      throw new RequestFailed(chunk.error.message, { retryable });
    }
    if (chunk.usage) usage = chunk.usage;
    const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
    if (!isTokenChunk(delta)) return;
    timing.last = performance.now();
    if (timing.first === null) timing.first = timing.last;
    text += delta.content;
    answer.body.textContent = text;
  });
  const stats = describeTiming(timing, usage);
  if (usage) stats.push(...describeCache(usage, numImages));
  answer.stats.textContent = stats.join(" · ");
  return text;
}

// One turn. On failure the turn leaves the view as it leaves the history, and its images go
// back to the form (the question is still there): Send or Retry asks again.
async function ask(question) {
  const images = state.pending.splice(0);
  renderPreviews();
  const shown = [addMessage("user", question, images), addMessage("assistant", "…")];
  state.history.push({ role: "user", content: userContent(question, images) });
  try {
    const text = await streamAnswer(shown[1]);
    state.history.push({ role: "assistant", content: text });
  } catch (err) {
    state.history.pop();
    shown.forEach((message) => message.box.remove());
    state.pending.unshift(...images);
    renderPreviews();
    throw err;
  }
}

function setUpForm() {
  const form = $("ask-form");
  const question = $("question");
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    const text = question.value.trim();
    if (!text || state.busy) return;
    state.busy = true;
    $("send").disabled = $("new-chat").disabled = true;
    showError("");
    try {
      await ask(text);
      question.value = "";
    } catch (err) {
      report(err, () => form.requestSubmit());
    } finally {
      state.busy = false;
      $("send").disabled = $("new-chat").disabled = false;
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
  $("retry").addEventListener("click", () => state.retry && state.retry());
  $("reconnect").addEventListener("click", loadModel);
}

setUpImageInputs();
setUpKeyForm();
setUpForm();
loadModel();
